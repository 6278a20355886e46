"""Qwen2.5-Coder-0.5B at asym4-head8-more-imatrix with a variant of the importance weighting (2026-12-07, #37).

    python docs/results/2026-12-07-imatrix-variants.py sqrt|mlp|attn OUT_DIR
    specedge eval OUT_DIR --json --quiet

sqrt: weights from the square root of each channel's importance; mlp / attn: importance given to the
MLP weights (gate_up, down) / the attention weights (qkv, o) only, the others searched unweighted. An
experiment: it patches export/mixquant.py and export/importance.py in this process only.
"""
import sys
import numpy as np
import specedge.export.mixquant as mq
import specedge.export.importance as imp
from pathlib import Path
from specedge.export.bundle import ExportConfig, export_bundle
variant, out = sys.argv[1], sys.argv[2]
if variant == "sqrt":
    real = mq._element_weights
    mq._element_weights = lambda importance, k: real(np.sqrt(np.asarray(importance, np.float64)), k)
elif variant == "mlp":
    real_ai = imp.activation_importance
    def only_mlp(*a, **kw):
        d = real_ai(*a, **kw)
        return {k: v for k, v in d.items() if k.endswith(("gate_up", "down"))}
    imp.activation_importance = only_mlp
elif variant == "attn":
    real_ai = imp.activation_importance
    def only_attn(*a, **kw):
        d = real_ai(*a, **kw)
        return {k: v for k, v in d.items() if k.endswith(("qkv", ".o"))}
    imp.activation_importance = only_attn
export_bundle(ExportConfig(target="qwen2.5-coder-0.5b-instruct", out=Path(out), precision="int4", requantize=True,
                           keep_converted=True, quant_mix="asym4-head8-more-imatrix", overwrite=True))
