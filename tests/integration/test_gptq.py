"""Error-feedback rounding (GPTQ) for the ``-gptq`` mixes (export/mixquant.py ``_gptq``, export/importance.py
``activation_moments``; #37).

Invariants:
* the second moment handed to a weight is its input's E[x xᵀ] over the calibration tokens, however it was
  held (the running product, or the activations where those are smaller);
* with correlated inputs, the output error ``x · (w - ŵ)`` on held-out inputs drawn like the calibration's
  is well below the importance-weighted search's, which sees only the diagonal;
* with uncorrelated inputs (a diagonal moment) there is nothing to feed back: each block's weighted error is
  no worse than the weighted search's;
* a ``-gptq`` export records its searched int4 tensors as "gptq" and keeps speculation equal to plain greedy.
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from tiny_models import assert_model_drafts_equal_plain
from specedge.export.mixquant import TensorQuant, quantize

GPTQ_FORMS = [TensorQuant(4, 32, False, True, True, True), TensorQuant(4, 32, True, True, True, True)]


def _correlated_inputs(seed: int, tokens: int, k: int) -> np.ndarray:
    """[tokens, k]: mixed channels (correlated) with a few loud ones, as a transformer's hidden state has."""
    rng = np.random.default_rng(seed)
    mixing = np.random.default_rng(100).standard_normal((k, k)) / np.sqrt(k)
    loudness = np.exp(np.random.default_rng(101).standard_normal(k))
    return (rng.standard_normal((tokens, k)) @ mixing) * loudness


@pytest.fixture(params=[False, True], ids=["in-order", "act-order"])
def act_order(request, monkeypatch):
    """Both channel orders: as they come (each block's scale searched when reached) and loudest first
    (every block's scale fixed up front)."""
    import specedge.export.mixquant as mq

    monkeypatch.setattr(mq, "GPTQ_ACT_ORDER", request.param)
    return request.param


@pytest.mark.parametrize("form", GPTQ_FORMS, ids=str)
def test_error_feedback_lowers_the_output_error_on_held_out_inputs(form, act_order):
    k = 256
    w = np.random.default_rng(3).standard_normal((96, k)).astype(np.float32)
    x = _correlated_inputs(4, 1500, k)
    moment = x.T @ x / len(x)
    held_out = _correlated_inputs(5, 1500, k)
    weighted = TensorQuant(form.bits, form.block, form.symmetric, True, weighted=True)

    def output_error(blocks) -> float:
        return float(np.mean((held_out @ (blocks.dequantize() - w).T) ** 2))

    gptq, imatrix = output_error(quantize(w, form, moment)), output_error(quantize(w, weighted, np.diag(moment)))
    assert gptq < 0.75 * imatrix, (gptq, imatrix)  # 0.54-0.56 of it in order, 0.40-0.41 loudest first


def test_a_diagonal_moment_feeds_nothing_back(act_order):
    """Uncorrelated inputs: each channel's rounding cannot be offset by another's, and rounding each block
    with its searched scale is at least as good, block by block, as the weighted search's integers."""
    w = np.random.default_rng(6).standard_normal((64, 128)).astype(np.float32)
    importance = np.exp(np.random.default_rng(7).standard_normal(128)).astype(np.float32)
    gptq = quantize(w, GPTQ_FORMS[0], np.diag(importance))
    search = quantize(w, TensorQuant(4, 32, False, True, weighted=True), importance)
    e = importance / importance.mean() + 0.01
    per_block = lambda b: ((b.dequantize() - w) ** 2 * e).reshape(64, -1, 32).sum(-1)  # noqa: E731
    np.testing.assert_array_equal(gptq.scales, search.scales)
    assert (per_block(gptq) <= per_block(search) * (1 + 1e-5) + 1e-9).all()


def test_a_padded_input_axis_and_silent_channels(act_order):
    """K not a multiple of the block is padded (as the unweighted form pads it); a channel no calibration
    token used (zero row and column of the moment) is still rounded, from its own weights."""
    w = np.random.default_rng(8).standard_normal((16, 80)).astype(np.float32)
    x = _correlated_inputs(9, 400, 80)
    x[:, 5] = 0.0
    blocks = quantize(w, GPTQ_FORMS[0], x.T @ x / len(x))
    assert blocks.q.shape == (16, 3, 32)
    assert np.isfinite(blocks.scales).all()
    error = blocks.dequantize()[:, :80] - w
    assert np.abs(error[:, 5]).max() <= blocks.scales[:, 0].max()  # within a level of its own value


