"""Block scales stored as float16 (2026-12-08, #37): what storage costs, and how far one export's KL is a draw.

    python docs/results/2026-12-08-half-scales.py round SRC_BUNDLE OUT_BUNDLE
    python docs/results/2026-12-08-half-scales.py export aware|fp32 DAMP OUT_BUNDLE [MODEL]
    specedge eval OUT_BUNDLE --json --quiet

``round``: a copy of SRC_BUNDLE (exported before float16 scales) whose float32 scale initializers are rounded to
the nearest float16 values, the integers untouched: what storing them at half width alone does to quality.
``export``: MODEL (default smollm2-135m-instruct) exported with the default mix (`--precision int4 --requantize`)
at GPTQ dampening DAMP (export/mixquant.py GPTQ_DAMP, shipped 0.01), its scales chosen as shipped (``aware``:
every block's integers rounded against its float16 scale) or in float32 and rounded to float16 when written
(``fp32``). Small changes of either move GPTQ's rounding decisions; the spread of KL over them is how far a
single export's KL can be read. An experiment: it patches the modules in this process only.
"""
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np


def round_copy(src: Path, dst: Path) -> None:
    import onnx
    from onnx import numpy_helper

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    graph = dst / "target" / "model.onnx"
    model = onnx.load(str(graph))
    rounded = 0
    for tensor in model.graph.initializer:
        if tensor.name.endswith("_scales") and tensor.data_type == onnx.TensorProto.FLOAT:
            values = numpy_helper.to_array(tensor).astype(np.float16).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
            rounded += 1
    (dst / "target" / "model.onnx.data").unlink()
    onnx.save_model(model, str(graph), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    manifest = json.loads((dst / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        entry["sha256"] = hashlib.sha256((dst / name).read_bytes()).hexdigest()
        entry["size"] = (dst / name).stat().st_size
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"{rounded} scale tensors rounded to float16 values")


def export(how: str, damp: float, out: Path, model: str) -> None:
    import specedge.export.mixquant as mixquant
    import specedge.export.scales as scales
    from specedge.export.bundle import ExportConfig, export_bundle

    mixquant.GPTQ_DAMP = damp
    if how == "fp32":
        mixquant.to_half = lambda values, up=False: np.asarray(values, np.float32)
        scales.holds_as_half = lambda values: bool(np.all(np.abs(values) <= scales.HALF_MAX))
    elif how != "aware":
        sys.exit(f"unknown scale choice {how!r}: aware or fp32")
    export_bundle(ExportConfig(target=model, out=out, precision="int4", requantize=True, overwrite=True))


if __name__ == "__main__":
    if sys.argv[1:2] == ["round"]:
        round_copy(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["export"]:
        export(sys.argv[2], float(sys.argv[3]), Path(sys.argv[4]),
               sys.argv[5] if len(sys.argv) > 5 else "smollm2-135m-instruct")
    else:
        sys.exit(__doc__)
