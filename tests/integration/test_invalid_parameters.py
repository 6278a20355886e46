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
    ({"draft_tokens": -1}, r"draft_tokens must be an integer in \[0, 64\] or None; got -1"),
    ({"draft_tokens": 2.5}, r"draft_tokens must be an integer in \[0, 64\]"),
    ({"draft_tokens": 65}, r"draft_tokens must be an integer in \[0, 64\] or None; got 65"),
    ({"temperature": -1.0}, r"temperature must be a number in \[0, 2\]; got -1.0"),
    ({"temperature": math.nan}, r"temperature must be a number in \[0, 2\]; got nan"),
    ({"temperature": math.inf}, r"temperature must be a number in \[0, 2\]; got inf"),
    ({"temperature": "0.7"}, r"temperature must be a number in \[0, 2\]; got '0.7'"),
    ({"temperature": True}, r"temperature must be a number in \[0, 2\]; got True"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]; got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]; got 1.5"),
    ({"top_p": math.nan}, r"top_p must be a number in \(0, 1\]"),
    ({"top_k": -1}, r"top_k must be an integer in \[0, 1048576\]; got -1"),
    ({"top_k": 1.5}, r"top_k must be an integer in \[0, 1048576\]"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be an integer in \[1, 1048576\]; got 0"),
    ({"max_new_tokens": -5}, r"max_new_tokens must be an integer in \[1, 1048576\]; got -5"),
    ({"max_new_tokens": 1.5}, r"max_new_tokens must be an integer in \[1, 1048576\]; got 1.5"),
    ({"max_new_tokens": True}, r"max_new_tokens must be an integer in \[1, 1048576\]; got True"),
    ({"seed": -1}, r"seed must be an integer in \[0, 9223372036854775807\] or None; got -1"),
    ({"p_min": 1.0}, r"p_min must be a number in \[0, 1\); got 1.0"),
    ({"p_min": "x"}, r"p_min must be a number in \[0, 1\); got 'x'"),
    ({"min_ngram": 3, "max_ngram": 2}, r"n-gram sizes need 1 <= min_ngram <= max_ngram"),
    ({"max_ngram": 10**9}, r"max_ngram must be an integer in \[1, 64\]; got 1000000000"),
    ({"drafter": "oracle"}, r"drafter must be one of none, auto, model, ngram, composite, suffix or None; got 'oracle'"),
    ({"mode": "parallel"}, r"mode must be one of sequential, pipelined, auto; got 'parallel'"),
    # issue 20 item 12: truthy strings and non-bools are not bools
    ({"speculation": "no"}, r"speculation must be true or false \(a bool\); got 'no'"),
    ({"chat": "yes"}, r"chat must be true or false \(a bool\); got 'yes'"),
    ({"adaptive": 1}, r"adaptive must be true or false \(a bool\) or None; got 1"),
    # issue 20 item 8: wrong types are typed errors, not TypeError/AttributeError
    ({"stop": [1]}, r"stop must be a string or a list of non-empty strings; got \[1\]"),
    ({"stop": ["x"] * 17}, r"stop holds 17 strings; at most 16 are allowed"),
    ({"stop": ["\ud800"]}, r"stop holds a string that is not valid text"),
    ({"max_latency_s": 61.0}, r"max_latency_s must be a number in \(0, 60\] or None; got 61.0"),
    ({"draft_window": 3}, r"draft_window must be an integer in \(4, 1048576\] or None; got 3"),
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
    with pytest.raises(InvalidParameterError, match=r"thread counts must be integers in \[0, \d+\] .*got intra_op_threads=-1"):
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
    plain = gen.generate(input_ids=PROMPT, max_new_tokens=100, speculation=False, exact=True)
    result = gen.generate(input_ids=PROMPT, max_new_tokens=100, exact=True, **overrides)
    assert result.finish_reason == "length"
    assert f"reached max_context ({MAX_CONTEXT} tokens: prompt {len(PROMPT)} + " in result.message
    assert len(PROMPT) + len(result.token_ids) == MAX_CONTEXT
    assert result.token_ids == plain.token_ids
    streamed = gen.stream(input_ids=PROMPT, max_new_tokens=100, exact=True, **overrides)
    assert "".join(streamed) == result.text
    assert streamed.result.finish_reason == "length" and streamed.result.token_ids == result.token_ids


BAD_INPUTS = [
    (dict(messages=5), r"messages must be a non-empty list of \{'role': ..., 'content': ...\} objects"),
    (dict(messages=[5]), r"messages\[0\] must be an object with string 'role' and 'content'"),
    (dict(messages=[{"role": "user", "content": 7}]), r"messages\[0\] must be an object with string 'role' and "),
    (dict(messages=[{"role": "user", "content": "hi \ud800"}]), r"messages\[0\].content is not valid Unicode "
                                                                 r"text: surrogates not allowed at character 3"),
    (dict(prompt="caf\udce9", chat=False), r"prompt is not valid Unicode text: surrogates not allowed at "
                                           r"character 3"),
    (dict(prompt=b"bytes"), r"prompt must be a string; got bytes"),
    (dict(input_ids=["a"]), r"input_ids must hold integers \(token ids\); got 'a'"),
    (dict(input_ids=[1.7]), r"input_ids must hold integers \(token ids\); got 1.7"),
    (dict(input_ids=[True]), r"input_ids must hold integers \(token ids\); got True"),
    (dict(input_ids="abc"), r"input_ids must be a list of token ids; got str"),
    (dict(input_ids=[6, 7], config="x"), r"config must be a GenerationConfig; got str"),
]


@pytest.mark.parametrize("kwargs, match", BAD_INPUTS, ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "")
def test_wrong_input_types_are_typed_errors(gen, no_session_runs, kwargs, match):
    """Issue 20 item 8: wrong types give InvalidParameterError (never TypeError/AttributeError)."""
    with pytest.raises(InvalidParameterError, match=match):
        gen.generate(**kwargs)
    with pytest.raises(InvalidParameterError, match=match):
        gen.stream(**kwargs)


@pytest.mark.parametrize("path", [None, 5, b"bundle"])
def test_from_bundle_needs_a_path(path):
    with pytest.raises(InvalidParameterError, match=r"the bundle must be a folder path \(str or Path\); got"):
        Generator.from_bundle(path)


def test_a_huge_max_ngram_is_refused_before_any_index_is_built():
    """Issue 20 item 1: --max-ngram 10**9 grew to 24 GB; the bound refuses it up front (no dict is built)."""
    import tracemalloc

    from specedge.runtime.ngram_drafter import NGramDrafter

    tracemalloc.start()
    try:
        with pytest.raises(InvalidParameterError, match=r"max_ngram must be an integer in \[1, 64\]"):
            NGramDrafter(10**9, 2)
        with pytest.raises(InvalidParameterError, match=r"max_ngram must be an integer in \[1, 64\]"):
            GenerationConfig(max_ngram=10**9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing close to one dict per n


@pytest.mark.parametrize("threads", [-1, 10**6, 2**31, 1.5, True])
def test_thread_counts_are_bounded_by_the_cpu_count(bundle, threads):
    """Issue 20 item 7: --threads 100000 crashed ONNX Runtime, 2**31 gave a pybind TypeError."""
    import os

    with pytest.raises(InvalidParameterError, match=rf"thread counts must be integers in \[0, {os.cpu_count()}\] "
                                                    r"\(0 = ONNX Runtime's default; this machine has"):
        Generator.from_bundle(bundle, threads=threads)
    with pytest.raises(InvalidParameterError, match=r"thread counts must be integers"):
        Generator.from_bundle(bundle, draft_threads=threads)
