"""A float-source export with the mix's 8-bit forms changed (2026-12-07, issues #36 and #37).

    python docs/results/2026-12-07-wide-int8-blocks.py VARIANT MODEL OUT_DIR
    specedge eval OUT_DIR --json --quiet

VARIANT: "int8-block=B" (every 8-bit form, the head, the embedding and the use_more_bits layers, in blocks
of B instead of 32), "more-int8-block=B" (only the use_more_bits layers' 8-bit forms), "more-int4-block=B"
(the use_more_bits layers as the mix's int4 form, error feedback included, in blocks of B), or "plain" (the
default mix as it is). An experiment: it patches export/mixquant.py's make_plan in this process only.
"""
import dataclasses
import sys
from pathlib import Path

import specedge.export.mixquant as mq
from specedge.export.bundle import ExportConfig, export_bundle

variant, model, out = sys.argv[1:4]
original = mq.make_plan
kind, _, value = variant.partition("=")
if kind not in ("int8-block", "more-int8-block", "more-int4-block", "plain"):
    sys.exit(f"unknown variant {variant!r}")


def make_plan(mix: str, n_layers: int, block: int = 32):
    plan = original(mix, n_layers, block)
    int4 = original(mix, n_layers, block)("layers.0.o")  # every mix's int4 form for an o projection

    def changed(name: str):
        form = plan(name)
        if form.bits != 8 or kind == "plain":
            return form
        more_bits_layer = name.startswith("layers.")
        if kind == "int8-block" or (kind == "more-int8-block" and more_bits_layer):
            return dataclasses.replace(form, block=int(value))
        if kind == "more-int4-block" and more_bits_layer:
            return dataclasses.replace(int4, block=int(value))
        return form

    return changed


mq.make_plan = make_plan
export_bundle(ExportConfig(target=model, out=Path(out), precision="int4", requantize=True, overwrite=True))
