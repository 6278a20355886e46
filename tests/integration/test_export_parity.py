"""Invariant: an exported graph computes what the PyTorch model computes.

- ORT logits equal transformers' logits (max abs diff < 1e-4) for a prefill, a
  1-token step on top of that past, and a multi-token (verify-sized) step on top
  of a past, for llama (GQA), qwen2 (tied embeddings, qkv bias) and gpt2, with
  both attention graphs (ORT's fused GroupQueryAttention and plain ops).
- The K/V the engine writes into the loop-owned cache are transformers' K/V
  (rotary applied), position-major, and a rewind followed by new tokens gives the
  logits of the new sequence: rollback is only a length change.
- IO binding and plain session runs agree.
- A self-int4 draft is real weight-only int4 (MatMulNBits nodes) and its bundle
  validates.
- A graph that disagrees with PyTorch is refused with ExportValidationError naming
  the step and the tolerance, and leaves no bundle behind.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCHS
from specedge.engines.base import EngineOptions
from specedge.engines.ort import OrtEngine
from specedge.errors import ExportValidationError
from specedge.bundle.manifest import load_manifest, resolve_inside
from tiny_models import load_hf

PARITY_ATOL = 1e-4
SEQ = np.array([7, 99, 3, 250, 18, 42, 42, 5, 131, 77, 260, 9, 64, 200, 11, 150, 6, 88, 23, 299], np.int64)
PREFILL, VERIFY = 12, 6  # 12-token prefill, then a 1-token step, then a 6-token step


def _engine(bundle, role="target", **options) -> OrtEngine:
    manifest = load_manifest(bundle)
    entry = manifest.models()[role]
    return OrtEngine(entry, resolve_inside(bundle, entry.graph), EngineOptions(intra_op_threads=1, **options))


def _torch_forward(model, ids: np.ndarray):
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(ids[None]), use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    keys = [layer.keys[0].permute(1, 0, 2).numpy() for layer in cache.layers]  # -> [T, kv_heads, head_dim]
    values = [layer.values[0].permute(1, 0, 2).numpy() for layer in cache.layers]
    return out.logits[0].numpy(), keys, values


# gpt2 has no rotary embedding, so it always gets the standard graph.
ARCH_ATTENTION = [(arch, att) for arch in ARCHS for att in ("gqa", "standard") if arch != "gpt2" or att == "standard"]


def _positions(buf: np.ndarray, layout: str) -> np.ndarray:
    """A cache buffer as [capacity, kv_heads, head_dim], whatever its layout."""
    return buf if layout == "position-major" else buf[0].transpose(1, 0, 2)


@pytest.mark.parametrize("arch, attention", ARCH_ATTENTION)
def test_ort_logits_match_pytorch_on_prefill_step_and_verify(arch, attention, tiny_model, export):
    reference, ref_keys, ref_values = _torch_forward(load_hf(tiny_model(arch)), SEQ)
    bundle = export(tiny_model(arch), attention=attention)
    assert load_manifest(bundle).target.attention == attention
    engine = _engine(bundle)
    kv = engine.new_cache()

    prefill = engine.forward(SEQ[:PREFILL], kv, num_logits=PREFILL).copy()
    step = engine.forward(SEQ[PREFILL:PREFILL + 1], kv, num_logits=1).copy()
    verify = engine.forward(SEQ[PREFILL + 1:PREFILL + 1 + VERIFY], kv, num_logits=VERIFY).copy()

    assert prefill.shape == (PREFILL, engine.vocab_size)
    assert step.shape == (1, engine.vocab_size)
    assert verify.shape == (VERIFY, engine.vocab_size)
    assert np.abs(prefill - reference[:PREFILL]).max() < PARITY_ATOL
    assert np.abs(step - reference[PREFILL:PREFILL + 1]).max() < PARITY_ATOL
    assert np.abs(verify - reference[PREFILL + 1:PREFILL + 1 + VERIFY]).max() < PARITY_ATOL
    # Random weights must still give distinct tokens, or the comparison above proves little.
    assert len(set(reference.argmax(-1).tolist())) > 5

    total = PREFILL + 1 + VERIFY
    assert kv.length == total
    for layer in range(len(ref_keys)):
        keys, values = _positions(kv.keys[layer], kv.layout), _positions(kv.values[layer], kv.layout)
        assert np.abs(keys[:total] - ref_keys[layer][:total]).max() < PARITY_ATOL
        assert np.abs(values[:total] - ref_values[layer][:total]).max() < PARITY_ATOL


@pytest.mark.parametrize("arch, attention", [("llama", "gqa"), ("llama", "standard"), ("gpt2", "standard")])
def test_rewind_then_new_tokens_gives_the_logits_of_the_new_sequence(arch, attention, tiny_model, export):
    model = load_hf(tiny_model(arch))
    engine = _engine(export(tiny_model(arch), attention=attention))
    kv = engine.new_cache()
    engine.forward(SEQ[:PREFILL], kv, num_logits=1)
    engine.forward(SEQ[PREFILL:PREFILL + 6], kv, num_logits=6)  # a "verify" whose last 4 are rejected
    kv.rewind(4)
    assert kv.length == PREFILL + 2
    replacement = np.array([31, 32, 33], np.int64)
    got = engine.forward(replacement, kv, num_logits=3)
    new_seq = np.concatenate([SEQ[:PREFILL + 2], replacement])
    reference, _, _ = _torch_forward(model, new_seq)
    assert np.abs(got - reference[-3:]).max() < PARITY_ATOL


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_io_binding_and_plain_runs_agree(attention, tiny_model, export):
    bundle = export(tiny_model("llama"), attention=attention)
    results = []
    for binding in (True, False):
        engine = _engine(bundle, use_io_binding=binding)
        kv = engine.new_cache()
        a = engine.forward(SEQ[:PREFILL], kv, num_logits=2).copy()
        b = engine.forward(SEQ[PREFILL:], kv, num_logits=len(SEQ) - PREFILL).copy()
        results.append((a, b, [_positions(k, kv.layout)[:kv.length].copy() for k in kv.keys]))
    (a1, b1, k1), (a2, b2, k2) = results
    np.testing.assert_allclose(a1, a2, atol=1e-6)
    np.testing.assert_allclose(b1, b2, atol=1e-6)
    for x, y in zip(k1, k2):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_num_logits_keeps_the_last_positions(llama_bundle):
    engine = _engine(llama_bundle)
    full = engine.forward(SEQ, engine.new_cache(), num_logits=len(SEQ)).copy()
    last3 = engine.forward(SEQ, engine.new_cache(), num_logits=3).copy()
    np.testing.assert_allclose(last3, full[-3:], atol=1e-6)


# --------------------------------------------------------------------------- int4


def test_self_int4_draft_is_matmulnbits_and_its_bundle_validates(int4_bundle):
    import onnx

    manifest = load_manifest(int4_bundle)  # sizes and sha256 of every file checked
    assert manifest.draft is not None
    assert manifest.draft.precision == "int4"
    assert manifest.target.precision == "fp32"
    assert manifest.draft.vocab_size == manifest.target.vocab_size
    assert manifest.speculation.drafter == "auto"  # the default: lookups, and the draft model where it pays

    def ops(role):
        graph = onnx.load(str(resolve_inside(int4_bundle, manifest.models()[role].graph)), load_external_data=False)
        inits = {t.name for t in graph.graph.initializer}
        return graph, [n for n in graph.graph.node if n.op_type == "MatMulNBits"], inits

    draft, nbits, inits = ops("draft")
    # Per layer: fused qkv, o, fused gate_up, down; plus the (untied) output layer.
    assert len(nbits) == 4 * manifest.draft.n_layers + 1
    assert all(n.domain == "com.microsoft" for n in nbits)
    leftover = [n.name for n in draft.graph.node if n.op_type in ("MatMul", "Gemm") and set(n.input) & inits]
    assert leftover == [], f"weight MatMuls left unquantized: {leftover}"
    target, target_nbits, _ = ops("target")
    assert target_nbits == []

    report = manifest.extra.validation["draft:int4-vs-fp32"]
    # Random 64-wide weights give flat softmaxes (top-1 ~5%), so int4 noise flips many argmaxes;
    # chance agreement would be 1/300. A broken quantized graph scores near chance.
    assert report.top1_agreement > 0.2
    assert np.isfinite(report.max_abs_diff)


def test_int4_draft_runs_and_speculation_keeps_greedy_output(int4_bundle, load_generator):
    gen = load_generator(int4_bundle)
    base = gen.generate(input_ids=list(range(6, 26)), max_new_tokens=32, speculation=False, exact=True)
    spec = gen.generate(input_ids=list(range(6, 26)), max_new_tokens=32, draft_tokens=4, exact=True)
    assert spec.token_ids == base.token_ids
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0


# --------------------------------------------------------------------------- validation


def _perturb_extract(monkeypatch, change):
    """Make the exporter build its graph from weights ``change`` has altered (PyTorch keeps the originals)."""
    from specedge.export import weights

    original = weights.extract

    def extract(model):
        spec, w, features = original(model)
        w = dict(w)
        change(w)
        return spec, w, features

    monkeypatch.setattr(weights, "extract", extract)


@pytest.mark.parametrize("rows, step", [
    (slice(0, None), r"the prefill \(7 tokens at positions 0\.\.6\)"),  # every position wrong: the prefill catches it
    (slice(7, None), r"the step \(1 tokens at positions 7\.\.7\)"),  # positions >= 7: the prefill passes
    (slice(8, None), r"the verify \(5 tokens at positions 8\.\.12\)"),  # positions >= 8: only the verify sees them
    # Only the last position the cache holds: the run to max_context catches it.
    (slice(63, None), r"the step after edge 63 \(1 tokens at positions 63\.\.63\)"),
    (slice(30, 31), r"the prefill chunk to position 57 \(45 tokens at positions 13\.\.57\)"),
])
def test_wrong_graph_raises_export_validation_error_naming_the_step(rows, step, tiny_model, tmp_path, monkeypatch):
    """gpt2's learned position table lets one perturbation reach exactly the steps we choose."""
    from specedge.export.bundle import ExportConfig, export_bundle

    def change(w):
        pos = w["pos_embed"].copy()
        pos[rows] += np.random.default_rng(0).normal(0, 1.0, pos[rows].shape).astype(np.float32)
        w["pos_embed"] = pos

    _perturb_extract(monkeypatch, change)
    out = tmp_path / "broken"
    with pytest.raises(ExportValidationError, match=step + r" differ from PyTorch by .* above the tolerance "
                                                    r"[0-9.e+-]+ \(0\.001 x logit scale"):
        export_bundle(ExportConfig(target=str(tiny_model("gpt2")), out=out, max_context=64, quiet=True))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no half-written bundle either


def test_wrong_llama_weight_is_caught(tiny_model, tmp_path, monkeypatch):
    def change(w):
        w["layers.1.o"] = w["layers.1.o"] * 1.5

    _perturb_extract(monkeypatch, change)
    from specedge.export.bundle import ExportConfig, export_bundle

    with pytest.raises(ExportValidationError, match=r"prefill \(7 tokens.* tolerance .* target/model\.onnx"):
        export_bundle(ExportConfig(target=str(tiny_model("llama")), out=tmp_path / "b", max_context=64, quiet=True))
    assert list(tmp_path.iterdir()) == []
