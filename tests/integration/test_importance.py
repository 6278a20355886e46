"""Activation importance and importance-weighted rounding (export/importance.py, export/mixquant.py; #37).

Invariants:
* the importance of each weight is the mean square of its MatMul's input per channel, equal to what
  transformers' own modules see on the same tokens;
* weighting by a uniform importance changes nothing; weighting never makes a block's weighted error
  worse than the unweighted search's, and an important channel is rounded closer;
* an ``-imatrix`` export records each searched tensor as "imatrix" and keeps speculation equal to plain
  greedy; a weighted form with no importance is searched unweighted and recorded as "search".
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from tiny_models import assert_model_drafts_equal_plain
from specedge.export.mixquant import TensorQuant, quantize

SEARCHED = [TensorQuant(4, 32, False, search=True), TensorQuant(4, 32, True, search=True)]


def _weight(seed: int, shape=(64, 128)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("form", SEARCHED, ids=str)
def test_uniform_importance_changes_nothing(form):
    w = _weight(1)
    plain = quantize(w, form)
    weighted = quantize(w, TensorQuant(form.bits, form.block, form.symmetric, True, weighted=True),
                        np.full(w.shape[1], 3.0, np.float32))
    assert np.array_equal(plain.q, weighted.q) and np.array_equal(plain.zero_points, weighted.zero_points)
    np.testing.assert_allclose(plain.scales, weighted.scales, rtol=1e-6)


@pytest.mark.parametrize("form", SEARCHED, ids=str)
def test_weighting_rounds_important_channels_closer(form):
    """A few channels 100x as important: their squared error drops, and no block's importance-weighted
    error is above the unweighted search's (the unweighted choice is one of the weighted search's candidates)."""
    w = _weight(2, (256, 128))
    importance = np.ones(128, np.float32)
    hot = np.arange(3, 128, 16)  # one channel in each half of every block of 32
    importance[hot] = 100.0
    weighted_form = TensorQuant(form.bits, form.block, form.symmetric, True, weighted=True)
    plain, weighted = quantize(w, form), quantize(w, weighted_form, importance)
    err_plain, err_weighted = (plain.dequantize() - w) ** 2, (weighted.dequantize() - w) ** 2
    assert err_weighted[:, hot].sum() < 0.8 * err_plain[:, hot].sum()
    e = importance / importance.mean() + 0.01
    per_block = lambda err: (err * e).reshape(w.shape[0], -1, form.block).sum(-1)  # noqa: E731
    assert (per_block(err_weighted) <= per_block(err_plain) * (1 + 1e-5) + 1e-9).all()


def test_bad_importance_is_refused():
    with pytest.raises(InvalidParameterError, match="needs a searched form"):
        TensorQuant(4, 32, False, weighted=True)
    with pytest.raises(InvalidParameterError, match="importance has 5 channels; the weight has 128"):
        quantize(_weight(3), TensorQuant(4, 32, False, True, weighted=True), np.ones(5, np.float32))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q|k|v biases, a tied head
def test_importance_is_the_mean_square_of_each_matmul_input(tiny_model, export, arch):
    """The fp32 graph's tapped MatMul inputs, averaged, equal transformers' module inputs on the same ids."""
    import torch
    from transformers import AutoModelForCausalLM

    from specedge.bundle.manifest import load_manifest
    from specedge.export.importance import activation_importance

    folder = tiny_model(arch)
    bundle = export(folder, precision="fp32")
    manifest = load_manifest(bundle)
    rng = np.random.default_rng(0)
    token_lists = [rng.integers(3, 300, 150).astype(np.int64), rng.integers(3, 300, 40).astype(np.int64)]
    importance = activation_importance(manifest.target, bundle / manifest.target.graph, token_lists, threads=1)
    assert not list(bundle.glob("**/*.importance.onnx"))  # the probe graph is removed

    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    seen: dict[str, list] = {}

    def tap(name):
        def hook(_module, args):
            seen.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]).double())
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj.register_forward_pre_hook(tap(f"layers.{i}.qkv"))
        layer.self_attn.o_proj.register_forward_pre_hook(tap(f"layers.{i}.o"))
        layer.mlp.gate_proj.register_forward_pre_hook(tap(f"layers.{i}.gate_up"))
        layer.mlp.down_proj.register_forward_pre_hook(tap(f"layers.{i}.down"))
    model.lm_head.register_forward_pre_hook(tap("lm_head"))
    with torch.no_grad():
        for ids in token_lists:
            model(torch.from_numpy(ids)[None])
    # an fp32 graph reads a tied head as a Gemm over the embedding (no MatMul weight): the quantized
    # export's untied fp32 graph has the lm_head MatMul
    assert set(importance) == set(seen) - ({"lm_head"} if model.config.tie_word_embeddings else set())
    for name in importance:
        xs = seen[name]
        x = torch.cat(xs)
        expected = (x * x).mean(0).numpy()
        np.testing.assert_allclose(importance[name], expected, rtol=2e-4, atol=1e-7, err_msg=name)


def test_an_imatrix_export_records_its_method(tiny_model, export, load_generator):
    from specedge.bundle.manifest import load_manifest
    from specedge.export.mixquant import make_plan

    bundle = export(tiny_model("llama"), draft="self-int4", precision="int4", quant_mix="asym4-head8-more-imatrix",
                    exact=True)  # exported for the exact-mode check below
    manifest = load_manifest(bundle)
    plan = make_plan("asym4-head8-more-imatrix", manifest.target.n_layers)
    for role in ("target", "draft"):
        record = manifest.extra.quantization[role]
        assert record.mix == "asym4-head8-more-imatrix"
        for name, t in record.tensors.items():
            assert t.method == ("imatrix" if plan(name).search else "rtn"), name
    assert_model_drafts_equal_plain(load_generator(bundle))


def test_a_large_model_measures_importance_on_an_int4_copy(tiny_model, export, tmp_path):
    """Where the fp32 graph is validated by layers (too big to run whole), the importance comes from a
    round-to-nearest int4 copy: the same weights and channels, ranked as fp32's are."""
    from specedge.bundle.manifest import load_manifest
    from specedge.export.importance import activation_importance
    from specedge.export.quantize import QuantConfig, quantize_graph

    bundle = export(tiny_model("llama"), precision="int4", quant_mix="asym4-head8-imatrix", validation="layers")
    record = load_manifest(bundle).extra.quantization["target"]
    assert {t.method for name, t in record.tensors.items() if name.startswith("layers.")} == {"imatrix"}

    fp32 = export(tiny_model("llama"), precision="fp32")
    manifest = load_manifest(fp32)
    graph = fp32 / manifest.target.graph
    int4 = quantize_graph(graph, tmp_path / "model.onnx", QuantConfig(bits=4, block_size=32))[0]
    ids = [np.random.default_rng(1).integers(3, 300, 120).astype(np.int64)]
    exact = activation_importance(manifest.target, graph, ids)
    approx = activation_importance(manifest.target, int4, ids, weights_of=graph)
    assert set(approx) == set(exact)
    for name in exact:
        # 0.94-0.997 here: a random tiny model's int4 rounding is much harsher than a trained model's
        assert np.corrcoef(exact[name], approx[name])[0, 1] > 0.9, name


def test_a_weighted_form_without_importance_is_searched_plainly(tmp_path):
    """quantize_streaming given no importance for a weighted form records plain search, not "imatrix"."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from specedge.export.rtn import quantize_streaming

    w = _weight(4, (128, 48))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "layers.0.down"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "layers.0.down")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "src.onnx"))
    form = TensorQuant(4, 32, False, True, weighted=True)
    for importance, method in ((None, "search"), ({"layers.0.down": np.ones(128, np.float32)}, "imatrix")):
        chosen: dict = {}
        quantize_streaming(tmp_path / "src.onnx", tmp_path / "q.onnx", bits=4, block_size=32, symmetric=True,
                           accuracy_level=0, quantize_embeddings=False, plan=lambda name: form, chosen=chosen,
                           importance=importance)
        assert chosen["layers.0.down"][0].method == method
