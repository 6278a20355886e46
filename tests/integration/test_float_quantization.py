"""Per-tensor quantization of float sources (export/mixquant.py, export/rtn.py, issue #37 part 2).

Invariants:
* a block's dequantized values stay within the format's error bound: half a step for min/max
  rounding, and a searched block's squared error is never above the min/max block's;
* asymmetric zero points are integers in the format's range, and a weight made of exactly
  representable blocks is reproduced bit for bit;
* ONNX Runtime's MatMulNBits and GatherBlockQuantized read the written blocks as numpy does;
* the per-tensor choices are recorded in the manifest (``extra.quantization``), round-trip, and
  match the mix; a bundle exported with the default mix keeps speculation equal to plain greedy.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specedge.bundle.extra import ManifestExtra, QuantizedTensor, QuantMix
from specedge.errors import InvalidParameterError, ManifestError
from specedge.export.mixquant import DEFAULT_MIX, MIXES, TensorQuant, make_plan, quantize
from tiny_models import assert_model_drafts_equal_plain

ALL_FORMS = [TensorQuant(4, 32, False), TensorQuant(4, 32, False, search=True), TensorQuant(4, 64, True),
             TensorQuant(4, 32, True, search=True), TensorQuant(8, 32, True), TensorQuant(8, 32, False)]


def _weight(seed: int, shape=(48, 256)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[3] += 2.5  # an all-positive row: asymmetric blocks must still hold 0
    w[5, :32] = 0  # an all-zero block
    w[7, 40] = 30.0  # an outlier
    return w


@pytest.mark.parametrize("form", ALL_FORMS, ids=str)
def test_dequantized_blocks_within_the_format_bound(form):
    w = _weight(1)
    blocks = quantize(w, form)
    top = (1 << form.bits) - 1
    assert blocks.q.dtype == np.uint8 and blocks.q.max() <= top
    assert blocks.zero_points.dtype == np.uint8 and blocks.zero_points.max() <= top
    err = np.abs(blocks.dequantize() - w).reshape(w.shape[0], -1, form.block)
    if not form.search:
        # min/max rounding clips nothing: every element is within half a step (+ fp32 rounding)
        bound = blocks.scales[..., None] * (0.5 + 1e-5) + 1e-7
        assert (err <= bound).all()
    else:
        # the search minimises each block's squared error and min/max is one of its candidates, so no
        # block ends up worse than min/max rounding
        rtn = quantize(w, TensorQuant(form.bits, form.block, form.symmetric))
        rtn_err = ((rtn.dequantize() - w) ** 2).reshape(w.shape[0], -1, form.block).sum(-1)
        searched_err = (err ** 2).sum(-1)
        assert (searched_err <= rtn_err * (1 + 1e-5) + 1e-12).all()
        assert searched_err.sum() < 0.95 * rtn_err.sum()  # and the search buys something overall
    assert np.array_equal(blocks.dequantize()[5, :32], np.zeros(32, np.float32))  # zero block exact


@pytest.mark.parametrize("search", [False, True])
def test_asymmetric_zero_points_are_exact(search):
    """Blocks built as s * (q - z) with integer q spanning 0..15 and z in 1..14 come back bit for bit."""
    rng = np.random.default_rng(2)
    n, blocks, block = 16, 8, 32
    q = rng.integers(0, 16, (n, blocks, block))
    q[..., 0], q[..., 1] = 0, 15  # each block spans the whole range, so min/max finds the step exactly
    z = rng.integers(1, 15, (n, blocks))
    s = np.float32(2.0) ** rng.integers(-6, 2, (n, blocks)).astype(np.float32)  # powers of two: exact products
    w = (s[..., None] * (q - z[..., None])).astype(np.float32).reshape(n, -1)
    out = quantize(w, TensorQuant(4, block, False, search=search))
    assert np.array_equal(out.zero_points, z.astype(np.uint8))
    assert np.array_equal(out.q, q.astype(np.uint8))
    assert np.array_equal(out.dequantize(), w)
    # packed two per byte, block 2j in the low nibble (MatMulNBits' zero_points layout)
    packed = out.packed_zero_points()
    assert packed.shape == (n, blocks // 2)
    assert np.array_equal(packed & 15, z[:, 0::2]) and np.array_equal(packed >> 4, z[:, 1::2])


def test_bad_forms_are_refused():
    with pytest.raises(InvalidParameterError, match="bits must be 4 or 8"):
        TensorQuant(3, 32, True)
    with pytest.raises(InvalidParameterError, match="power of two"):
        TensorQuant(4, 24, True)
    with pytest.raises(InvalidParameterError, match="unknown quantization mix"):
        make_plan("q4_k_m", 4)


def test_mixes_choose_per_tensor():
    plan = make_plan("asym4-head8-more", 8)
    assert plan("lm_head") == plan("embed") == TensorQuant(8, 32, True)
    assert plan("layers.0.down").bits == 8 and plan("layers.7.down").bits == 8  # first and last eighth
    assert plan("layers.1.down") == TensorQuant(4, 32, False, search=True)
    assert plan("layers.0.qkv").bits == 8 and plan("layers.1.qkv") == TensorQuant(4, 32, False, search=True)
    default = make_plan(DEFAULT_MIX, 8, block=64)
    assert default("layers.3.gate_up").block == default("lm_head").block == 64
    assert make_plan("rtn-sym4", 8)("lm_head") == TensorQuant(4, 32, True)
    wide = make_plan("asym4-head8-more", 8, int8_layer_block=128)  # a fast-mode export's 8-bit layers
    assert wide("layers.0.down") == wide("layers.7.qkv") == TensorQuant(8, 128, True)
    assert wide("lm_head") == wide("embed") == TensorQuant(8, 32, True)  # a tied head reads the embedding's
    assert wide("layers.1.down") == plan("layers.1.down")
    embed4 = make_plan("asym4-head8-embed4", 8)
    assert embed4("lm_head").bits == 8 and embed4("embed") == TensorQuant(4, 32, False, search=True)


def _save(graph, folder: Path) -> None:
    """``graph`` as folder/src.onnx, every initializer in its external data file (as export writes graphs)."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(folder / "src.onnx"), save_as_external_data=True, location="src.data",
                    size_threshold=0)


