"""Bounded-memory export (issue #38): the streamed source and the layer-limited validation change
memory, never results.

- A source streamed from its safetensors files (export/streamed.py) gives the family builders the
  same float32 weights and the validation the same logits, bit for bit, as the whole model, for
  every family the test suite builds; one that does not map one to one loads whole.
- A streamed forward holds one module's parameters at a time, and none once it returns.
- A 2-layer model has nothing past its first two layers: the layer-limited check builds the whole
  graph, so its record equals the whole-graph record, and the int4 bundle (graph and data) is the
  same byte for byte, with the same greedy tokens.
- A 4-layer model validated by layers checks the first two and compares the int4 graph with the
  source itself; a wrong layer in those two is still caught.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCHS, PROMPT_IDS
from specedge.errors import ExportValidationError
from specedge.export.bundle import ExportConfig, export_bundle
from specedge.export.loader import load_source
from tiny_models import FAMILY_FIELDS

FAMILIES = tuple(ARCHS) + tuple(FAMILY_FIELDS)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_streamed_source_gives_the_whole_models_weights_and_logits(tiny_model, arch):
    from specedge.export.streamed import StreamedModel
    from specedge.export.validate import _torch_logits
    from specedge.export.weights import extract

    folder = tiny_model(arch, seed=0)
    whole = load_source(str(folder), quiet=True)
    streamed = load_source(str(folder), quiet=True, stream=True)
    spec_w, weights_w, _ = extract(whole.model)
    spec_s, weights_s, _ = extract(streamed.model)
    assert spec_s == spec_w and sorted(weights_s) == sorted(weights_w)
    for name in weights_w:
        assert np.array_equal(weights_s[name], weights_w[name]), name
    ids = np.arange(3, 43, dtype=np.int64)
    rows = np.array([0, 17, 39])
    assert np.array_equal(_torch_logits(streamed.model, ids, rows=rows), _torch_logits(whole.model, ids, rows=rows))
    assert np.array_equal(_torch_logits(streamed.model, ids, layers=1), _torch_logits(whole.model, ids, layers=1))
    assert streamed.eos_token_ids == whole.eos_token_ids
    if arch == "gpt_neox":  # its checkpoint names differ from the module's: it loads whole, as before
        assert not isinstance(streamed.model, StreamedModel)
    else:
        assert isinstance(streamed.model, StreamedModel)


def test_a_streamed_forward_holds_one_modules_weights_at_a_time(tiny_model):
    import torch

    model = load_source(str(tiny_model("llama")), quiet=True, stream=True).model
    modules = [m for m in model.modules() if any(p is not None for p in m._parameters.values())]
    loaded_during = []

    def count(_module, _args):
        loaded_during.append(sum(p.device.type != "meta" for m in modules for p in m._parameters.values()
                                 if p is not None))

    hooks = [m.register_forward_pre_hook(count) for m in modules]  # runs after the loading pre-hook
    with torch.no_grad():
        model(torch.arange(5)[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    assert len(loaded_during) == len(modules)  # every module with weights ran once
    most = max(sum(p is not None for p in m._parameters.values()) for m in modules)
    assert max(loaded_during) <= most
    assert all(p.device.type == "meta" for p in model.parameters())


def _export(folder, out, **options):
    return export_bundle(ExportConfig(target=str(folder), out=out, precision="int4", max_context=64, quiet=True,
                                      **options))


def test_layered_validation_of_a_two_layer_model_is_the_whole_check(tiny_model, tmp_path):
    from specedge.runtime.generator import Generator

    folder = tiny_model("llama")
    # An unweighted mix: the default's error feedback measures its calibration activations on the fp32 graph
    # when validating whole and on an int4 copy when validating by layers, so its integers differ by design
    # (test_importance.py covers that route); the validation mode itself must change nothing.
    whole = _export(folder, tmp_path / "whole", validation="whole", quant_mix="asym4-head8-more")
    layered = _export(folder, tmp_path / "layers", validation="layers", quant_mix="asym4-head8-more")
    assert layered.extra.validation["target:fp32-first-2-layers"] == whole.extra.validation["target:fp32-untied"]
    assert "target:int4-vs-source" in layered.extra.validation
    for name in ("target/model.onnx", "target/model.onnx.data"):
        assert (tmp_path / "layers" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    tokens = [Generator.from_bundle(tmp_path / b, threads=1).generate(input_ids=PROMPT_IDS, max_new_tokens=12).token_ids
              for b in ("whole", "layers")]
    assert tokens[0] == tokens[1]


def test_layered_validation_checks_the_first_layers_and_compares_int4_with_the_source(tiny_model, tmp_path):
    folder = tiny_model("qwen2", config={"num_hidden_layers": 4})
    manifest = _export(folder, tmp_path / "b", validation="layers")
    record = manifest.extra.validation["target:fp32-first-2-layers"]
    assert max(record.max_abs_diff.values()) <= record.tolerance and record.top1_agreement == 1.0
    comparison = manifest.extra.validation["target:int4-vs-source"]
    assert 0.0 < comparison.top1_agreement <= 1.0 and np.isfinite(comparison.max_abs_diff)
    assert "target:fp32-untied" not in manifest.extra.validation


def test_layered_validation_still_catches_a_wrong_graph(tiny_model, tmp_path, monkeypatch):
    from specedge.export import graph

    real = graph.build_decoder

    def wrong_norm_eps(spec, weights, out_path, **kw):  # a builder bug in every layer's norm
        from dataclasses import replace

        return real(replace(spec, norm_eps=spec.norm_eps * 1e6), weights, out_path, **kw)

    monkeypatch.setattr(graph, "build_decoder", wrong_norm_eps)
    with pytest.raises(ExportValidationError, match="differ from PyTorch"):
        _export(tiny_model("llama"), tmp_path / "b", validation="layers")


def test_auto_validation_keeps_the_whole_check_for_small_models(tiny_model, tmp_path):
    manifest = _export(tiny_model("llama"), tmp_path / "b")
    assert "target:fp32-untied" in manifest.extra.validation
    assert "target:int4-vs-fp32" in manifest.extra.validation


def test_a_large_vocabulary_is_checked_on_evenly_spaced_columns(tiny_model, tmp_path, monkeypatch):
    from specedge.export import bundle

    monkeypatch.setattr(bundle, "CHECK_HEAD_COLUMNS", 64)  # the tiny vocabulary (300) counts as large
    manifest = _export(tiny_model("qwen2", config={"num_hidden_layers": 4}), tmp_path / "b", validation="layers")
    record = manifest.extra.validation["target:fp32-first-2-layers"]
    assert max(record.max_abs_diff.values()) <= record.tolerance
    assert manifest.target.vocab_size == 300 and manifest.target.head_tokens is None  # the bundle keeps every column
    assert not any(p.name.startswith(".") for p in (tmp_path / "b").iterdir())  # the check's graph is gone


@pytest.mark.parametrize("keep", [False, True])
def test_a_gguf_sources_float32_copy_is_kept_only_when_asked(tiny_model, tmp_path, monkeypatch, keep):
    from tiny_models import write_gguf

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECEDGE_CACHE", str(cache))
    source = write_gguf(tiny_model("qwen3", seed=0, config={"head_dim": 128}), tmp_path / "tiny-qwen3.gguf")
    manifest = export_bundle(ExportConfig(target=str(source), out=tmp_path / "b", max_context=64, quiet=True,
                                          keep_converted=keep))
    kept = sorted(p.name for p in (cache / "converted").iterdir()) if (cache / "converted").is_dir() else []
    assert len(kept) == (1 if keep else 0) and all(name.startswith("tiny-qwen3-") for name in kept)
    assert not any(name.startswith(".") for name in manifest.files)  # the scratch copy is not in the bundle
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no partial folder left either


def test_the_export_quality_record_is_the_one_scored_in_turn(tiny_model, tmp_path):
    """export_quality scores the source first and keeps its logits; the record equals run_eval's in turn."""
    from specedge.bundle.manifest import load_manifest
    from specedge.engines.base import EngineOptions
    from specedge.engines.ort import OrtEngine
    from specedge.export.quality import export_quality, torch_scorer
    from specedge.quality.evaluate import EXPORT_MAX_TOKENS, builtin_texts, engine_scorer, plan_eval, run_eval
    from specedge.runtime.loading import load_codec

    folder = tiny_model("llama")
    _export(folder, tmp_path / "b")
    entry = load_manifest(tmp_path / "b").target
    graph = tmp_path / "b" / entry.graph
    codec = load_codec(tmp_path / "b", load_manifest(tmp_path / "b").tokenizer)
    model = load_source(str(folder), quiet=True, stream=True).model
    got = export_quality(graph, entry, codec, model, "src", lambda _: None)
    plan = plan_eval(builtin_texts(), codec, max_context=entry.max_context, max_tokens=EXPORT_MAX_TOKENS)
    expected = run_eval(plan, engine_scorer(OrtEngine(entry, graph, EngineOptions())), torch_scorer(model),
                        source_name="src")
    assert got == expected


def test_layered_validation_builds_one_layer_of_every_kind():
    """Every distinct (window, rope) pair gets a layer: a NoPE layer (rope -1) or a sliding window
    first met at layer 3 makes the check build 4 layers; a uniform model builds 2."""
    from types import SimpleNamespace

    from specedge.export.validate import validation_layers

    def spec(n_layers, window=lambda i: 0, rope=lambda i: 0):
        return SimpleNamespace(n_layers=n_layers, window=window, rope=rope)

    assert validation_layers(spec(8)) == 2
    assert validation_layers(spec(8, rope=lambda i: -1 if i % 4 == 3 else 0)) == 4  # SmolLM3's NoPE layers
    assert validation_layers(spec(8, window=lambda i: 0 if i % 6 == 5 else 512)) == 6  # Gemma 3's 5:1
    assert validation_layers(spec(1)) == 1
