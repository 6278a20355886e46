"""Block scales stored at half precision, widened once when a session loads.

ONNX Runtime's ``MatMulNBits`` and ``GatherBlockQuantized`` take their scales in the activations' type,
float32 in our graphs: 32 bits per block, a whole bit per weight at block 32 (an int4 block of 32 then
stores 5.125 bits per weight where llama.cpp's Q4_0 stores 4.5, its scales being fp16). A scale that
float16 holds exactly is therefore written as a float16 initializer behind a ``Cast`` to float32:
ONNX Runtime folds that constant Cast at session start (the basic optimization level, before the
execution providers take the graph), so the kernels read the same float32 values as before, bit for bit
(tests/integration/test_half_scales.py), and a bundle stores and downloads half the scale bytes. With
optimizations off (``EngineOptions(graph_optimization="disable")``) the Cast runs every step instead.

The quantizers choose scales that float16 holds (:func:`to_half`: a block's integers are chosen against
the scale as stored); a scale it does not hold exactly (out of its range, or from ONNX Runtime's own
quantizer, or a product of a GGUF K-quant's two scales) keeps float32 for the whole tensor, so storage
never rounds anything.

Only a MatMulNBits' scales are stored so. A ``GatherBlockQuantized`` lookup's stay float32: the lookup
reads them from the memory-mapped data file page by page, only the rows it gathers, while a folded Cast's
float32 copy is resident whole (+47 MB of peak memory for a 128,256 x 3,072 table, measured). A
MatMulNBits packs its whole scale tensor at load either way, so its folded copy costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .rtn import DataFile

HALF_MAX = float(np.finfo(np.float16).max)  # 65504: a scale above it stays float32
HALF_SUFFIX = "_f16"  # a half initializer's name: the float32 name its Cast produces, plus this


def to_half(scales: np.ndarray, *, up: bool = False) -> np.ndarray:
    """float32 ``scales`` as float16 values where float16 reaches them (unchanged beyond :data:`HALF_MAX`):
    the nearest one, or with ``up`` the nearest not below (a min/max range's step then still spans the
    block's range, so rounding the scale clips nothing)."""
    scales = np.asarray(scales, np.float32)
    with np.errstate(over="ignore"):
        half = scales.astype(np.float16)
        if up:
            half = np.where(half.astype(np.float32) < scales, np.nextafter(half, np.float16(np.inf)), half)
        half = half.astype(np.float32)
    return np.where(np.abs(scales) <= HALF_MAX, half, scales)


def holds_as_half(scales: np.ndarray) -> bool:
    """Whether every value of ``scales`` survives float32 -> float16 -> float32 unchanged."""
    scales = np.asarray(scales, np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(scales.astype(np.float16).astype(np.float32), scales))


@dataclass(frozen=True)
class WrittenScales:
    """Scales written for one weight: ``name`` is the float32 tensor its consumers read (an initializer,
    or the output of ``nodes``' Cast); ``initializers`` and ``nodes`` go into the graph, the nodes before
    any consumer; ``bits``: 16 or 32 stored per scale (0: none, :func:`reshaped`)."""

    name: str
    initializers: tuple
    nodes: tuple
    bits: int


def write_scales(out: "DataFile", name: str, scales: np.ndarray, dims: tuple[int, ...] | None = None,
                 *, half: bool = True) -> WrittenScales:
    """``scales`` (float32, any shape; stored in shape ``dims`` if given) as the float32 tensor ``name``:
    a float16 initializer and a Cast where float16 holds every value and ``half``, else a float32 one."""
    from onnx import TensorProto, helper

    scales = np.ascontiguousarray(scales, np.float32)
    dims = tuple(scales.shape) if dims is None else tuple(dims)
    if half and holds_as_half(scales):
        stored = out.tensor(name + HALF_SUFFIX, TensorProto.FLOAT16, dims, scales.astype(np.float16))
        cast = helper.make_node("Cast", [stored.name], [name], name=f"{name}_widen", to=TensorProto.FLOAT)
        return WrittenScales(name, (stored,), (cast,), 16)
    return WrittenScales(name, (out.tensor(name, TensorProto.FLOAT, dims, scales),), (), 32)


def reshaped(source: str, name: str, dims: tuple[int, ...], out: "DataFile") -> WrittenScales:
    """The float32 scales ``source`` again as the tensor ``name`` of shape ``dims``, by a Reshape (folded at
    load like the Cast; ``bits`` 0: it stores none). MatMulNBits wants a tied head's scales [vocab, K/block]
    and GatherBlockQuantized [vocab, K/block, 1], and neither takes the other's shape: the lookup's are stored
    and the head reads them reshaped."""
    from onnx import TensorProto, helper

    shape = out.tensor(f"{name}_shape", TensorProto.INT64, (len(dims),), np.array(dims, np.int64))
    node = helper.make_node("Reshape", [source, shape.name], [name], name=f"{name}_reshape")
    return WrittenScales(name, (shape,), (node,), 0)


def read_scales(graph, name: str, folder: Path) -> np.ndarray:
    """The float32 values of the tensor ``name`` a MatMulNBits or GatherBlockQuantized reads as its scales:
    an initializer, or one reached through the Cast and Reshape nodes :func:`write_scales` and
    :func:`reshaped` add."""
    from onnx import numpy_helper

    from .rtn import _read

    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    shape_of: tuple[int, ...] | None = None
    while name not in inits:
        node = producers.get(name)
        if node is None or node.op_type not in ("Cast", "Reshape"):
            raise ValueError(f"scales {name!r} are neither an initializer nor a Cast or Reshape of one")
        if node.op_type == "Reshape" and shape_of is None:
            shape_of = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[1]]))
        name = node.input[0]
    values = _read(inits[name], folder).astype(np.float32)
    return values if shape_of is None else values.reshape(shape_of)
