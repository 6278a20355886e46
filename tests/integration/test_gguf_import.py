"""A GGUF exported at int4 keeps the file's own quantization: nothing is rounded twice (issue #37).

Invariants guarded here:
- each GGUF block type's MatMulNBits form dequantizes to what the ``gguf`` package (transformers'
  loader) dequantizes, bit for bit;
- ONNX Runtime's CPU kernels read those forms as numpy does (block 16 at 8 bits, the fp32 offset
  of the affine types);
- an exported graph's MatMulNBits / GatherBlockQuantized initializers hold the file's integers and
  scales, and its logits equal the dequantized source's (the fp32 graph of transformers' weights);
- the manifest records, per weight, what was kept; a requantizing int8 of a GGUF must be asked for.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("torch")

from tiny_models import PROMPT_IDS, write_gguf  # noqa: E402

CONTEXT = 64
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# The tiny qwen3 at a width K-quants take (rows a multiple of 256). transformers' qwen3 GGUF mapping
# reads no head_dim, so it is the default 128.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 128}
# A Q4_K_M-like mix (q/k Q4_K with v Q6_K fused in one qkv weight), Q4_1 and Q5_0 affine/8-bit forms,
# Q4_0 and Q8_0, a Q8_0 embedding and a Q6_K output layer.
MIX = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_1",
       "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_0", "ffn_down.weight": "Q5_0",
       "token_embd.weight": "Q8_0", "output.weight": "Q6_K"}


def _random_blocks(kind: str, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in ``kind``'s layout with finite fp16 scale fields: [rows, blocks * type size]."""
    import gguf

    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    fields = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}[kind]
    for offset in fields:
        raw[..., offset:offset + 2] = rng.uniform(-0.01, 0.01, (rows, blocks)).astype(np.float16).view(
            np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", TYPES)
def test_each_block_type_dequantizes_as_the_gguf_package_does(kind):
    import gguf

    from specedge.export.gguf_import import _decode

    raw = _random_blocks(kind, 6, 2, np.random.default_rng(TYPES.index(kind)))
    form = _decode(kind, raw)
    assert np.array_equal(form.dequantize(), gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]))
    expected = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q6_K": (8, 16)}.get(kind, (8, 32))
    assert (form.bits, form.block) == expected
    assert (form.offsets is not None) == (kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    widened = form.widened(8, 16)  # what a fused weight with a Q6_K part uses: the same values
    assert np.array_equal(widened.dequantize(), form.dequantize())


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "Q5_1"])
@pytest.mark.parametrize("accuracy_level", [1, 4])
def test_onnx_runtime_reads_the_forms_as_numpy_does(kind, accuracy_level):
    """One MatMulNBits (+ offset) against numpy on the dequantized weight: fp32 rounding at level 1;
    level 4 quantizes the activations to int8 per block, so only about 1e-2 relative."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specedge.export.gguf_import import _decode, import_gguf  # noqa: F401 (the module under test)

    rng = np.random.default_rng(7)
    raw = _random_blocks(kind, 48, 2, rng)  # 48 outputs, K = 512
    form = _decode(kind, raw)
    if form.bits == 8 and accuracy_level < 4:
        pytest.skip("8-bit forms are written at accuracy_level 4 only (the CPU kernel has no fp32 path)")
    w = form.dequantize()  # [N, K]
    n_out, k = w.shape
    x = rng.standard_normal((3, k)).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(form.packed(), "q"), onnx.numpy_helper.from_array(form.scales, "s")]
    nodes = [helper.make_node("MatMulNBits", ["x", "q", "s"], ["main" if form.offsets is not None else "y"],
                              domain="com.microsoft", K=k, N=n_out, bits=form.bits, block_size=form.block,
                              accuracy_level=accuracy_level)]
    if form.offsets is not None:
        blocks = k // form.block
        inits += [onnx.numpy_helper.from_array(np.array([-1, blocks, form.block], np.int64), "shape"),
                  onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                  onnx.numpy_helper.from_array(np.ascontiguousarray(form.offsets.T), "off")]
        nodes += [helper.make_node("Reshape", ["x", "shape"], ["xb"]),
                  helper.make_node("ReduceSum", ["xb", "axes"], ["xs"], keepdims=0),
                  helper.make_node("MatMul", ["xs", "off"], ["o"]), helper.make_node("Add", ["main", "o"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n_out])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < (1e-5 if accuracy_level == 1 else 2e-2), rel


@pytest.fixture(scope="module")
def gguf_export(tiny_model, tmp_path_factory):
    """A tiny qwen3 GGUF in the MIX types, exported at int4 (keeping the file's quantization) at accuracy
    levels 4 and 1, and at fp32."""
    import os

    from specedge.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("gguf-import")
    old = os.environ.get("SPECEDGE_CACHE")
    os.environ["SPECEDGE_CACHE"] = str(root / "cache")  # the dequantized folder lands here
    try:
        folder = tiny_model("qwen3", seed=0, config=SHAPE)
        source = write_gguf(folder, root / "tiny-qwen3-mix.gguf", types=MIX)
        bundles = {}
        for name, precision, level in (("int4", "int4", 4), ("int4-level1", "int4", 1), ("fp32", "fp32", 4)):
            bundles[name] = root / name
            export_bundle(ExportConfig(target=str(source), out=bundles[name], precision=precision, quiet=True,
                                       max_context=CONTEXT, accuracy_level=level))
        yield source, bundles
    finally:
        if old is None:
            os.environ.pop("SPECEDGE_CACHE", None)
        else:
            os.environ["SPECEDGE_CACHE"] = old


def test_an_int4_export_of_a_gguf_keeps_its_blocks_and_records_each_weight(gguf_export):
    import onnx

    from specedge.export.gguf_import import GgufTensors
    from specedge.bundle.manifest import load_manifest

    source, bundles = gguf_export
    manifest = load_manifest(bundles["int4"])
    kept = manifest.extra.gguf_import["target"]
    assert kept["layers.0.qkv"].format == "Q4_K+Q6_K" and kept["layers.0.qkv"].kept == "int8"
    assert (kept["layers.0.qkv"].block_size, kept["layers.0.qkv"].offset) == (16, True)  # widened to Q6_K's form
    assert (kept["layers.1.o"].kept, kept["layers.1.o"].block_size, kept["layers.1.o"].offset) == ("int4", 32, True)
    assert (kept["layers.0.gate_up"].kept, kept["layers.0.gate_up"].offset) == ("int4", False)
    assert (kept["layers.0.down"].format, kept["layers.0.down"].kept) == ("Q5_0", "int8")
    assert (kept["embed"].format, kept["embed"].kept, kept["embed"].sources) == ("Q8_0", "int8",
                                                                                ("token_embd.weight",))
    assert (kept["lm_head"].format, kept["lm_head"].kept, kept["lm_head"].block_size) == ("Q6_K", "int8", 16)
    assert all(k.kept != "fp32" for k in kept.values()), {n: k.reason for n, k in kept.items()}

    # The initializers are the file's blocks: Q4_0 nibbles and fp16 scales as written.
    model = onnx.load(str(bundles["int4"] / manifest.target.graph))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    tensors = GgufTensors(source)
    gate, up = (tensors.form(f"blk.1.ffn_{n}.weight") for n in ("gate", "up"))
    assert np.array_equal(inits["layers.1.gate_up.gguf_q"], np.concatenate([gate.packed(), up.packed()]))
    assert np.array_equal(inits["layers.1.gate_up.gguf_scales"], np.concatenate([gate.scales, up.scales]))
    head = tensors.form("output.weight")
    assert np.array_equal(inits["lm_head.gguf_q"], head.packed())
    assert not any(n.op_type == "MatMul" and n.input[1] in kept for n in model.graph.node), "a weight stayed fp32"


def test_the_imported_graph_computes_the_dequantized_gguf(gguf_export):
    """At accuracy_level 1 (fp32 activations) the kept blocks' logits equal the fp32 graph of transformers'
    dequantized weights to float rounding, and the recorded validation says so; 8-bit forms, which the
    CPU kernel runs at level 4 only, stay fp32 there, recorded with the reason. At level 4 (int8
    activations per block) the argmax still agrees."""
    from specedge.engines.ort import OrtEngine
    from specedge.bundle.manifest import load_manifest
    from specedge.engines.base import EngineOptions

    _, bundles = gguf_export
    logits = {}
    for name, bundle in bundles.items():
        entry = load_manifest(bundle).target
        engine = OrtEngine(entry, bundle / entry.graph, EngineOptions())
        logits[name] = engine.forward(np.array(PROMPT_IDS, np.int64), engine.new_cache(),
                                           num_logits=len(PROMPT_IDS)).copy()
    scale = np.abs(logits["fp32"]).max()
    assert np.abs(logits["int4-level1"] - logits["fp32"]).max() <= 1e-4 * scale
    assert (logits["int4-level1"].argmax(-1) == logits["fp32"].argmax(-1)).all()
    assert (logits["int4"].argmax(-1) == logits["fp32"].argmax(-1)).mean() >= 0.9
    manifest = load_manifest(bundles["int4-level1"])
    record = manifest.extra.validation["target:int4-vs-fp32"]
    assert record.max_abs_diff <= 1e-4 * scale and record.top1_agreement == 1.0
    kept = manifest.extra.gguf_import["target"]
    assert (kept["layers.0.o"].kept, kept["layers.0.o"].offset) == ("int4", True)  # Q4_1: 4 bits + offset
    assert kept["lm_head"].kept == "fp32" and "accuracy_level 1" in kept["lm_head"].reason


def test_int8_of_a_gguf_would_requantize_and_must_be_asked_for(gguf_export, tmp_path):
    from specedge.errors import ExportError
    from specedge.export.bundle import ExportConfig, export_bundle

    source, _ = gguf_export
    with pytest.raises(ExportError, match=r"already quantized: --precision int4 keeps .* --requantize"):
        export_bundle(ExportConfig(target=str(source), out=tmp_path / "b", precision="int8", quiet=True,
                                   max_context=CONTEXT))
