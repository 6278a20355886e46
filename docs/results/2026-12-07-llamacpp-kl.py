"""llama.cpp's Q4_K_M of a float source, scored like `specedge eval` scores a bundle (2026-12-07, #37).

    python docs/results/2026-12-07-llamacpp-kl.py SRC.gguf BUNDLE WORKDIR

The catalog GGUF SRC is dequantized to an all-F32 GGUF (the float source every `--requantize` bundle is
made from), quantized by llama.cpp to Q4_K_M, and both files run in llama.cpp over the chunks of
`specedge eval`'s built-in texts as BUNDLE's tokenizer cuts them (quality/evaluate.py `plan_eval`). The F32
run plays the source, the Q4_K_M run the bundle: quality/evaluate.py `run_eval` reports perplexity ratio,
top-1 agreement and KL divergence exactly as for a bundle. Measurement only: llama-cpp-python and gguf-py
are not specedge dependencies.
"""
import json
import sys
from pathlib import Path

import numpy as np

import gguf
import llama_cpp
from specedge.quality.evaluate import builtin_texts, plan_eval, run_eval
from specedge.runtime.loading import load_bundle


def f32_copy(src: Path, out: Path) -> None:
    """``src`` with every tensor dequantized to F32 (metadata kept, file type ALL_F32)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, kind)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data.reshape([int(d) for d in reversed(tensor.shape)]),
                          raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def scorer(path: Path):
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)

    def score(ids: np.ndarray) -> np.ndarray:
        llm.reset()
        llm.eval([int(i) for i in ids])
        return np.array(llm.scores[:len(ids)], np.float32)

    return score


def main() -> None:
    src, bundle, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    work.mkdir(parents=True, exist_ok=True)
    f32, q4 = work / "model.F32.gguf", work / "model.Q4_K_M.gguf"
    if not f32.exists():
        f32_copy(src, f32)
    if not q4.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(q4).encode(), params) != 0:
            sys.exit("llama.cpp's quantizer failed")
    loaded = load_bundle(bundle, threads=2, load_draft=False)
    plan = plan_eval(builtin_texts(), loaded.codec, max_context=loaded.manifest.target.max_context)
    record = run_eval(plan, scorer(q4), scorer(f32), source_name=f"{f32.name} in llama.cpp")
    print(json.dumps({"overall": record.overall.to_dict(), "ratio": record.overall.perplexity_ratio,
                      "kinds": {k: {**s.to_dict(), "ratio": s.perplexity_ratio} for k, s in record.kinds.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
