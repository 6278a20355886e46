"""Hardening: invalid parameters and over-long inputs are refused before any ONNX session runs.

What this module tries, on a tiny llama bundle (max_context 64) whose draft is an fp32
copy of the target:

- each invalid parameter, given as a generate() keyword, as a GenerationConfig field, and
  through stream(), raises InvalidParameterError whose message states the allowed range:
  draft_tokens -1, temperature -1 / NaN / inf / a string, top_p 0 / 1.5 / NaN, top_k -1 /
  1.5, max_new_tokens 0 / -5 / 1.5 / True, seed -1, p_min 1.0, n-gram sizes out of order,
  an unknown drafter, an unknown mode, an unknown keyword; an unknown provider
  (EngineOptions(provider="npu"), Generator.from_bundle(provider="npu")), negative thread
  counts; OrtEngine.forward is replaced by a function that fails the test, so any session
  run before the error would show;
- a prompt of max_context tokens or more: ContextOverflowError, before any session runs;
  a prompt of max_context - 1 tokens generates exactly one token;
- a 50-token prompt with max_new_tokens=100 in a 64-token context stops at the context:
  finish_reason "length", a message naming max_context, the prompt plus output fill the
  context exactly, never an ORT shape error, and the output equals plain decoding's;
  with speculation (k = 8, self-draft, sequential and pipelined; the n-gram drafter) and
  without.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from specedge.engines.base import EngineOptions
from specedge.engines.ort import OrtEngine
from specedge.errors import ContextOverflowError, InvalidParameterError
from specedge.runtime.generator import GenerationConfig, Generator
from tiny_models import build_model

MAX_CONTEXT = 64
PROMPT = list(range(6, 56))  # 50 plain word ids


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from specedge.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("hardening-params")
    folder = build_model(root / "model", "llama", 0)
    out = root / "bundle"
    export_bundle(ExportConfig(target=str(folder), out=out, draft=str(folder), max_context=MAX_CONTEXT, quiet=True))
    return out


@pytest.fixture(scope="module")
def gen(bundle) -> Generator:
    return Generator.from_bundle(bundle, threads=1)


@pytest.fixture
def no_session_runs(monkeypatch):
    """Any OrtEngine.forward call fails the test (the error must come first)."""
    def forward(self, *args, **kwargs):
        raise AssertionError("an ONNX session ran before the invalid input was refused")

    monkeypatch.setattr(OrtEngine, "forward", forward)


INVALID = [
    ({"draft_tokens": -1}, r"draft_tokens must be an integer >= 0; got -1"),
    ({"draft_tokens": 2.5}, r"draft_tokens must be an integer >= 0"),
    ({"temperature": -1.0}, r"temperature must be a finite number >= 0 \(0 = greedy\); got -1.0"),
    ({"temperature": math.nan}, r"temperature must be a finite number >= 0.*got nan"),
    ({"temperature": math.inf}, r"temperature must be a finite number >= 0.*got inf"),
    ({"temperature": "0.7"}, r"temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1 = off\); got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\].*got 1.5"),
    ({"top_p": math.nan}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 = off\); got -1"),
    ({"top_k": 1.5}, r"top_k must be an integer >= 0"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1; got 0"),
    ({"max_new_tokens": -5}, r"max_new_tokens must be an integer >= 1; got -5"),
    ({"max_new_tokens": 1.5}, r"max_new_tokens must be an integer >= 1; got 1.5"),
    ({"max_new_tokens": True}, r"max_new_tokens must be an integer >= 1; got True"),
    ({"seed": -1}, r"seed must be an integer >= 0 or None; got -1"),
    ({"p_min": 1.0}, r"p_min must be in \[0, 1\); got 1.0"),
    ({"min_ngram": 3, "max_ngram": 2}, r"n-gram sizes need 1 <= min_ngram <= max_ngram"),
    ({"drafter": "oracle"}, r"drafter must be one of none, model, ngram, composite; got 'oracle'"),
    ({"mode": "parallel"}, r"mode must be one of sequential, pipelined, auto; got 'parallel'"),
]


@pytest.mark.parametrize("overrides, match", INVALID, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_invalid_parameters_are_refused_before_any_session_runs(gen, no_session_runs, overrides, match):
    with pytest.raises(InvalidParameterError, match=match):
        gen.generate(input_ids=PROMPT[:5], **overrides)
    with pytest.raises(InvalidParameterError, match=match):
        gen.stream(input_ids=PROMPT[:5], **overrides)  # at the call, not at the first next()
    with pytest.raises(InvalidParameterError, match=match):
        GenerationConfig(**overrides)


def test_unknown_generation_keyword(gen, no_session_runs):
    with pytest.raises(InvalidParameterError, match=r"unknown generation parameter\(s\) \['temprature'\]; known: "
                                                     r"max_new_tokens, temperature"):
        gen.generate(input_ids=PROMPT[:5], temprature=0.5)
    with pytest.raises(InvalidParameterError, match=r"unknown generation parameter"):
        gen.stream(input_ids=PROMPT[:5], k=4)


def test_invalid_engine_options(bundle, monkeypatch):
    import onnxruntime

    def no_session(*args, **kwargs):
        raise AssertionError("an ONNX session was created before the invalid option was refused")

    monkeypatch.setattr(onnxruntime, "InferenceSession", no_session)
    with pytest.raises(InvalidParameterError, match=r"provider must be one of cpu, cuda, tensorrt; got 'npu'"):
        EngineOptions(provider="npu")
    with pytest.raises(InvalidParameterError, match=r"provider must be one of cpu, cuda, tensorrt; got 'npu'"):
        Generator.from_bundle(bundle, provider="npu")
    with pytest.raises(InvalidParameterError, match=r"thread counts must be >= 0"):
        Generator.from_bundle(bundle, threads=-1)
    with pytest.raises(InvalidParameterError, match=r"graph_optimization must be one of disable, basic, extended, "
                                                     r"all; got 'max'"):
        EngineOptions(graph_optimization="max")


@pytest.mark.parametrize("length", [MAX_CONTEXT, MAX_CONTEXT + 1, 10 * MAX_CONTEXT])
def test_prompt_that_does_not_fit_is_refused_before_any_session_runs(gen, no_session_runs, length):
    prompt = [6 + i % 290 for i in range(length)]
    match = rf"prompt is {length} tokens but max_context is {MAX_CONTEXT}"
    with pytest.raises(ContextOverflowError, match=match):
        gen.generate(input_ids=prompt, max_new_tokens=1)
    with pytest.raises(ContextOverflowError, match=match):
        gen.stream(input_ids=prompt)
    text = " ".join(f"w{6 + i % 290:03d}" for i in range(length))
    with pytest.raises(ContextOverflowError, match=r"max_context is 64"):
        gen.generate(text, chat=False)


def test_a_prompt_one_short_of_the_context_gets_one_token(gen):
    prompt = [6 + i for i in range(MAX_CONTEXT - 1)]
    result = gen.generate(input_ids=prompt, max_new_tokens=10, draft_tokens=8, drafter="model")
    assert len(result.token_ids) == 1
    assert result.finish_reason == "length" and "max_context" in result.message


SPECULATION = [
    pytest.param({"speculation": False}, id="plain"),
    pytest.param({"drafter": "model", "draft_tokens": 8}, id="self-draft-k8"),
    pytest.param({"drafter": "model", "draft_tokens": 8, "mode": "pipelined"}, id="self-draft-k8-pipelined"),
    pytest.param({"drafter": "ngram", "draft_tokens": 8}, id="ngram-k8"),
    pytest.param({"drafter": "model", "adaptive": True}, id="self-draft-adaptive"),
]


@pytest.mark.parametrize("overrides", SPECULATION)
def test_generation_that_reaches_max_context_stops_cleanly(gen, overrides):
    plain = gen.generate(input_ids=PROMPT, max_new_tokens=100, speculation=False)
    result = gen.generate(input_ids=PROMPT, max_new_tokens=100, **overrides)
    assert result.finish_reason == "length"
    assert f"reached max_context ({MAX_CONTEXT} tokens: prompt {len(PROMPT)} + " in result.message
    assert len(PROMPT) + len(result.token_ids) == MAX_CONTEXT
    assert result.token_ids == plain.token_ids
    streamed = gen.stream(input_ids=PROMPT, max_new_tokens=100, **overrides)
    assert "".join(streamed) == result.text
    assert streamed.result.finish_reason == "length" and streamed.result.token_ids == result.token_ids
