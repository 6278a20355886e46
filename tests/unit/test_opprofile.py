"""Invariant: the per-op profiler and the prefill bench measure what they say (torch-free parts).

- A profiler trace is split into runs by the session's model_run events; node times land in the
  run that holds them, summed per op type; nothing outside a run is counted.
- Bad --graph values are refused with a typed error.
"""

from __future__ import annotations

import pytest

from specedge.bench import opprofile
from specedge.errors import InvalidParameterError


def _event(cat: str, name: str, ts: float, dur: float, op: str | None = None) -> dict:
    event = {"cat": cat, "name": name, "ts": ts, "dur": dur}
    if op:
        event["args"] = {"op_name": op}
    return event


def test_trace_is_split_per_run_and_summed_per_op_type():
    trace = [
        _event("Session", "model_run", 100, 50),
        _event("Node", "mm1_kernel_time", 110, 10, "MatMulNBits"),
        _event("Node", "mm2_kernel_time", 125, 5, "MatMulNBits"),
        _event("Node", "gqa_kernel_time", 131, 4, "GroupQueryAttention"),
        _event("Node", "mm1_fence_before", 109, 1, "MatMulNBits"),  # not a kernel time: ignored
        _event("Session", "model_run", 300, 20),
        _event("Node", "mm1_kernel_time", 305, 7, "MatMulNBits"),
        _event("Node", "stray_kernel_time", 250, 3, "Add"),  # between runs: in none
    ]
    runs = opprofile.per_run_ops(trace)
    assert runs == [{"model_run": 0.05, "MatMulNBits": 0.015, "GroupQueryAttention": 0.004},
                    {"model_run": 0.02, "MatMulNBits": 0.007}]


def test_graph_kind_refuses_other_folders(tmp_path):
    with pytest.raises(InvalidParameterError, match="neither a specedge bundle"):
        opprofile.graph_kind(tmp_path)


def test_graph_option_labels_must_be_distinct():
    from specedge.cli.bench import _graph_options

    assert list(_graph_options(("a=/x", "/y/b"))) == ["a", "b"]
    with pytest.raises(InvalidParameterError, match="distinct"):
        _graph_options(("a=/x", "a=/y"))


def test_profile_needs_a_graph():
    with pytest.raises(InvalidParameterError, match="at least one --graph"):
        opprofile.profile({})


def test_prefill_render_gives_ratios():
    from specedge.bench.prefill import render

    doc = {"lengths": [128], "runtimes": {"specedge": {}, "genai": {}}, "notes": ["llamacpp skipped: x"],
           "cells": {"specedge": {"128": {"tokens_per_s": 300.0}}, "genai": {"128": {"tokens_per_s": 200.0}}}}
    text = render(doc)
    assert "| 128 | 300 | 200 | 1.50x |" in text and "llamacpp skipped" in text