def _tiny_graph(folder: Path, k: int = 128, n: int = 48, vocab: int = 40) -> tuple[Path, np.ndarray, np.ndarray]:
    from onnx import TensorProto, helper, numpy_helper

    w, table = _weight(3, (k, n)), _weight(4, (vocab, k))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "layers.0.down"], ["y"], name="mm"),
         helper.make_node("Gather", ["embed", "ids"], ["e"], name="gather", axis=0)], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, k]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "layers.0.down"), numpy_helper.from_array(table, "embed")])
    _save(graph, folder)
    return folder / "src.onnx", w, table


@pytest.mark.parametrize("k", [128, 96], ids=["even-blocks", "odd-blocks"])  # 96 at block 32: 3 blocks a row,
@pytest.mark.parametrize("form", ALL_FORMS, ids=str)  # so 4-bit zero points end in a padded half byte
def test_onnxruntime_reads_the_blocks_as_numpy_does(tmp_path, form, k):
    ort = pytest.importorskip("onnxruntime")
    from specedge.export.rtn import quantize_streaming

    src, w, table = _tiny_graph(tmp_path, k=k)
    chosen: dict = {}
    quantize_streaming(src, tmp_path / "q.onnx", bits=4, block_size=32, symmetric=True, accuracy_level=0,
                       quantize_embeddings=True, plan=lambda name: form, chosen=chosen)
    # A lookup returns whole rows, so a block that does not divide the table's width falls back to 32.
    table_form = replace(form, block=32) if k % form.block else form
    # a MatMulNBits' scales stored as float16 (the quantizer picks scales float16 holds), a lookup's float32
    assert chosen == {"layers.0.down": (form, w.size, "", 16), "embed": (table_form, table.size, "", 32)}
    x = np.random.default_rng(5).standard_normal((1, 3, w.shape[0])).astype(np.float32)
    ids = np.array([[0, 7, table.shape[0] - 1]], np.int64)
    y, e = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "ids": ids})
    w_deq = quantize(np.ascontiguousarray(w.T), form).dequantize()[:, :k].T  # K zero-padded to the block
    np.testing.assert_allclose(y, x @ w_deq, rtol=1e-5, atol=1e-4)  # fp32 compute (accuracy_level 0)
    assert np.array_equal(e, quantize(table, table_form).dequantize()[ids])  # a lookup is exact


