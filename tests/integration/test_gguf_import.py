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
def test_a_tensor_decoded_in_row_chunks_equals_one_decoded_whole(kind, monkeypatch):
    from specedge.export import gguf_import

    raw = _random_blocks(kind, 11, 2, np.random.default_rng(7))
    whole = gguf_import._decode(kind, raw)
    monkeypatch.setattr(gguf_import, "_DECODE_ROWS", 4)  # chunks of 4, 4 and 3 rows
    chunked = gguf_import._decode_rows(kind, raw)
    for field in ("q", "scales", "offsets", "zero_points"):
        a, b = getattr(whole, field), getattr(chunked, field)
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), field
    assert (chunked.bits, chunked.block) == (whole.bits, whole.block)


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

    from specedge.export.gguf_import import _decode

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
    # q|k (Q4_K) and v (Q6_K) have different kernel layouts: the fused weight splits by output rows
    # instead of widening q|k to 8 bits, and a Concat joins the parts.
    entry = manifest.target
    qk = (entry.n_heads + entry.n_kv_heads) * entry.head_dim
    total = qk + entry.n_kv_heads * entry.head_dim
    assert "layers.0.qkv" not in kept
    q_k, v = kept[f"layers.0.qkv[0:{qk}]"], kept[f"layers.0.qkv[{qk}:{total}]"]
    assert (q_k.sources, q_k.format, q_k.kept, q_k.block_size, q_k.offset) == (
        ("blk.0.attn_q.weight", "blk.0.attn_k.weight"), "Q4_K", "int4", 32, True)
    assert (v.sources, v.format, v.kept, v.block_size, v.offset) == (("blk.0.attn_v.weight",), "Q6_K", "int8", 16, False)
    assert (kept["layers.1.o"].kept, kept["layers.1.o"].block_size, kept["layers.1.o"].offset) == ("int4", 32, True)
    assert (kept["layers.0.gate_up"].kept, kept["layers.0.gate_up"].offset) == ("int4", False)
    assert (kept["layers.0.down"].format, kept["layers.0.down"].kept) == ("Q5_0", "int8")
    assert (kept["embed"].format, kept["embed"].kept, kept["embed"].sources) == ("Q8_0", "int8",
                                                                                ("token_embd.weight",))
    assert (kept["lm_head"].format, kept["lm_head"].kept, kept["lm_head"].block_size) == ("Q6_K", "int8", 16)
    assert all(k.kept != "fp32" for k in kept.values()), {n: k.reason for n, k in kept.items()}

    # The initializers are the file's blocks: Q4_0 nibbles and fp16 scales as written.
    model = onnx.load(str(bundles["int4"] / manifest.target.graph))
    inits = _initializers(model)
    tensors = GgufTensors(source)
    gate, up = (tensors.form(f"blk.1.ffn_{n}.weight") for n in ("gate", "up"))
    assert np.array_equal(inits["layers.1.gate_up.gguf_q"], np.concatenate([gate.packed(), up.packed()]))
    assert inits["layers.1.gate_up.gguf_scales_f16"].dtype == np.float16  # stored as the file's own halves
    assert np.array_equal(inits["layers.1.gate_up.gguf_scales"], np.concatenate([gate.scales, up.scales]))
    head = tensors.form("output.weight")
    assert np.array_equal(inits["lm_head.gguf_q"], head.packed())
    assert not any(n.op_type == "MatMul" and n.input[1] in kept for n in model.graph.node), "a weight stayed fp32"
    assert sum(n.op_type == "Concat" and n.name.endswith("qkv.gguf_concat") for n in model.graph.node) == 2
    _assert_no_requantization(model, manifest.extra.gguf_import["target"], source)


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


def _initializers(model) -> dict[str, np.ndarray]:
    """A loaded graph's initializers by name, and the float32 scales its Casts widen from float16 ones
    (export/scales.py) under their Cast outputs' names."""
    import onnx

    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Cast" and node.input[0] in inits:
            inits[node.output[0]] = inits[node.input[0]].astype(np.float32)
    return inits


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """[rows, ..., bytes] uint8 -> [rows, count] values (4 bits: low nibble first)."""
    flat = packed.reshape(packed.shape[0], -1)
    if bits == 4:
        flat = np.stack([flat & 15, flat >> 4], axis=-1).reshape(flat.shape[0], -1)
    return flat[:, :count]


