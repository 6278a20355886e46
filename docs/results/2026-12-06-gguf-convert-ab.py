"""A GGUF file converted by transformers whole (old) or one tensor at a time (new); prints time and peak RSS.

Usage: python 2026-12-06-gguf-convert-ab.py old|new OUT_DIR [FILE.gguf]  (docs/results/2026-12-06-export-memory-2.md)
"""
import sys, time, resource, shutil
from pathlib import Path
mode, out = sys.argv[1], Path(sys.argv[2])
gg = Path("/root/.cache/specedge/models/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf")
if len(sys.argv) > 3: gg = Path(sys.argv[3])
shutil.rmtree(out, ignore_errors=True)
t = time.time()
if mode == "old":
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(gg.parent), gguf_file=gg.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gg.parent), gguf_file=gg.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"): del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True); tok.save_pretrained(str(out))
else:
    from specedge.export.gguf_convert import convert_gguf
    out.mkdir(parents=True)
    convert_gguf(gg, out)
print(mode, f"{time.time()-t:.1f}s", f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1e6:.2f} GB")