def test_an_input_axis_off_the_block_is_zero_padded(tmp_path):
    """K = 80 at block 32: three blocks, the last one half zeros; ORT's MatMulNBits reads it with K=80."""
    ort = pytest.importorskip("onnxruntime")
    from specedge.export.rtn import quantize_streaming

    src, w, table = _tiny_graph(tmp_path, k=80)
    form = TensorQuant(4, 32, False, search=True)
    blocks = quantize(np.ascontiguousarray(w.T), form)
    assert blocks.q.shape == (w.shape[1], 3, 32)
    assert np.array_equal(blocks.dequantize()[:, 80:], np.zeros((w.shape[1], 16), np.float32))
    chosen: dict = {}
    quantize_streaming(src, tmp_path / "q.onnx", bits=4, block_size=32, symmetric=True, accuracy_level=0,
                       quantize_embeddings=False, plan=lambda name: form, chosen=chosen)
    assert set(chosen) == {"layers.0.down"}  # the table stays fp32 without quantize_embeddings
    x = np.random.default_rng(6).standard_normal((1, 3, 80)).astype(np.float32)
    y, _ = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "ids": np.array([[0, 1, 2]], np.int64)})
    np.testing.assert_allclose(y, x @ blocks.dequantize()[:, :80].T, rtol=1e-5, atol=1e-4)


def _tied_graph(folder: Path, head_is_table: bool = True, ids_rank: int = 2) -> tuple[Path, np.ndarray]:
    """embed [vocab, K] gathered by ``ids``, and an output layer ``lm_head`` [K, vocab]: the table transposed
    (a tied model's untied fp32 graph) or, with ``head_is_table=False``, its own weights."""
    from onnx import TensorProto, helper, numpy_helper

    table = _weight(7, (40, 128))
    head = table.T.copy() if head_is_table else _weight(8, (40, 128)).T.copy()
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed", "ids"], ["e"], name="gather", axis=0),
         helper.make_node("MatMul", ["e", "lm_head"], ["logits"], name="head")], "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3][-ids_rank:])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "embed"), numpy_helper.from_array(head, "lm_head")])
    _save(graph, folder)
    return folder / "src.onnx", table


@pytest.mark.parametrize("ids_rank", [1, 2])
@pytest.mark.parametrize("form", [TensorQuant(8, 32, True), TensorQuant(8, 32, False), TensorQuant(4, 32, True),
                                  TensorQuant(4, 64, True, search=True)], ids=str)
def test_a_tied_head_reads_the_embeddings_integers(tmp_path, form, ids_rank):
    """One integer initializer, read by the lookup and by the output layer; both give the numpy dequantized
    table's values (the lookup exactly), and the record says the head shares the embedding's integers."""
    import onnx
    ort = pytest.importorskip("onnxruntime")
    from specedge.export.rtn import quantize_streaming

    src, table = _tied_graph(tmp_path, ids_rank=ids_rank)
    chosen: dict = {}
    quantize_streaming(src, tmp_path / "q.onnx", bits=4, block_size=32, symmetric=True, accuracy_level=0,
                       quantize_embeddings=True, plan=lambda name: form, chosen=chosen, tied=True)
    assert chosen == {"embed": (form, table.size, "", 32), "lm_head": (form, table.size, "embed", 0)}
    model = onnx.load(str(tmp_path / "q.onnx"), load_external_data=False)
    integers = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8 and len(t.dims) == 3
                and not t.name.endswith("zero_points")]
    assert integers == [f"embed_Q{form.bits}"]
    readers = [n.op_type for n in model.graph.node if integers[0] in n.input]
    assert sorted(readers) == ["GatherBlockQuantized", "MatMulNBits"]
    assert not any(t.name == "lm_head" for t in model.graph.initializer)  # the fp32 copy is gone
    ids = np.array([[0, 7, table.shape[0] - 1]], np.int64).reshape([1, 3][-ids_rank:])
    logits, e = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})
    deq = quantize(table, form).dequantize()
    assert np.array_equal(e, deq[ids])
    np.testing.assert_allclose(logits, e @ deq.T, rtol=1e-5, atol=1e-4)
    # one scale tensor, the lookup's (float32), which the head reads through a Reshape folded at load
    floats = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert floats == ["embed_scales"]
    # the manifest's stored bits count the head's own (8-bit) zero points only: integers and scales are embed's
    record = QuantizedTensor(form.bits, form.block, form.symmetric, "rtn", table.size, "embed", 0)
    assert record.bits_per_weight() == pytest.approx((0 if form.symmetric else 8) / form.block)
    assert "reads embed's integers" in record.describe()


