"""Per-layer output error of importance-weighted vs plain int4 search on held-out activations (2026-12-07, #37).

    python docs/results/2026-12-07-imatrix-layers.py HF_FOLDER 2,12,22

For the listed layers of a transformers checkpoint (fp32), collects each projection's input on the
calibration texts (export/calibration) and on the eval texts (quality/texts), quantizes the weight with
export/mixquant.py's asymmetric int4 search plain, weighted by the calibration importance, by its square
root, and by the eval texts' own importance, and prints each one's mean squared output error on the eval
activations relative to the plain search's.
"""
import sys, numpy as np, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
import specedge
from specedge.export.mixquant import TensorQuant, quantize

PACKAGE = Path(specedge.__file__).parent
folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
torch.set_num_threads(1)
L = model.model.layers
layers = [int(a) for a in sys.argv[2].split(",")]
mods = {}
for i in layers:
    mods[f"{i}.q"] = L[i].self_attn.q_proj; mods[f"{i}.down"] = L[i].mlp.down_proj; mods[f"{i}.o"] = L[i].self_attn.o_proj; mods[f"{i}.gate"] = L[i].mlp.gate_proj
def collect(texts):
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.setdefault(n, []).append(a[0][0].double().numpy())) for n, m in mods.items()]
    with torch.no_grad():
        for t in texts:
            model(torch.tensor([tok(t)["input_ids"][:512]]))
    for h in hooks: h.remove()
    return {n: np.concatenate(v) for n, v in seen.items()}
cal = collect([(PACKAGE / "export" / "calibration"/f"{k}.txt").read_text() for k in ("prose","code","dialogue","tool_call")])
ev = collect([(PACKAGE / "quality" / "texts"/f"{k}.txt").read_text() for k in ("prose","code","dialogue","tool_call")])
plain = TensorQuant(4, 32, False, search=True); wf = TensorQuant(4, 32, False, search=True, weighted=True)
for n, m in mods.items():
    W = m.weight.detach().numpy().astype(np.float32)
    imp = (cal[n]**2).mean(0)
    X = ev[n]
    ref = X @ W.T.astype(np.float64)
    res = {}
    for label, blocks in (("plain", quantize(W, plain)), ("imp", quantize(W, wf, imp)), ("sqrt", quantize(W, wf, np.sqrt(imp))), ("evalimp", quantize(W, wf, (X**2).mean(0)))):
        Wq = blocks.dequantize()[:, :W.shape[1]].astype(np.float64)
        res[label] = ((X @ Wq.T - ref)**2).mean()
    print(n, " ".join(f"{k} {v/res['plain']:.3f}" for k, v in res.items()), flush=True)
