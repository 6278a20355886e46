"""Invariant: the fused-GQA graph is written the way the profile showed it should be, and the tools run it.

- The fused-GQA graph hands GroupQueryAttention the packed q|k|v (no Split), folds each residual
  add into the next RMSNorm (SkipSimplifiedLayerNormalization) and has no Reshape/Unsqueeze
  around attention or the logits; the export validated it against transformers, and the
  profile tool runs it.
- The memory floor counts every initializer a forward streams and none that it only gathers
  from (embeddings, also when reshaped first as GenAI's tied head is, and GQA's rotary caches).
- `specedge info` says whether the recorded step costs were measured on this machine.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, helper

from specedge.bench import opprofile


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


def test_fused_gqa_graph_structure_and_profile(tiny_model, export, tmp_path):
    bundle = export(tiny_model("llama"), attention="gqa")
    from specedge.bundle.manifest import load_manifest

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
    from specedge.bundle.extra import MachineFingerprint

    bundle = bundle_copy(llama_bundle)
    path = bundle / "manifest.json"
    doc = json.loads(path.read_text())
    doc.setdefault("extra", {}).pop("cost_profile", None)
    path.write_text(json.dumps(doc))
    assert "tuning: not tuned" in CliRunner().invoke(main, ["info", str(bundle)]).output
    for machine, expected in ((MachineFingerprint.here(2).to_dict(), "step costs measured on this machine"),
                              ({"cpu": "Some Other CPU 9000", "cores": 64, "threads": 2},
                               "tuned elsewhere (Some Other CPU 9000 (extensions not recorded), 64 cores, "
                               "threads=2)"),
                              # The same model name with other vector extensions is another machine too.
                              ({**MachineFingerprint.here(2).to_dict(), "isa": "some_future_isa"}, "tuned elsewhere (")):
        doc["extra"]["cost_profile"] = {"machine": machine, "target_s": {"1": 0.01, "2": 0.012}}
        path.write_text(json.dumps(doc))
        result = CliRunner().invoke(main, ["info", str(bundle)])
        assert result.exit_code == 0 and expected in result.output