@pytest.mark.parametrize("case", ["untied", "4-bit zero points", "forms differ", "not asked"])
def test_a_head_that_cannot_share_keeps_its_own_integers(tmp_path, case):
    """Sharing needs the head to be the table transposed, a zero-point layout both ops read, one form for
    both, and ``tied``; otherwise each keeps its own integers, as before."""
    import onnx
    from specedge.export.rtn import quantize_streaming

    src, table = _tied_graph(tmp_path, head_is_table=case != "untied")
    forms = {"4-bit zero points": TensorQuant(4, 32, False)}
    form = forms.get(case, TensorQuant(8, 32, True))
    plan = (lambda name: TensorQuant(4, 32, True) if name == "embed" else form) if case == "forms differ" else \
        (lambda name: form)
    chosen: dict = {}
    quantize_streaming(src, tmp_path / "q.onnx", bits=4, block_size=32, symmetric=True, accuracy_level=0,
                       quantize_embeddings=True, plan=plan, chosen=chosen, tied=case != "not asked")
    assert all(shares == "" for _, _, shares, _ in chosen.values())
    assert (chosen["lm_head"][3], chosen["embed"][3]) == (16, 32)
    model = onnx.load(str(tmp_path / "q.onnx"), load_external_data=False)
    integers = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8
                and not t.name.endswith("zero_points")}
    assert len(integers) == 2


def test_quantization_records_round_trip():
    mix = QuantMix("asym4-head8", {"layers.0.qkv": QuantizedTensor(4, 32, False, "search", 4096),
                                   "lm_head": QuantizedTensor(8, 32, True, "rtn", 1024)})
    extra = ManifestExtra(quantization={"target": mix})
    again = ManifestExtra.from_dict(extra.to_dict())
    assert again.quantization == {"target": mix}
    # int4/32 asym: 4 + (32 + 4)/32 bits per weight; int8/32 sym: 8 + 32/32
    assert again.quantization["target"].bits_per_weight() == pytest.approx((5.125 * 4096 + 9 * 1024) / 5120)
    assert "1 x int4/32 asym search" in mix.summary()
    assert "shares" not in extra.to_dict()["quantization"]["target"]["tensors"]["lm_head"]  # only when set
    shared = QuantMix("asym4-head8", dict(mix.tensors, lm_head=QuantizedTensor(8, 32, True, "rtn", 1024, "embed")))
    assert ManifestExtra.from_dict(ManifestExtra(quantization={"target": shared}).to_dict()).quantization == \
        {"target": shared}
    assert shared.bits_per_weight() == pytest.approx((5.125 * 4096 + 1 * 1024) / 5120)
    # float16 scales: 4 + (16 + 4)/32; "scale_bits" written only when not 32 (older manifests read as 32)
    half = QuantMix("asym4-head8", {"layers.0.qkv": QuantizedTensor(4, 32, False, "search", 4096, scale_bits=16)})
    assert half.bits_per_weight() == pytest.approx(4 + 20 / 32)
    assert ManifestExtra.from_dict(ManifestExtra(quantization={"target": half}).to_dict()).quantization == \
        {"target": half}
    assert "scale_bits" not in extra.to_dict()["quantization"]["target"]["tensors"]["layers.0.qkv"]
    bad = extra.to_dict()
    bad["quantization"]["target"]["tensors"]["lm_head"]["scale_bits"] = 8
    with pytest.raises(ManifestError, match=r"lm_head\.scale_bits' must be one of 0, 16, 32, got 8"):
        ManifestExtra.from_dict(bad)
    bad = extra.to_dict()
    bad["quantization"]["target"]["tensors"]["lm_head"]["bits"] = 3
    with pytest.raises(ManifestError, match=r"quantization\.target\.tensors\.lm_head\.bits"):
        ManifestExtra.from_dict(bad)
    bad["quantization"]["target"]["tensors"]["lm_head"].update(bits=8, method="awq")
    with pytest.raises(ManifestError, match="method"):
        ManifestExtra.from_dict(bad)


