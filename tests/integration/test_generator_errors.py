"""Invariant: bad input fails early with a typed, explanatory error, never a stack trace from below.

At the Generator / config boundary: a missing bundle, a corrupt ONNX file that
passes the manifest's checksums (only ONNX Runtime can tell), a manifest whose IO
names do not match the graph, a prompt longer than max_context (refused before
any session runs), invalid generation parameters (refused before any session
runs), and an execution provider this install does not have.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import MAX_CONTEXT, PROMPT_IDS
from specedge.engines import EngineOptions, create_engine
from specedge.engines.base import KVCache
from specedge.errors import (BackendUnavailableError, BundleError, ContextOverflowError, InvalidParameterError,
                             ModelLoadError, SpecedgeError)
from specedge.bundle.manifest import file_record, load_manifest, resolve_inside
from specedge.runtime.generator import GenerationConfig, Generator
from tiny_models import edit_manifest


@pytest.fixture
def spied(self_spec_bundle):
    """A fresh Generator whose target and draft engines record every forward call (the target's bare
    engine: fast mode, the default, runs it directly and exact mode through its 2-row wrapper)."""
    gen = Generator.from_bundle(self_spec_bundle, threads=1)
    calls = []
    for role, engine in (("target", gen.target.inner), ("draft", gen.draft)):
        original = engine.forward

        def forward(*args, _original=original, _role=role, **kwargs):
            calls.append(_role)
            return _original(*args, **kwargs)

        engine.forward = forward
    return gen, calls


def _replace_file(bundle, rel: str, data: bytes) -> None:
    """Overwrite a bundle file AND fix its manifest record, so only the file's content is wrong."""
    path = bundle / rel
    path.write_bytes(data)
    edit_manifest(bundle, lambda obj: obj["files"].__setitem__(rel, file_record(path).to_dict()))


# --------------------------------------------------------------------------- bundles and graphs


def test_missing_bundle(tmp_path):
    with pytest.raises(BundleError, match=r"bundle .*nope does not exist"):
        Generator.from_bundle(tmp_path / "nope")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_onnx_with_valid_checksums_is_a_model_load_error(damage, llama_bundle, bundle_copy):
    bundle = bundle_copy(llama_bundle)
    graph = bundle / "target" / "model.onnx"
    original = graph.read_bytes()
    data = b"this is not an onnx protobuf \x00\x01\x02" * 50 if damage == "garbage" else original[:len(original) // 3]
    _replace_file(bundle, "target/model.onnx", data)
    # Checksums match. The loader reads the graph's protobuf for its external-data files and
    # refuses what does not parse; what parses but is not a graph, ONNX Runtime refuses.
    with pytest.raises(ModelLoadError, match=r"model.onnx .*truncated,? (or )?corrupt.*; re-export the bundle") as info:
        Generator.from_bundle(bundle)
    error = info.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)  # no ORT traceback
    assert "\n" not in str(info.value)


def test_manifest_io_names_must_match_the_graph(llama_bundle, bundle_copy):
    bundle = bundle_copy(llama_bundle)
    edit_manifest(bundle, lambda obj: obj["models"]["target"].update(io={"input_ids": "tokens"}))
    with pytest.raises(ModelLoadError, match=r"lacks tensors the manifest names: \['tokens'\]"):
        Generator.from_bundle(bundle)


def test_tokenizer_larger_than_the_model_vocab(llama_bundle, bundle_copy):
    bundle = bundle_copy(llama_bundle)
    edit_manifest(bundle, lambda obj: obj["models"]["target"].update(vocab_size=200, eos_token_ids=[1]))
    with pytest.raises(InvalidParameterError, match=r"tokenizer has 300 tokens but the target's vocab_size is 200"):
        Generator.from_bundle(bundle)


# --------------------------------------------------------------------------- context


def test_prompt_longer_than_max_context_fails_before_any_session_runs(spied):
    gen, calls = spied
    for n in (MAX_CONTEXT, MAX_CONTEXT + 50):
        prompt = [6 + i % 290 for i in range(n)]
        with pytest.raises(ContextOverflowError, match=rf"prompt is {n} tokens but max_context is {MAX_CONTEXT}"):
            gen.generate(input_ids=prompt, max_new_tokens=4)
        with pytest.raises(ContextOverflowError):
            gen.stream(input_ids=prompt, max_new_tokens=4)
    with pytest.raises(ContextOverflowError, match="max_context"):
        gen.generate(" ".join(f"w{6 + i % 290:03d}" for i in range(MAX_CONTEXT)), chat=False)
    assert calls == []
    # The generator is still usable afterwards.
    assert len(gen.generate(input_ids=PROMPT_IDS, max_new_tokens=3).token_ids) == 3
    assert calls


def test_engine_refuses_to_overflow_its_cache(llama_bundle):
    manifest = load_manifest(llama_bundle)
    engine = create_engine(manifest.target, resolve_inside(llama_bundle, manifest.target.graph),
                           EngineOptions(intra_op_threads=1))
    kv = engine.new_cache()
    engine.forward(np.arange(6, 6 + MAX_CONTEXT - 2, dtype=np.int64), kv)
    with pytest.raises(ContextOverflowError, match=rf"{MAX_CONTEXT - 2} cached \+ 3 new positions exceed "
                                                   rf"max_context {MAX_CONTEXT}"):
        engine.forward(np.array([6, 7, 8], np.int64), kv)
    assert kv.length == MAX_CONTEXT - 2  # nothing was written
    with pytest.raises(InvalidParameterError, match="at least one token"):
        engine.forward(np.zeros(0, np.int64), kv)