def test_the_inverse_factor_with_and_without_torch(monkeypatch):
    """U with H⁻¹ = Uᵀ U, upper triangular: through torch's triangular solve, and numpy's inverse where torch
    is absent; the two agree."""
    import builtins

    from specedge.export.mixquant import _inverse_upper_factor

    x = _correlated_inputs(12, 300, 64)
    h = x.T @ x / 300 + 0.01 * np.eye(64)
    with_torch = _inverse_upper_factor(h)
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    without = _inverse_upper_factor(h)
    for u in (with_torch, without):
        assert np.allclose(u, np.triu(u)) and (np.diag(u) > 0).all()
        np.testing.assert_allclose(u.T @ u, np.linalg.inv(h), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(with_torch, without, rtol=1e-9, atol=1e-12)


def test_bad_moments_are_refused():
    with pytest.raises(InvalidParameterError, match="needs a weighted form"):
        TensorQuant(4, 32, False, True, gptq=True)
    with pytest.raises(InvalidParameterError, match="second moment is 5 x 5; the weight has 128 inputs"):
        quantize(np.ones((4, 128), np.float32), GPTQ_FORMS[0], np.eye(5))


@pytest.mark.parametrize("tokens, spilled", [(40, False), (40, True), (400, False)],
                         ids=["activations-in-memory", "activations-on-disk", "product"])
def test_a_moment_is_the_same_however_it_is_held(tokens, spilled, tmp_path):
    from specedge.export.importance import _Moment

    x = _correlated_inputs(10, tokens, 96)
    moment = _Moment(96, tokens, tmp_path / "0.f32" if spilled else None)
    assert moment.stack == (tokens < 96)
    assert (tmp_path / "0.f32").exists() == spilled
    for start in range(0, tokens, 32):
        moment.add(x[start:start + 32])
    np.testing.assert_allclose(moment.mean(tokens), x.T @ x / tokens, rtol=1e-5, atol=1e-6)


def test_moments_are_each_matmul_inputs_second_moment(tiny_model, export):
    """On the fp32 graph, each weight's moment has the importance as its diagonal and is symmetric
    positive semi-definite; a fused input's weights share one."""
    from specedge.bundle.manifest import load_manifest
    from specedge.export.importance import activation_importance, activation_moments

    bundle = export(tiny_model("llama"), precision="fp32")
    manifest = load_manifest(bundle)
    graph = bundle / manifest.target.graph
    ids = [np.random.default_rng(11).integers(3, 300, 150).astype(np.int64)]
    moments = activation_moments(manifest.target, graph, ids, threads=1)
    importance = activation_importance(manifest.target, graph, ids, threads=1)
    assert set(moments) == set(importance)
    for name, diag in importance.items():
        m = moments[name]
        np.testing.assert_allclose(np.diag(m), diag, rtol=1e-4, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(m, m.T, rtol=1e-5, atol=1e-7)
        assert np.linalg.eigvalsh(m.astype(np.float64)).min() > -1e-4 * np.abs(m).max()


def test_a_gptq_export_records_its_method_and_speculation_stays_exact(tiny_model, export, load_generator):
    from specedge.bundle.manifest import load_manifest
    from specedge.export.mixquant import make_plan

    """The target is rounded with error feedback; its self-int4 draft with the same forms searched plainly
    (export/mixquant.py draft_mix), so the two differ and speculation corrects the draft."""
    bundle = export(tiny_model("llama"), draft="self-int4", precision="int4", quant_mix="asym4-head8-more-gptq",
                    exact=True)  # exported for the exact-mode check below
    manifest = load_manifest(bundle)
    plan = make_plan("asym4-head8-more-gptq", manifest.target.n_layers)
    for role, mix, method in (("target", "asym4-head8-more-gptq", "gptq"), ("draft", "asym4-head8-more", "search")):
        record = manifest.extra.quantization[role]
        assert record.mix == mix
        for name, t in record.tensors.items():
            assert t.method == (method if plan(name).search else "rtn"), name
    assert_model_drafts_equal_plain(load_generator(bundle))


def test_a_model_without_calibration_tokens_is_searched_and_recorded_so(tiny_model, export):
    """The tiny qwen2 model's tokenizer encodes the calibration texts to ids beyond its graph's vocabulary: no
    moments can be measured, so its int4 blocks are searched unweighted and the record says "search"."""
    from specedge.bundle.manifest import load_manifest

    bundle = export(tiny_model("qwen2"), precision="int4", quant_mix="asym4-head8-gptq")
    record = load_manifest(bundle).extra.quantization["target"]
    assert {t.method for name, t in record.tensors.items() if name.startswith("layers.")} == {"search"}
