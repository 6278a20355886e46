"""A float-source export with a variant of the -gptq mixes' rounding (2026-12-07, #37).

    python docs/results/2026-12-07-gptq-variants.py VARIANT MODEL MIX BLOCK OUT_DIR
    specedge eval OUT_DIR --json --quiet

VARIANT: "act-order" (every block's scale fixed from the source weights first, then the input channels
rounded loudest first: export/mixquant.py GPTQ_ACT_ORDER), "damp=X" (GPTQ_DAMP = X), or "plain" (the
module as it is). An experiment: it patches export/mixquant.py in this process only.
"""
import sys
from pathlib import Path

import specedge.export.mixquant as mq
from specedge.export.bundle import ExportConfig, export_bundle

variant, model, mix, block, out = sys.argv[1:6]
if variant == "act-order":
    mq.GPTQ_ACT_ORDER = True
elif variant.startswith("damp="):
    mq.GPTQ_DAMP = float(variant[len("damp="):])
elif variant != "plain":
    sys.exit(f"unknown variant {variant!r}")
export_bundle(ExportConfig(target=model, out=Path(out), precision="int4", requantize=True, quant_mix=mix,
                           block_size=int(block), overwrite=True))
