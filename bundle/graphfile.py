"""What an ONNX graph file references, read straight from its protobuf bytes.

The integrity check must know every file a graph makes ONNX Runtime open (its
tensors' ``external_data`` locations) *before* a session is created, and it runs in the
edge install, which has neither the ``onnx`` package (export-only) nor compiled ONNX
protobuf classes. ONNX's wire format is plain protobuf, and the few fields needed here
sit at fixed, long-stable field numbers of onnx.proto (IR version 3 onwards), so a
small schema-guided reader is sound: it visits *every* place a TensorProto can live
(graph initializers, sparse initializers, node attributes ``t``/``tensors``/
``sparse_tensor(s)``, subgraphs ``g``/``graphs`` of If/Loop/Scan at any depth, model-local
functions and training graphs) and skips all other fields by their declared length,
never decoding weights. A malformed file is refused with ModelLoadError.

onnx.proto field numbers used (https://github.com/onnx/onnx/blob/main/onnx/onnx.proto):

* ModelProto: graph 7, training_info 20, functions 25
* TrainingInfoProto: initialization 1, algorithm 2 (GraphProto)
* FunctionProto: node 7
* GraphProto: node 1, initializer 5, sparse_initializer 15
* NodeProto: attribute 5
* AttributeProto: t 5, g 6, tensors 10, graphs 11, sparse_tensor 22, sparse_tensors 23
* SparseTensorProto: values 1, indices 2
* TensorProto: dims 1, name 8, external_data 13 (StringStringEntryProto: key 1, value 2),
  data_location 14 (1 = EXTERNAL)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelLoadError

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# Subgraphs nest through control-flow nodes; real models nest a handful deep. A bound keeps
# a hostile file from exhausting the stack.
_MAX_DEPTH = 64

# field numbers -> what they hold, per message type
_MODEL = {7: "graph", 20: "training", 25: "function"}
_TRAINING = {1: "graph", 2: "graph"}
_FUNCTION = {7: "node"}
_GRAPH = {1: "node", 5: "tensor", 15: "sparse"}
_NODE = {5: "attribute"}
_ATTRIBUTE = {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"}
_SPARSE = {1: "tensor", 2: "tensor"}


@dataclass
class GraphFacts:
    """What the integrity check needs from one graph file."""

    external_locations: set[str] = field(default_factory=set)  # every external_data "location", as written
    initializer_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # top-level graph only


class _Reader:
    def __init__(self, data: memoryview, name: str) -> None:
        self.data = data
        self.name = name

    def bad(self, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.name} is not a valid ONNX file ({why}); the file is truncated or corrupt; "
                              "re-export the bundle")

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise self.bad("a varint runs past its message")
            byte = self.data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result, pos
            shift += 7

    def fields(self, start: int, end: int):
        """Yield (field_number, wire_type, value_start, value_end_or_int) over one message."""
        pos = start
        while pos < end:
            key, pos = self.varint(pos, end)
            number, wire = key >> 3, key & 7
            if wire == _VARINT:
                value, pos = self.varint(pos, end)
                yield number, wire, value, value
            elif wire == _LEN:
                length, pos = self.varint(pos, end)
                if pos + length > end:
                    raise self.bad("a field runs past its message")
                yield number, wire, pos, pos + length
                pos += length
            elif wire in (_I64, _I32):
                pos += 8 if wire == _I64 else 4
                if pos > end:
                    raise self.bad("a fixed-size field runs past its message")
            else:  # groups (3, 4) are not used by onnx.proto
                raise self.bad(f"unexpected wire type {wire}")

    def text(self, start: int, end: int) -> str:
        try:
            return bytes(self.data[start:end]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad("a name is not UTF-8") from None


def read_graph_facts(path: Path) -> GraphFacts:
    """External-data locations of every tensor in the graph file, and the top-level initializers' dims."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"cannot read graph {Path(path).name}: {exc.strerror}") from None
    reader = _Reader(memoryview(raw), Path(path).name)
    facts = GraphFacts()

    def tensor(start: int, end: int, top: bool) -> None:
        name, dims, location, external = "", [], None, False
        for number, wire, a, b in reader.fields(start, end):
            if number == 1:  # dims: packed (LEN) or one varint per element
                if wire == _LEN:
                    pos = a
                    while pos < b:
                        dim, pos = reader.varint(pos, b)
                        dims.append(dim)
                elif wire == _VARINT:
                    dims.append(a)
            elif number == 8 and wire == _LEN:
                name = reader.text(a, b)
            elif number == 14 and wire == _VARINT:
                external = a == 1
            elif number == 13 and wire == _LEN:
                key = value = None
                for n2, w2, a2, b2 in reader.fields(a, b):
                    if w2 == _LEN and n2 in (1, 2):
                        if n2 == 1:
                            key = reader.text(a2, b2)
                        else:
                            value = reader.text(a2, b2)
                if key == "location":
                    location = value
        if external or location is not None:
            if not location:
                raise reader.bad(f"tensor {name!r} is stored externally but names no location")
            facts.external_locations.add(location)
        if top and name:
            facts.initializer_dims[name] = tuple(dims)

    def message(kind: dict, start: int, end: int, depth: int, top: bool = False) -> None:
        if depth > _MAX_DEPTH:
            raise reader.bad(f"subgraphs nest deeper than {_MAX_DEPTH}")
        for number, wire, a, b in reader.fields(start, end):
            what = kind.get(number)
            if what is None or wire != _LEN:
                continue
            if what == "tensor":
                tensor(a, b, top and kind is _GRAPH)
            elif what == "sparse":
                message(_SPARSE, a, b, depth + 1)
            elif what == "graph":
                message(_GRAPH, a, b, depth + 1, top=top and kind is _MODEL)
            elif what == "node":
                message(_NODE, a, b, depth + 1)
            elif what == "attribute":
                message(_ATTRIBUTE, a, b, depth + 1)
            elif what == "training":
                message(_TRAINING, a, b, depth + 1)
            elif what == "function":
                message(_FUNCTION, a, b, depth + 1)

    message(_MODEL, 0, len(raw), 0, top=True)
    return facts