def _node_weight(name: str, nodes: dict, inits: dict) -> np.ndarray:
    """The [N, K] float32 weight one MatMulNBits node (named ``{name}.gguf_matmul``) computes with,
    read back from its initializers in numpy: scales * (q - zero point) (+ its fp32 offsets)."""
    node = nodes[f"{name}.gguf_matmul"]
    attrs = {a.name: a.i for a in node.attribute}
    bits, block, n, k = attrs["bits"], attrs["block_size"], attrs["N"], attrs["K"]
    q = _unpack(inits[node.input[1]], bits, k).reshape(n, k // block, block).astype(np.float32)
    scales = inits[node.input[2]].reshape(n, k // block)
    zp = (_unpack(inits[node.input[3]], bits, k // block).astype(np.float32)[..., None] if len(node.input) > 3
          else np.float32(1 << (bits - 1)))
    w = scales[..., None] * (q - zp)
    if f"{name}.gguf_offset_matmul" in nodes:
        w = w + inits[nodes[f"{name}.gguf_offset_matmul"].input[1]].T[..., None]
    elif f"{name}.gguf_offset_gemm" in nodes:  # a tied head reading the embedding's [vocab, K/block] offsets
        w = w + inits[nodes[f"{name}.gguf_offset_gemm"].input[1]][..., None]
    return w.reshape(n, k)


def _assert_no_requantization(model, kept: dict, source) -> None:
    """Every MatMulNBits weight of the graph equals the GGUF's own tensors as the ``gguf`` package
    dequantizes them (fused along the output axis): bit for bit without offsets, to fp32 rounding of the
    offset with them. Nothing was rounded again."""
    import gguf

    reader = {t.name: t for t in gguf.GGUFReader(str(source)).tensors}
    inits = _initializers(model)
    nodes = {n.name: n for n in model.graph.node}
    checked = 0
    for key, record in kept.items():
        if record.kept == "fp32" or key == "embed":
            continue
        base, _, rows = key.partition("[")
        name = base
        if rows:  # a split part: "{key}[start:stop]" is node "{key}.part{i}", parts in row order
            starts = sorted(int(k.partition("[")[2].split(":")[0]) for k in kept if k.startswith(base + "["))
            name = f"{base}.part{starts.index(int(rows.split(':')[0]))}"
        ref = np.concatenate([gguf.dequantize(reader[s].data, reader[s].tensor_type).reshape(
            int(reader[s].shape[1]), -1) for s in record.sources]).astype(np.float32)
        got = _node_weight(name, nodes, inits)
        if record.offset:
            assert np.abs(got - ref).max() <= 8 * np.finfo(np.float32).eps * np.abs(ref).max(), key
        else:
            assert np.array_equal(got, ref), key
        checked += 1
    assert checked > 0


def _logit_scale(bundle, manifest) -> float:
    """The largest |logit| the bundle's target gives on PROMPT_IDS (what tolerances are relative to)."""
    from specedge.engines.base import EngineOptions
    from specedge.engines.ort import OrtEngine

    engine = OrtEngine(manifest.target, bundle / manifest.target.graph, EngineOptions())
    ids = np.array(PROMPT_IDS, np.int64) % manifest.target.vocab_size
    return float(np.abs(engine.forward(ids, engine.new_cache(), num_logits=len(ids))).max())


ALL = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
       "ffn_down.weight", "token_embd.weight", "output.weight")


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_is_exported_as_its_own_blocks(kind, tiny_model, tmp_path):
    """A tiny GGUF all in ``kind``: every weight is kept in the file's blocks (no fp32 left, nothing
    requantized), and the logits equal the dequantized GGUF's: to float rounding where the kernel has an
    fp32-activation path (4-bit forms at accuracy_level 1), within its int8 activations at level 4 (8-bit)."""
    import onnx

    from specedge.bundle.manifest import load_manifest
    from specedge.export.bundle import ExportConfig, export_bundle

    four_bit = kind in ("Q4_0", "Q4_1", "Q4_K")
    level = 1 if four_bit else 4
    source = write_gguf(tiny_model("qwen3", seed=0, config=SHAPE), tmp_path / f"tiny-{kind}.gguf",
                        types={name: kind for name in ALL}, seed=TYPES.index(kind))
    bundle = tmp_path / "b"
    export_bundle(ExportConfig(target=str(source), out=bundle, precision="int4", quiet=True, max_context=CONTEXT,
                               accuracy_level=level))
    manifest = load_manifest(bundle)
    kept = manifest.extra.gguf_import["target"]
    assert all(k.kept == f"int{4 if four_bit else 8}" and k.format == kind for k in kept.values()), kept
    assert "layers.0.qkv" in kept and "layers.0.gate_up" in kept  # one layout: the fused weights stay fused
    model = onnx.load(str(bundle / manifest.target.graph))
    assert not any(n.op_type in ("MatMul", "Gather") and n.input[1 if n.op_type == "MatMul" else 0] in kept
                   for n in model.graph.node), "a weight stayed fp32"
    _assert_no_requantization(model, kept, source)
    scale = _logit_scale(bundle, manifest)
    record = manifest.extra.validation["target:int4-vs-fp32"]
    assert record.max_abs_diff <= (1e-4 if four_bit else 3e-2) * scale, (record.max_abs_diff, scale)
    assert record.top1_agreement >= (1.0 if four_bit else 0.9)


def _integral_q4_1(data: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Q4_1 blocks whose minimum is an integral multiple of the scale (m = -z*d, z in 0..15, exact in fp16):
    the scale keeps 4 mantissa bits so z*d fits fp16 (llama.cpp never promises this; a file may have it)."""
    import gguf

    raw = gguf.quantize(data, gguf.GGMLQuantizationType.Q4_1)
    blocks = raw.reshape(data.shape[0], -1, 20).copy()
    d = (blocks[..., 0:2].copy().view(np.uint16) & np.uint16(0xFFC0)).view(np.float16)  # [rows, blocks, 1]
    m = blocks[..., 2:4].copy().view(np.float16)
    z = np.clip(np.round(-m.astype(np.float32) / np.maximum(d.astype(np.float32), 1e-8)), 0, 15)
    blocks[..., 0:2] = d.view(np.uint8)
    blocks[..., 2:4] = (-(z * d.astype(np.float32))).astype(np.float16).view(np.uint8)
    return blocks.reshape(data.shape[0], -1)


def test_integral_offsets_become_integer_zero_points(tiny_model, tmp_path, monkeypatch):
    """Q4_1 blocks whose offsets are integral multiples of their scales run as MatMulNBits with uint8 zero
    points (no fp32 offset matmul), and still compute the dequantized GGUF to float rounding."""
    import onnx

    import tiny_models
    from specedge.bundle.manifest import load_manifest
    from specedge.export.bundle import ExportConfig, export_bundle

    plain = tiny_models._gguf_blocks
    monkeypatch.setattr(tiny_models, "_gguf_blocks",
                        lambda data, kind, rng: _integral_q4_1(data, kind, rng) if kind == "Q4_1"
                        else plain(data, kind, rng))
    types = {name: "Q4_1" for name in ALL if name != "token_embd.weight"}
    source = write_gguf(tiny_model("qwen3", seed=0, config=SHAPE), tmp_path / "tiny-integral.gguf", types=types)
    bundle = tmp_path / "b"
    export_bundle(ExportConfig(target=str(source), out=bundle, precision="int4", quiet=True, max_context=CONTEXT,
                               accuracy_level=1))
    manifest = load_manifest(bundle)
    kept = manifest.extra.gguf_import["target"]
    model = onnx.load(str(bundle / manifest.target.graph))
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(len(n.input) == 4 and n.input[3].endswith("gguf_zero_points") for n in nodes)
    assert not any("offset" in n.name for n in model.graph.node)
    assert all(not k.offset and k.kept == "int4" for key, k in kept.items() if key != "embed")  # embed: F32
    _assert_no_requantization(model, kept, source)
    record = manifest.extra.validation["target:int4-vs-fp32"]
    assert record.top1_agreement == 1.0 and record.max_abs_diff <= 1e-4 * _logit_scale(bundle, manifest)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_a_tied_output_layer_reads_the_embeddings_blocks(kind, tiny_model, tmp_path):
    """A tied GGUF (one token_embd tensor) writes its blocks once: GatherBlockQuantized and the head's
    MatMulNBits read the same initializer (and, for an affine type, the same offsets), and the logits
    equal the dequantized GGUF's."""
    import onnx

    from specedge.bundle.manifest import load_manifest
    from specedge.export.bundle import ExportConfig, export_bundle
    from tiny_models import gemma_tokens

    folder = tiny_model("gemma3_text", seed=3, vocab_size=len(gemma_tokens()))
    source = write_gguf(folder, tmp_path / f"tied-{kind}.gguf", types={"token_embd.weight": kind})
    bundle = tmp_path / "b"
    level = 1 if kind == "Q4_1" else 4
    export_bundle(ExportConfig(target=str(source), out=bundle, precision="int4", quiet=True, max_context=CONTEXT,
                               accuracy_level=level))
    manifest = load_manifest(bundle)
    kept = manifest.extra.gguf_import["target"]
    assert kept["lm_head"].sources == kept["embed"].sources == ("token_embd.weight",)
    model = onnx.load(str(bundle / manifest.target.graph))
    nodes = {n.name: n for n in model.graph.node}
    gather, head = nodes["embed.gguf_gather"], nodes["lm_head.gguf_matmul"]
    assert gather.input[0] == head.input[1] == "embed.gguf_q"
    assert not any(t.name == "lm_head.gguf_q" for t in model.graph.initializer)
    if kind == "Q4_1":
        assert nodes["lm_head.gguf_offset_gemm"].input[1] == nodes["embed.gguf_off_gather"].input[0]
    _assert_no_requantization(model, kept, source)
    record = manifest.extra.validation["target:int4-vs-fp32"]
    assert record.max_abs_diff <= (1e-4 if level == 1 else 3e-2) * _logit_scale(bundle, manifest)
    assert record.top1_agreement >= (1.0 if level == 1 else 0.9)
