"""Invariant: the per-op profiler and the prefill bench measure what they say, on both graph kinds.

- A profiler trace is split into runs by the session's model_run events; node times land in the
  run that holds them, summed per op type; nothing outside a run is counted.
- The memory floor counts every initializer a forward streams and none that it only gathers
  from (embeddings, also when reshaped first as GenAI's tied head is, and GQA's rotary caches).
- The fused-GQA graph hands GroupQueryAttention the packed q|k|v (no Split), folds each residual
  add into the next RMSNorm (SkipSimplifiedLayerNormalization) and has no Reshape/Unsqueeze
  around attention or the logits; its bundle still validates against transformers (the export
  itself checks that) and the profile tool runs it.
- Bad --graph values are refused with a typed error.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

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


def _graph_with(tmp_path, nodes, inits, inputs, outputs):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path))
    return path


def test_streamed_bytes_skip_gathered_tables(tmp_path):
    f32 = TensorProto.FLOAT
    inits = [helper.make_tensor("embed", f32, [10, 4], np.zeros(40, np.float32)),  # gathered: not streamed
             helper.make_tensor("head", f32, [4, 6], np.zeros(24, np.float32)),  # MatMul: streamed
             helper.make_tensor("tied", f32, [6, 4], np.zeros(24, np.float32)),  # reshaped then gathered
             helper.make_tensor("shape", TensorProto.INT64, [2], [6, 4]),  # feeds the Reshape: streamed
             helper.make_tensor("unused", f32, [100], np.zeros(100, np.float32))]  # read by nothing
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["x"]),
             helper.make_node("Reshape", ["tied", "shape"], ["tied_r"]),
             helper.make_node("Gather", ["tied_r", "ids"], ["y"]),
             helper.make_node("Add", ["x", "y"], ["xy"]),
             helper.make_node("MatMul", ["xy", "head"], ["out"])]
    path = _graph_with(tmp_path, nodes, inits, [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                       [helper.make_tensor_value_info("out", f32, [3, 6])])
    assert opprofile.streamed_weight_bytes(path) == 24 * 4 + 2 * 8


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


def test_fused_gqa_graph_structure_and_profile(tiny_model, export, tmp_path):
    bundle = export(tiny_model("llama"), attention="gqa")
    from specedge.manifest import load_manifest

    graph = onnx.load(str(bundle / load_manifest(bundle).target.graph), load_external_data=False).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    layers = sum(1 for n in graph.node if n.op_type == "GroupQueryAttention")
    assert ops["Split"] == layers  # only the MLP's gate|up split; q|k|v goes to GQA packed
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * layers  # every residual add but none left over
    assert ops["Add"] == 1 and ops["Unsqueeze"] == 0  # the one Add: epsilon in the first, unfused RMSNorm
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            assert list(node.input[1:3]) == ["", ""]
    doc = opprofile.profile({"ours": bundle}, threads=(1,), context=8, prefill=(16,), reps=2, prefill_reps=1,
                            rounds=1, capacity=32)
    step = doc["profiles"]["1"]["step1"]["ours"]
    assert step["runs"] == 2 and "GroupQueryAttention" in step["op_ms"] and step["model_run_ms"] > 0
    assert doc["graphs"]["ours"]["streamed_weight_mb"] > 0


def test_info_says_where_step_costs_were_measured(llama_bundle, bundle_copy):
    import json

    from click.testing import CliRunner

    from specedge.cli.main import main
    from specedge.runtime.profile import machine_fingerprint

    bundle = bundle_copy(llama_bundle)
    path = bundle / "manifest.json"
    doc = json.loads(path.read_text())
    doc.setdefault("extra", {}).pop("cost_profile", None)
    path.write_text(json.dumps(doc))
    assert "tuning: not tuned" in CliRunner().invoke(main, ["info", str(bundle)]).output
    for machine, expected in ((machine_fingerprint(2), "step costs measured on this machine"),
                              ({"cpu": "Some Other CPU 9000", "cores": 64, "threads": 2},
                               "tuned elsewhere (Some Other CPU 9000, 64 cores, threads=2)")):
        doc["extra"]["cost_profile"] = {"machine": machine, "target_s": {"1": 0.01, "2": 0.012}}
        path.write_text(json.dumps(doc))
        result = CliRunner().invoke(main, ["info", str(bundle)])
        assert result.exit_code == 0 and expected in result.output
