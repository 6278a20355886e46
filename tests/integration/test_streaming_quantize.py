"""The streaming quantizer (export/rtn.py) writes the graph ONNX Runtime's own MatMulNBitsQuantizer writes.

Invariant: for every precision, block size and embedding setting an export uses, the graph that
``quantize_streaming`` writes one initializer at a time has the same nodes (op, name, inputs,
outputs, attributes), the same opsets and the same initializer bytes as the in-memory quantizer's,
so every int4/int8 bundle is what it was before the exporter's memory was bounded.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")


def _fp32_graph(folder: Path, out: Path, attention: str) -> Path:
    from specedge.export.graph import build_decoder
    from specedge.export.loader import load_source
    from specedge.export.weights import extract

    spec, weights, _ = extract(load_source(str(folder), quiet=True).model)
    out.mkdir()
    build_decoder(spec, weights, out / "model.onnx", untie_lm_head=True, attention=attention, max_context=64)
    return out / "model.onnx"


def _ort_quantized(src: Path, dst: Path, bits: int, block: int, embeddings: bool) -> None:
    """ONNX Runtime's quantizer over the whole loaded model (what export/quantize.py ran before)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)
    model = onnx.load(str(src))
    ops = ("MatMul", "Gather") if embeddings and bits == 4 else ("MatMul",)
    axes = (("MatMul", 0), ("Gather", 1))
    algo = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=4, bits=bits,
                                        op_types_to_quantize=ops, quant_axes=axes)
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=True, accuracy_level=4,
                             algo_config=algo, op_types_to_quantize=ops, quant_axes=axes)
    q.process()
    onnx.save_model(q.model.model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)


def _contents(path: Path):
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    nodes = [(n.op_type, n.name, tuple(n.input), tuple(n.output), n.domain,
              tuple(sorted((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute))) for n in model.graph.node]
    inits = {t.name: (t.data_type, tuple(t.dims), numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer}
    opsets = sorted((o.domain, o.version) for o in model.opset_import)
    return nodes, inits, opsets, model.ir_version


@pytest.mark.parametrize("arch,attention,bits,block,embeddings", [
    ("llama", "gqa", 4, 32, True),
    ("llama", "standard", 8, 32, True),
    ("qwen2", "gqa", 4, 64, False),
])
def test_streaming_quantizer_writes_what_onnxruntimes_quantizer_writes(arch, attention, bits, block, embeddings,
                                                                     tiny_model, tmp_path):
    from specedge.export.rtn import quantize_streaming

    src = _fp32_graph(tiny_model(arch), tmp_path / "fp32", attention)
    (tmp_path / "ort").mkdir()
    (tmp_path / "stream").mkdir()
    _ort_quantized(src, tmp_path / "ort" / "model.onnx", bits, block, embeddings)
    files = quantize_streaming(src, tmp_path / "stream" / "model.onnx", bits=bits, block_size=block, symmetric=True,
                               accuracy_level=4, quantize_embeddings=embeddings)
    assert [p.name for p in files] == ["model.onnx", "model.onnx.data"]
    ort_nodes, ort_inits, ort_opsets, ort_ir = _contents(tmp_path / "ort" / "model.onnx")
    nodes, inits, opsets, ir = _contents(tmp_path / "stream" / "model.onnx")
    assert nodes == ort_nodes
    assert inits == ort_inits
    assert (opsets, ir) == (ort_opsets, ort_ir)
    quantized = {n[0] for n in nodes}
    assert "MatMulNBits" in quantized and ("GatherBlockQuantized" in quantized) == (embeddings and bits == 4)

