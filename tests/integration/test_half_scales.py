"""Block scales stored as float16 behind a Cast (export/scales.py): the kernels compute what they computed
from float32 initializers of the same values, bit for bit, and nothing that float16 cannot hold is rounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specedge.export.mixquant import TensorQuant, quantize
from specedge.export.scales import HALF_MAX, holds_as_half, read_scales, reshaped, to_half, write_scales

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FORMS = [TensorQuant(4, 32, False, search=True), TensorQuant(4, 32, True), TensorQuant(8, 32, True),
         TensorQuant(8, 128, True), TensorQuant(4, 64, False)]


def _weight(seed: int, shape: tuple[int, int]) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.05).astype(np.float32)


LAYOUTS = ("float32", "half head", "tied")


def _head_graph(folder: Path, blocks, k: int, layout: str):
    """A MatMulNBits head and a GatherBlockQuantized lookup over the same integers [N, K/block, bytes].
    ``layout``: each with its own float32 scales (as before float16 scales); the head's as float16 behind a
    Cast; or the lookup's float32 scales alone, the head reading them through a Reshape (the tied layout)."""
    from onnx import TensorProto, helper

    from specedge.export.rtn import DataFile

    n = blocks.q.shape[0]
    block = blocks.q.shape[2]
    out = DataFile(folder / "g.onnx.data")
    try:
        data = out.tensor("q", TensorProto.UINT8, blocks.packed().shape, blocks.packed())
        lookup = write_scales(out, "lookup_scales", blocks.scales, (n, k // block, 1), half=False)
        if layout == "tied":
            head = reshaped(lookup.name, "head_scales", blocks.scales.shape, out)
        else:
            head = write_scales(out, "head_scales", blocks.scales, half=layout == "half head")
        bits = blocks.bits
        nodes = [*head.nodes, *lookup.nodes,
                 helper.make_node("MatMulNBits", ["x", "q", head.name], ["y"], domain="com.microsoft", K=k, N=n,
                                  bits=bits, block_size=block, accuracy_level=4),
                 helper.make_node("GatherBlockQuantized", ["q", "ids", lookup.name], ["rows"],
                                  domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=block, bits=bits)]
        inits = [data, *head.initializers, *lookup.initializers]
    finally:
        out.close()
    graph = helper.make_graph(nodes, "half", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k]),
                                              helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)], inits)
    return graph, head


@pytest.mark.parametrize("form", [TensorQuant(8, 32, True), TensorQuant(4, 32, True, search=True)], ids=str)
def test_half_and_shared_scales_compute_what_float32_ones_do(tmp_path, form):
    """The same integers and scale values, as float32 initializers, as float16 + Cast, or shared through a
    Reshape: ONNX Runtime folds the Cast and the Reshape at load, so a step's logits (1, 2 and 5 rows) and
    a lookup's rows are bit-identical."""
    import onnx
    from onnx import helper
    ort = pytest.importorskip("onnxruntime")

    k, n = 128, 96
    blocks = quantize(_weight(1, (n, k)), form)
    x = np.random.default_rng(2).standard_normal((5, k)).astype(np.float32)
    ids = np.array([0, 17, n - 1], np.int64)
    results = {}
    for layout in LAYOUTS:
        folder = tmp_path / layout.replace(" ", "_")
        folder.mkdir()
        graph, head = _head_graph(folder, blocks, k, layout)
        assert head.bits == {"float32": 32, "half head": 16, "tied": 0}[layout]
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        onnx.save_model(model, str(folder / "g.onnx"))
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.optimized_model_filepath = str(folder / "optimized.onnx")
        session = ort.InferenceSession(str(folder / "g.onnx"), options, providers=["CPUExecutionProvider"])
        results[layout] = [session.run(None, {"x": x[:rows], "ids": ids}) for rows in (1, 2, 5)]
        folded = onnx.load(str(folder / "optimized.onnx"), load_external_data=False)
        assert not any(node.op_type in ("Cast", "Reshape") for node in folded.graph.node)  # done once, at load
    for layout in LAYOUTS[1:]:
        for plain, other in zip(results["float32"], results[layout]):
            for a, b in zip(plain, other):
                assert np.array_equal(a, b), layout
    lookup = results["tied"][0][1].reshape(len(ids), k)
    np.testing.assert_array_equal(lookup, blocks.dequantize()[ids])  # the lookup stays exact


@pytest.mark.parametrize("form", FORMS, ids=str)
def test_the_quantizer_chooses_scales_float16_holds(form):
    blocks = quantize(_weight(3, (64, 256)), form)
    assert holds_as_half(blocks.scales)
    gptq = TensorQuant(4, 32, False, search=True, weighted=True, gptq=True)
    x = np.random.default_rng(4).standard_normal((300, 256)).astype(np.float32)
    assert holds_as_half(quantize(_weight(5, (64, 256)), gptq, x.T @ x / len(x)).scales)


def test_a_min_max_scale_rounds_up_so_nothing_clips():
    """Rounding a min/max range's step to float16 goes up: every element stays within half a step."""
    w = _weight(6, (64, 256))
    for form in (TensorQuant(4, 32, True), TensorQuant(8, 32, True), TensorQuant(4, 32, False)):
        blocks = quantize(w, form)
        err = np.abs(blocks.dequantize() - w).reshape(64, -1, 32)
        assert (err <= blocks.scales[..., None] * (0.5 + 1e-5) + 1e-7).all()
    steps = np.array([1e-3, 0.0123, 3.3e-5], np.float32)
    assert (to_half(steps, up=True) >= steps).all() and holds_as_half(to_half(steps, up=True))
    assert to_half(np.array([1e6], np.float32))[0] == np.float32(1e6)  # beyond float16: left alone


def test_scales_float16_cannot_hold_stay_float32(tmp_path):
    from onnx import TensorProto

    from specedge.export.rtn import DataFile

    out = DataFile(tmp_path / "d.data")
    try:
        exact = write_scales(out, "a", np.array([0.5, 0.25, 1e-3], np.float32).astype(np.float16).astype(np.float32))
        not_exact = write_scales(out, "b", np.array([0.5, 1e-3], np.float32))  # 1e-3 is not a float16 value
        too_large = write_scales(out, "c", np.array([0.5, 2 * HALF_MAX], np.float32))
        asked = write_scales(out, "d", np.array([0.5], np.float32), half=False)
    finally:
        out.close()
    assert (exact.bits, exact.initializers[0].data_type, exact.initializers[0].name) == (16, TensorProto.FLOAT16,
                                                                                          "a_f16")
    assert exact.nodes[0].op_type == "Cast" and exact.nodes[0].output[0] == "a"
    for written in (not_exact, too_large, asked):
        assert written.bits == 32 and written.nodes == ()
        assert written.initializers[0].data_type == TensorProto.FLOAT
        assert written.initializers[0].name == written.name


def test_read_scales_follows_the_cast_and_the_reshape(tmp_path):
    from onnx import helper

    blocks = quantize(_weight(7, (40, 64)), TensorQuant(8, 32, True))
    for layout in ("half head", "tied"):
        folder = tmp_path / layout.replace(" ", "_")
        folder.mkdir()
        graph, head = _head_graph(folder, blocks, 64, layout)
        np.testing.assert_array_equal(read_scales(graph, head.name, folder), blocks.scales)
        np.testing.assert_array_equal(read_scales(graph, "lookup_scales", folder), blocks.scales[..., None])
    graph.node.append(helper.make_node("Relu", ["x"], ["odd"]))
    with pytest.raises(ValueError, match="'odd' are neither an initializer nor a Cast or Reshape"):
        read_scales(graph, "odd", folder)