def test_cache_rewind_bounds():
    kv = KVCache(1, 1, 2, 8)
    kv.length = 3
    with pytest.raises(InvalidParameterError, match="cannot rewind 4 positions from a cache of length 3"):
        kv.rewind(4)
    with pytest.raises(InvalidParameterError):
        kv.rewind(-1)
    kv.rewind(3)
    assert kv.length == 0


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("overrides, match", [
    ({"temperature": -0.5}, r"temperature must be a number in \[0, 2\]; got -0.5"),
    ({"temperature": math.nan}, r"temperature must be a number in \[0, 2\]; got nan"),
    ({"temperature": math.inf}, r"temperature must be a number in \[0, 2\]; got inf"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]; got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
    ({"top_k": -1}, r"top_k must be an integer in \[0, \d+\]; got -1"),
    ({"top_k": 2.5}, r"top_k must be an integer"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be an integer in \[1, \d+\]; got 0"),
    ({"max_new_tokens": True}, r"max_new_tokens must be an integer"),
    ({"drafter": "beam"}, r"drafter must be one of none, auto, model, ngram, composite, suffix or None; got 'beam'"),
    ({"draft_tokens": -1}, r"draft_tokens must be an integer in \[0, 64\] or None; got -1"),
    ({"seed": -3}, r"seed must be an integer in \[0, \d+\] or None; got -3"),
    ({"p_min": 1.0}, r"p_min must be a number in \[0, 1\); got 1.0"),
    ({"min_ngram": 4, "max_ngram": 2}, r"1 <= min_ngram <= max_ngram"),
    ({"mode": "warp"}, r"mode must be one of"),
    ({"temprature": 0.5}, r"unknown generation parameter\(s\) \['temprature'\]; known: max_new_tokens"),
])
def test_invalid_generation_parameters(overrides, match, spied):
    gen, calls = spied
    with pytest.raises(InvalidParameterError, match=match):
        gen.generate(input_ids=PROMPT_IDS, **overrides)
    with pytest.raises(InvalidParameterError, match=match):
        gen.stream(input_ids=PROMPT_IDS, **overrides)
    assert calls == []


def test_invalid_config_object_is_refused_at_construction():
    with pytest.raises(InvalidParameterError, match="top_p"):
        GenerationConfig(top_p=2.0)
    assert isinstance(InvalidParameterError("x"), (SpecedgeError, ValueError))


@pytest.mark.parametrize("kwargs, match", [
    ({"input_ids": [5, 300]}, r"input_ids holds ids outside \[0, 300\): \[300\]"),
    ({"input_ids": [-1]}, r"outside \[0, 300\)"),
    ({"input_ids": []}, r"the prompt is empty"),
    ({"prompt": "", "chat": False}, r"the prompt is empty"),
    ({"prompt": "w010", "input_ids": [10]}, r"exactly one of prompt, messages or input_ids"),
    ({}, r"exactly one of prompt, messages or input_ids"),
    ({"prompt": 42}, r"prompt must be a string; got int"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object with string 'role' and 'content'"),
])
def test_invalid_prompts(kwargs, match, spied):
    gen, calls = spied
    with pytest.raises(InvalidParameterError, match=match):
        gen.generate(max_new_tokens=2, **kwargs)
    assert calls == []


def test_model_drafter_without_a_draft(llama_bundle, load_generator):
    gen = load_generator(llama_bundle)
    assert gen.draft is None and gen.manifest.speculation.drafter == "auto"
    for drafter in ("model", "composite"):
        with pytest.raises(InvalidParameterError, match=rf"drafter '{drafter}' needs a draft model, and this "
                                                        r"bundle has none"):
            gen.generate(input_ids=PROMPT_IDS, drafter=drafter)


# --------------------------------------------------------------------------- providers


def test_unavailable_provider_is_a_typed_error(llama_bundle):
    from specedge.engines.ort import available_providers

    if "cuda" in available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(BackendUnavailableError, match=r"execution provider 'cuda' is not available in this "
                                                      r"onnxruntime install; available: cpu"):
        Generator.from_bundle(llama_bundle, provider="cuda")


def test_unknown_provider_and_backend(llama_bundle):
    with pytest.raises(InvalidParameterError, match=r"provider must be one of cpu, cuda, tensorrt; got 'tpu'"):
        Generator.from_bundle(llama_bundle, provider="tpu")
    manifest = load_manifest(llama_bundle)
    with pytest.raises(BackendUnavailableError, match=r"unknown engine backend 'vulkan'; known: onnxruntime"):
        create_engine(manifest.target, resolve_inside(llama_bundle, manifest.target.graph), backend="vulkan")
    with pytest.raises(InvalidParameterError, match=r"thread counts must be integers in \[0, \d+\]"):
        EngineOptions(intra_op_threads=-1)