@pytest.fixture(scope="module")
def default_int4_bundle(tiny_model, export) -> Path:
    """The llama tiny model at int4 (default mix) with a self-int4 draft (the default mix without error feedback)."""
    return export(tiny_model("llama"), draft="self-int4", precision="int4")


@pytest.mark.parametrize("exact", [False, True])
def test_export_records_each_tensors_choice(default_int4_bundle, tiny_model, export, exact):
    from specedge.bundle.manifest import load_manifest
    from specedge.export.mixquant import WIDE_INT8_BLOCK, draft_mix

    bundle = export(tiny_model("llama"), draft="self-int4", precision="int4", exact=True) if exact \
        else default_int4_bundle
    manifest = load_manifest(bundle)
    n_layers = manifest.target.n_layers
    assert draft_mix(DEFAULT_MIX) == "asym4-head8-more"
    for role, mix in (("target", DEFAULT_MIX), ("draft", draft_mix(DEFAULT_MIX))):
        # fast mode's 8-bit layers in wide blocks; an exact export's target keeps them at the int4 block
        plan = make_plan(mix, n_layers, int8_layer_block=32 if exact and role == "target" else WIDE_INT8_BLOCK)
        record = manifest.extra.quantization[role]
        assert {t.block_size for n, t in record.tensors.items() if t.bits == 8 and n.startswith("layers.")} == \
            {32 if exact and role == "target" else 128}
        assert record.mix == mix
        names = {f"layers.{i}.{w}" for i in range(n_layers) for w in ("qkv", "o", "gate_up", "down")}
        assert set(record.tensors) == names | {"lm_head", "embed"}
        for name, t in record.tensors.items():
            form = plan(name)
            assert (t.bits, t.block_size, t.symmetric, t.method) == (form.bits, form.block, form.symmetric,
                                                                      form.method), name
            assert t.elements > 0
        assert {t.method for t in record.tensors.values()} == {"gptq" if role == "target" else "search", "rtn"}
    # the legacy mix records its (uniform) choice too
    legacy = load_manifest(export(tiny_model("llama"), precision="int4", quant_mix="rtn-sym4"))
    assert {(t.bits, t.symmetric, t.method) for t in legacy.extra.quantization["target"].tensors.values()} == \
        {(4, True, "rtn")}


def test_a_tied_model_stores_its_head_once(tiny_model, export, load_generator):
    """Qwen2 (tied) at the default mix: the int8 output layer reads the int8 embedding's integers, the record
    says so, the bundle is smaller than the two copies were, and self-speculation still equals greedy."""
    from specedge.bundle.manifest import load_manifest

    bundle = export(tiny_model("qwen2"), draft="self-int4", precision="int4", exact=True)
    manifest = load_manifest(bundle)
    for role in ("target", "draft"):
        tensors = manifest.extra.quantization[role].tensors
        assert tensors["lm_head"].shares == "embed" and tensors["embed"].shares == ""
        assert tensors["lm_head"].bits_per_weight() == 0  # integers and scales both read from embed's
        assert tensors["embed"].scale_bits == 32  # a lookup's scales stay float32 (export/scales.py)
    assert "reads embed's integers" in manifest.extra.quantization["target"].summary()
    assert_model_drafts_equal_plain(load_generator(bundle))


def test_default_mix_keeps_speculation_equal_to_greedy(tiny_model, export, load_generator):
    """The default mix's self-int4 draft (rounded without the target's error feedback, so the two differ):
    exact-mode speculation equals plain greedy decoding of the target, exported for exact mode."""
    assert_model_drafts_equal_plain(load_generator(export(tiny_model("llama"), draft="self-int4", precision="int4",
                                                          exact=True)))


def test_unknown_mix_is_refused():
    from specedge.export.bundle import ExportConfig

    with pytest.raises(InvalidParameterError, match="quant_mix must be one of"):
        ExportConfig(target="x", out=Path("y"), quant_mix="q4_k_m")
    assert set(MIXES) >= {DEFAULT_MIX, "rtn-sym4"}
