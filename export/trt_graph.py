"""The TensorRT variant of a bundle graph: the logits row count read from a shape, not a value.

As exported, ``num_logits_to_keep`` is int64 ``[1]`` whose *value* feeds the Slice
that keeps the last rows. TensorRT must know that value to compute the output's
shape, so it treats the input as a shape tensor, read on the host. ORT's TensorRT
EP places inputs on the device, so every run copies that one number back to the
host and synchronises the stream before enqueueing (and a graph capture cannot
contain that read).

:func:`logits_rows_from_shape` rewrites the graph so that ``num_logits_to_keep`` is
int64 ``[num_logits]`` whose *length* is the row count (its values are never read):
one ``Shape`` node turns it back into the ``[1]`` tensor the rest of the graph
consumed. TensorRT then knows the row count from the input's dims, set with the
other shapes, and nothing is read back. Weights stay in the original external
data file: the rewritten graph is written next to it and names the same file.

The runtime engines learn which form a TensorRT engine takes from its record
(``EngineRecord.graph`` is set for rewritten graphs) or, natively, from
``ICudaEngine.is_shape_inference_io``. CPU and CUDA EP sessions keep the
original graph.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ExportError
from ..bundle.manifest import ModelIO

COUNT_SUFFIX = "__count"  # the internal [1] tensor the rewrite feeds to the original consumers


def trt_graph_path(graph: Path) -> Path:
    """``target/model.onnx`` -> ``target/model.trt.onnx`` (same folder, so external data paths still hold)."""
    return graph.with_name(graph.stem + ".trt" + graph.suffix)


def logits_rows_from_shape(graph: Path, out: Path, input_name: str = ModelIO.num_logits) -> Path:
    """Write ``graph`` with ``input_name`` taking its row count from its length; return ``out``.

    ``out`` must be in ``graph``'s folder (the external data file is shared, not copied).
    Raises ExportError when the graph has no such int64 [1] input.
    """
    import onnx
    from onnx import TensorProto, helper

    graph, out = Path(graph), Path(out)
    if out.parent.resolve() != graph.parent.resolve():
        raise ExportError(f"the rewritten graph must sit next to {graph.name}, whose weights it shares")
    model = onnx.load(str(graph), load_external_data=False)  # the graph only: weights stay where they are
    inputs = {i.name: i for i in model.graph.input}
    original = inputs.get(input_name)
    dims = [] if original is None else [d.dim_value or d.dim_param for d in original.type.tensor_type.shape.dim]
    if original is None or original.type.tensor_type.elem_type != TensorProto.INT64 or dims != [1]:
        raise ExportError(f"{graph.name} has no int64 [1] input {input_name!r} to rewrite (already rewritten?)")
    count = input_name + COUNT_SUFFIX
    for node in model.graph.node:
        node.input[:] = [count if name == input_name else name for name in node.input]
    model.graph.node.insert(0, helper.make_node("Shape", [input_name], [count], name="logits_rows_from_shape"))
    original.type.tensor_type.shape.dim[0].Clear()
    original.type.tensor_type.shape.dim[0].dim_param = "num_logits"
    partial = out.with_name(out.name + ".partial")
    onnx.save(model, str(partial))  # tensors without loaded data keep their external-data references
    partial.replace(out)
    return out
