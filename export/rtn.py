"""Round-to-nearest weight-only quantization of a graph, one initializer at a time.

ONNX Runtime's ``MatMulNBitsQuantizer`` takes a whole ``ModelProto``: the fp32 graph is read
into memory (every weight, the size of the model in fp32), the quantized weights are added
beside it, and ``onnx.save_model`` serialises them once more. This module produces the same
graph with bounded memory: the graph is read without its external data, and each weight is
read from the data file, quantized by the quantizer's own block routines
(``DefaultWeightOnlyQuantizer.qbits_block_quant`` for MatMul, ``quantize_ndarray`` for the
embedding's Gather, in row chunks), and written straight to the new data file before the next
one is read. Peak memory is then about one fp32 weight plus its quantized form.

The rewrite is the quantizer's own (QOperator format, axis 0 blocks for MatMul, axis 1 for
Gather): the same initializer names (``W_Q4``, ``W_scales``), node names, attributes, opset
(21, IR 10, when the embedding's Gather takes int4) and bytes, so a graph quantized here equals
one quantized by ONNX Runtime tensor for tensor (tests/integration/test_streaming_quantize.py),
with one deliberate difference: only the token embedding's Gather is quantized. ONNX Runtime's
quantizer takes every Gather over a constant table, so in a standard-attention or GPT-2 graph it
would round the rotary cos/sin caches and the learned position table too; those stay float here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

import numpy as np

from .mixquant import EMBEDDING_TABLE
from .scales import reshaped, write_scales

if TYPE_CHECKING:
    from .mixquant import Plan, TensorQuant

_EXTERNAL_THRESHOLD = 1024  # tensors above this many bytes go to the data file (as export/graph.py)
_ALIGN = 64  # data offsets SIMD-aligned, as export/graph.py writes them
_GATHER_ROWS = 8192  # embedding rows quantized at once (8192 x 4096 fp32 = 128 MiB)
_COPY_CHUNK = 64 << 20
_HEAD = "lm_head"  # the output layer's MatMul weight in our graphs (export/graph.py)


class DataFile:
    """Appends tensors to one external data file; returns TensorProtos that point into it."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        """``append``: add to an existing file (its tensors keep their offsets) instead of starting one."""
        self.path = path
        self.file: BinaryIO = open(path, "ab" if append else "wb")
        self.offset = self.file.tell() if append else 0

    def align(self) -> None:
        """Pad the file to the next ``_ALIGN`` boundary (where the next tensor's data starts)."""
        pad = (-self.offset) % _ALIGN
        self.file.write(b"\0" * pad)
        self.offset += pad

    def tensor(self, name: str, data_type: int, dims, raw: bytes | memoryview | np.ndarray):
        from onnx import TensorProto

        raw = memoryview(np.ascontiguousarray(raw)).cast("B") if isinstance(raw, np.ndarray) else memoryview(raw)
        tensor = TensorProto(name=name, data_type=data_type, dims=list(dims))
        if len(raw) <= _EXTERNAL_THRESHOLD:
            tensor.raw_data = bytes(raw)
            return tensor
        self.align()
        self.file.write(raw)
        _point(tensor, self.path.name, self.offset, len(raw))
        self.offset += len(raw)
        return tensor

    def copy(self, tensor, src_dir: Path):
        """``tensor`` (inline or external in ``src_dir``) re-homed into this file, copied in chunks."""
        from onnx import TensorProto

        if tensor.data_location != TensorProto.EXTERNAL:
            return tensor
        info = {e.key: e.value for e in tensor.external_data}
        length, start = int(info["length"]), int(info.get("offset", 0))
        out = TensorProto()
        out.CopyFrom(tensor)
        del out.external_data[:]
        self.align()
        with open(src_dir / info["location"], "rb") as f:
            f.seek(start)
            left = length
            while left:
                block = f.read(min(left, _COPY_CHUNK))
                if not block:
                    raise OSError(f"external data of {tensor.name} ends early")
                self.file.write(block)
                left -= len(block)
        _point(out, self.path.name, self.offset, length)
        self.offset += length
        return out

    def close(self) -> None:
        self.file.close()


def _point(tensor, location: str, offset: int, length: int) -> None:
    from onnx import TensorProto

    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _read(tensor, src_dir: Path, rows: slice | None = None) -> np.ndarray:
    """A float initializer as a numpy array, read from its external file (only ``rows`` of it, if given)."""
    from onnx import TensorProto, helper, numpy_helper

    if tensor.data_location != TensorProto.EXTERNAL:
        array = numpy_helper.to_array(tensor)
        return array if rows is None else array[rows]
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    info = {e.key: e.value for e in tensor.external_data}
    dims = tuple(tensor.dims)
    row = int(np.prod(dims[1:])) if len(dims) > 1 else 1
    start, stop = (0, dims[0]) if rows is None else (rows.start, min(rows.stop, dims[0]))
    offset = int(info.get("offset", 0)) + start * row * dtype.itemsize
    array = np.fromfile(src_dir / info["location"], dtype=dtype, count=(stop - start) * row, offset=offset)
    return array.reshape((stop - start, *dims[1:]))


def quantize_streaming(src: Path, dst: Path, *, bits: int, block_size: int, symmetric: bool, accuracy_level: int,
                       quantize_embeddings: bool, plan: "Plan | None" = None,
                       chosen: "dict[str, tuple[TensorQuant, int, str, int]] | None" = None, tied: bool = False,
                       importance: "dict[str, np.ndarray] | None" = None,
                       progress: "Callable[[int, int], None] | None" = None) -> list[Path]:
    """Quantize ``src`` (an fp32 graph with external data) into ``dst`` + ``dst.data``; return the files.

    MatMul nodes with a constant 2-D weight become MatMulNBits at ``bits``; with ``quantize_embeddings``
    and 4 bits, the token embedding's Gather becomes GatherBlockQuantized (ORT quantizes Gather at 4 bits
    only). Everything else is copied unchanged.

    With ``plan`` (export/mixquant.py: weight name -> form), each MatMul weight and, with
    ``quantize_embeddings``, the embedding table take the plan's form instead (``bits``, ``block_size``
    and ``symmetric`` are then unused); with ``tied`` too (the source's output layer is its embedding), a
    plan that gives both the same form writes their integers once (:class:`_TiedTable`). ``importance``:
    weight name -> [K] activation importance (export/importance.py) for the plan's ``weighted`` forms; a
    weighted form without one is searched unweighted (and recorded so). ``chosen`` (if
    given) receives weight name -> (form, element count, the weight whose integers it reads or "", bits stored
    per scale: 16, 32 or 0, export/scales.py); ``progress(done, total)`` (if given) is told after each weight
    quantized.
    """
    chosen = {} if chosen is None else chosen
    if plan is not None:
        from .mixquant import quantize

        def planned_matmul(name: str, b: np.ndarray):
            form = plan(name)
            weights = None if importance is None else importance.get(name)
            if form.weighted and weights is None:
                form = replace(form, weighted=False, gptq=False)
            blocks = quantize(np.ascontiguousarray(b.T), form, weights if form.weighted else None)
            return form, blocks.packed(), blocks.scales, None if form.symmetric else blocks.packed_zero_points()

        def planned_gather(node, table, out: DataFile, new_inits: dict):
            return _planned_gather(node, table, plan(table.name), src.parent, out, new_inits)

        share = tied and quantize_embeddings and plan(_HEAD) == plan(EMBEDDING_TABLE)
        return _rewrite(src, dst, matmul=planned_matmul, gather=planned_gather if quantize_embeddings else None,
                        accuracy_level=accuracy_level, chosen=chosen, int4_tensors=False,
                        tied_form=plan(_HEAD) if share else None, progress=progress)

    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    gather = quantize_embeddings and bits == 4
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                          accuracy_level=accuracy_level, bits=bits,
                                          op_types_to_quantize=("MatMul", "Gather") if gather else ("MatMul",),
                                          quant_axes=(("MatMul", 0), ("Gather", 1)))
    quantizer = DefaultWeightOnlyQuantizer(config)
    form = _legacy_form(bits, block_size, symmetric)

    def ort_matmul(_name: str, b: np.ndarray):
        packed, scales, zero_points = quantizer.qbits_block_quant(b)
        return form, packed, scales, None if symmetric else zero_points

    def ort_gather(node, table, out: DataFile, new_inits: dict):
        nodes, scale_bits = _quantize_gather(node, table, src.parent, out, new_inits, block_size, symmetric)
        return nodes, form, scale_bits

    # int4 tensors (the Gather's) need opset 21 and IR 10, as ORT's quantizer sets them
    return _rewrite(src, dst, matmul=ort_matmul, gather=ort_gather if gather else None,
                    accuracy_level=accuracy_level, chosen=chosen, int4_tensors=gather, progress=progress)


def _rewrite(src: Path, dst: Path, *, matmul, gather, accuracy_level: int, chosen: dict,
             int4_tensors: bool, tied_form: "TensorQuant | None" = None,
             progress: "Callable[[int, int], None] | None" = None) -> list[Path]:
    """The one graph rewrite both quantizers share, one weight at a time.

    ``matmul(name, B [K, N] float32)`` -> (form, B packed [N, K/block, block*bits/8] uint8, scales [N, K/block],
    zero points in MatMulNBits' uint8 layout or None): each MatMul over a constant 2-D weight becomes
    MatMulNBits. ``gather(node, table, out, new_inits)`` -> (nodes ending in the GatherBlockQuantized, form,
    bits per stored scale), or None to keep the embedding float. ``tied_form``: the form of a tied output
    layer and embedding, written once (:class:`_TiedTable`) where the graph allows it. ``chosen`` receives
    weight name -> (form, element count, the weight whose integers it reads or "", bits per stored scale);
    ``progress(done, total)`` is told after each weight.
    """
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    src_dir = src.parent
    inits = {t.name: t for t in graph.initializer}
    data_path = dst.with_name(dst.name + ".data")
    out = DataFile(data_path)
    new_inits: dict[str, TensorProto] = {}
    new_nodes = []

    def is_weighted_matmul(node) -> bool:
        return node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2

    total = sum(is_weighted_matmul(n) or (gather is not None and _is_embedding_lookup(n, inits)) for n in graph.node)
    done = 0
    try:
        tied = None if tied_form is None or gather is None else _TiedTable.of(graph, inits, tied_form, src_dir, out,
                                                                               new_inits)
        for node in graph.node:
            if tied is not None and is_weighted_matmul(node) and node.input[1] == _HEAD:
                new_nodes.extend(tied.head_nodes(node, accuracy_level))
                chosen[_HEAD] = (tied.form, int(np.prod(inits[_HEAD].dims)), EMBEDDING_TABLE, 0)  # embed's scales
            elif tied is not None and _is_embedding_lookup(node, inits):
                new_nodes.extend(tied.gather_nodes(node))
                chosen[EMBEDDING_TABLE] = (tied.form, int(np.prod(inits[EMBEDDING_TABLE].dims)), "", tied.scale_bits)
            elif is_weighted_matmul(node):
                weight = inits[node.input[1]]
                b = _read(weight, src_dir)
                rows, cols = b.shape
                form, packed, scales, zero_points = matmul(weight.name, b)
                del b
                q = out.tensor(f"{weight.name}_Q{form.bits}", TensorProto.UINT8, packed.shape, packed)
                s = write_scales(out, f"{weight.name}_scales", scales)
                inputs = [node.input[0], q.name, s.name]
                new_inits.update({t.name: t for t in (q, *s.initializers)})
                new_nodes.extend(s.nodes)
                chosen[weight.name] = (form, rows * cols, "", s.bits)
                if zero_points is not None:
                    zp = out.tensor(f"{weight.name}_zero_points", TensorProto.UINT8, zero_points.shape, zero_points)
                    inputs.append(zp.name)
                    new_inits[zp.name] = zp
                attrs = dict(K=rows, N=cols, bits=form.bits, block_size=form.block)
                if accuracy_level:
                    attrs["accuracy_level"] = accuracy_level
                new_nodes.append(helper.make_node("MatMulNBits", inputs, [node.output[0]],
                                                  name=f"{node.name}_Q{form.bits}" if node.name else "",
                                                  domain="com.microsoft", **attrs))
            elif gather is not None and _is_embedding_lookup(node, inits):
                table = inits[node.input[0]]
                nodes, form, scale_bits = gather(node, table, out, new_inits)
                chosen[table.name] = (form, int(np.prod(table.dims)), "", scale_bits)
                new_nodes.extend(nodes)
            else:
                new_nodes.append(node)
                continue
            done += 1
            if progress is not None:
                progress(done, total)
        used = {name for n in new_nodes for name in n.input}
        kept = [out.copy(t, src_dir) if t.name not in new_inits else t for t in graph.initializer if t.name in used]
        kept += [t for name, t in new_inits.items() if name in used]
    finally:
        out.close()
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    if int4_tensors:
        for opset in model.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version < 21:
                opset.version = 21
        model.ir_version = max(model.ir_version, 10)
    onnx.save_model(model, str(dst))
    if data_path.stat().st_size == 0:
        os.unlink(data_path)
    return [dst] + ([data_path] if data_path.exists() else [])


@dataclass(frozen=True)
class _TiedNames:
    """The initializers of a :class:`_TiedTable`: the integers [vocab, K/block, block*bits/8]; the scales
    and (8-bit asymmetric only) zero points in MatMulNBits' [vocab, K/block] and GatherBlockQuantized's
    [vocab, K/block, 1] shapes; and the nodes that make the scales (export/scales.py), which go in before the
    first consumer."""

    data: str
    head_scales: str
    gather_scales: str
    head_zero_points: str | None = None
    gather_zero_points: str | None = None
    scale_nodes: tuple = ()
    scale_bits: int = 32


class _TiedTable:
    """A tied model's embedding and output layer quantized once (the untied fp32 graph holds the table twice).

    The integers are one [vocab, K/block, block*bits/8] uint8 initializer: MatMulNBits reads it as the head's
    B, and GatherBlockQuantized gathers it along its last axis (``quantize_axis=2``), followed by a Reshape
    of [*ids, K/block, block] rows to [*ids, K]. MatMulNBits wants the scales [vocab, K/block] and
    GatherBlockQuantized [vocab, K/block, 1], and ONNX Runtime refuses either in the other's shape: the scales
    are stored once, float32 in the lookup's shape, and reshaped for the head (folded at load,
    export/scales.py); the 8-bit zero points are written twice. The integers are laid out as a GGUF's tied
    head's are (export/gguf_import.py).
    """

    def __init__(self, table, form: "TensorQuant", id_rank: int, src_dir: Path, out: DataFile, new_inits: dict):
        self.table, self.form, self.id_rank = table, form, id_rank
        self.src_dir, self.out, self.new_inits = src_dir, out, new_inits
        self.names: _TiedNames | None = None

    @classmethod
    def of(cls, graph, inits: dict, form: "TensorQuant", src_dir: Path, out: DataFile,
           new_inits: dict) -> "_TiedTable | None":
        """The shared table, or None where the graph cannot share it: no [vocab, K] table gathered along axis 0
        from a graph input (the Reshape needs the ids' rank), a head that is not the table transposed, a width
        off the block (a lookup cannot pad), or 4-bit zero points (GatherBlockQuantized packs them along the
        gathered block axis, MatMulNBits along K/block: two layouts of one nibble stream)."""
        from onnx import helper

        table, head = inits.get(EMBEDDING_TABLE), inits.get(_HEAD)
        if table is None or head is None or len(table.dims) != 2 or tuple(head.dims) != tuple(table.dims)[::-1]:
            return None
        if table.dims[1] % form.block or (not form.symmetric and form.bits != 8):
            return None
        lookups = [n for n in graph.node if _is_embedding_lookup(n, inits)]
        ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in graph.input}
        if len(lookups) != 1 or lookups[0].input[1] not in ranks or any(
                a.name == "axis" and helper.get_attribute_value(a) != 0 for a in lookups[0].attribute):
            return None
        lm_head = _read(head, src_dir)  # one fp32 weight, as the unshared head would read it
        for start in range(0, table.dims[0], _GATHER_ROWS):
            if not np.array_equal(_read(table, src_dir, slice(start, start + _GATHER_ROWS)),
                                  lm_head[:, start:start + _GATHER_ROWS].T):
                return None
        return cls(table, form, ranks[lookups[0].input[1]], src_dir, out, new_inits)

    def _written(self) -> "_TiedNames":
        """The shared initializers' names, written on first use."""
        from onnx import TensorProto

        from .mixquant import quantize

        if self.names is not None:
            return self.names
        out, form = self.out, self.form
        vocab, width = self.table.dims
        out.align()
        start, scales, zero_points = out.offset, [], []
        for row in range(0, vocab, _GATHER_ROWS):
            blocks = quantize(_read(self.table, self.src_dir, slice(row, row + _GATHER_ROWS)), form)
            packed = blocks.packed()
            out.file.write(packed.tobytes())
            out.offset += packed.nbytes
            scales.append(blocks.scales)
            zero_points.append(blocks.zero_points)
        data = TensorProto(name=f"{EMBEDDING_TABLE}_Q{form.bits}", data_type=TensorProto.UINT8,
                           dims=[vocab, width // form.block, form.block * form.bits // 8])
        _point(data, out.path.name, start, out.offset - start)
        s = np.concatenate(scales)
        # one float32 copy, in the lookup's shape: the lookup reads it from the file page by page (only the rows
        # it gathers), and the head's Reshape of it is folded at load into what the head packs anyway
        # (export/scales.py says why a lookup's scales are not stored as float16)
        gather_scales = write_scales(out, f"{EMBEDDING_TABLE}_scales", s, (*s.shape, 1), half=False)
        head_scales = reshaped(gather_scales.name, f"{_HEAD}_scales", s.shape, out)
        inits = [data, *gather_scales.initializers, *head_scales.initializers]
        zero_point_names: tuple[str, ...] = ()
        if not form.symmetric:  # 8-bit here (``of`` refuses 4-bit zero points): one byte a block in either layout
            z = np.concatenate(zero_points)
            zps = [out.tensor(f"{_HEAD}_zero_points", TensorProto.UINT8, z.shape, z),
                   out.tensor(f"{EMBEDDING_TABLE}_zero_points", TensorProto.UINT8, (*z.shape, 1), z)]
            inits += zps
            zero_point_names = tuple(t.name for t in zps)
        self.new_inits.update({t.name: t for t in inits})
        self.names = _TiedNames(data.name, head_scales.name, gather_scales.name, *zero_point_names,
                                scale_nodes=head_scales.nodes, scale_bits=gather_scales.bits)
        return self.names

    @property
    def scale_bits(self) -> int:
        """Bits stored per scale (after the first of :meth:`head_nodes` / :meth:`gather_nodes`)."""
        return self._written().scale_bits

    def _scale_nodes(self) -> list:
        """The nodes that make the scales, the first time they are asked for (they precede both consumers)."""
        first = self.names is None
        return list(self._written().scale_nodes) if first else []

    def head_nodes(self, node, accuracy_level: int) -> list:
        """The output layer's MatMulNBits over the shared integers (after the scales' nodes, on first use)."""
        from onnx import helper

        scale_nodes = self._scale_nodes()
        names = self._written()
        vocab, width = self.table.dims
        attrs = dict(K=width, N=vocab, bits=self.form.bits, block_size=self.form.block)
        if accuracy_level:
            attrs["accuracy_level"] = accuracy_level
        zero_points = [names.head_zero_points] if names.head_zero_points else []
        return scale_nodes + [helper.make_node(
            "MatMulNBits", [node.input[0], names.data, names.head_scales] + zero_points, [node.output[0]],
            name=f"{node.name}_Q{self.form.bits}" if node.name else "", domain="com.microsoft", **attrs)]

    def gather_nodes(self, node) -> list:
        """The embedding lookup over the shared integers: GatherBlockQuantized, then a Reshape to [*ids, K]
        (after the scales' nodes, on first use)."""
        from onnx import TensorProto, helper

        scale_nodes = self._scale_nodes()
        names = self._written()
        blocks = f"{node.output[0]}_blocks"
        shape = self.out.tensor(f"{EMBEDDING_TABLE}_row_shape", TensorProto.INT64, (self.id_rank + 1,),
                                np.array([0] * self.id_rank + [-1], np.int64))
        self.new_inits[shape.name] = shape
        zero_points = [names.gather_zero_points] if names.gather_zero_points else []
        return scale_nodes + [
            helper.make_node("GatherBlockQuantized", [names.data, node.input[1], names.gather_scales]
                             + zero_points, [blocks],
                             name=f"{node.name}_Q{self.form.bits}" if node.name else "", domain="com.microsoft",
                             gather_axis=0, quantize_axis=2, block_size=self.form.block, bits=self.form.bits),
            helper.make_node("Reshape", [blocks, shape.name], [node.output[0]],
                             name=f"{node.name}_rows" if node.name else "")]


def _is_embedding_lookup(node, inits: dict) -> bool:
    """Whether ``node`` gathers rows of the token embedding (the only table lookup that is quantized)."""
    return node.op_type == "Gather" and node.input[0] == EMBEDDING_TABLE and EMBEDDING_TABLE in inits


def _legacy_form(bits: int, block_size: int, symmetric: bool) -> "TensorQuant":
    """The form ONNX Runtime's quantizer gives a weight (min/max range, no search), for the record."""
    from .mixquant import TensorQuant

    return TensorQuant(bits, block_size, symmetric, search=False)


def _quantize_gather(node, table, src_dir: Path, out: DataFile, new_inits: dict, block_size: int, symmetric: bool):
    """GatherBlockQuantized over ``table`` quantized along its last axis, in row chunks (rows are independent);
    returns the nodes and the bits per stored scale."""
    from onnx import TensorProto, helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    dims = tuple(table.dims)
    if len(dims) != 2 or dims[1] % 2:
        raise ValueError(f"{table.name}: the streaming quantizer takes a 2-D table of even width; got {dims}")
    qname, sname = f"{table.name}_Q4", f"{table.name}_scales"
    # Quantized rows go to the data file as they are made; the scales (1/block of the table) are
    # collected and written after.
    out.align()
    q_start, scales, zero_points = out.offset, [], []
    for start in range(0, dims[0], _GATHER_ROWS):
        chunk = _read(table, src_dir, slice(start, start + _GATHER_ROWS))
        q, s, zp = DefaultWeightOnlyQuantizer.quantize_ndarray(chunk, 1, block_size, symmetric)
        out.file.write(q.tobytes())
        out.offset += q.nbytes
        scales.append(s)
        if zp is not None:
            zero_points.append(zp)
    q = TensorProto(name=qname, data_type=TensorProto.INT4 if symmetric else TensorProto.UINT4, dims=list(dims))
    _point(q, out.path.name, q_start, out.offset - q_start)
    all_scales = np.concatenate(scales)
    s = write_scales(out, sname, all_scales, half=False)  # a lookup's: float32 (export/scales.py)
    inputs = [qname, node.input[1], sname]
    new_inits.update({t.name: t for t in (q, *s.initializers)})
    if not symmetric:
        zp_bytes = b"".join(z.tobytes() for z in zero_points)
        zp = out.tensor(f"{table.name}_zero_points", TensorProto.UINT4, all_scales.shape, zp_bytes)
        inputs.append(zp.name)
        new_inits[zp.name] = zp
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    return [*s.nodes, helper.make_node("GatherBlockQuantized", inputs, [node.output[0]],
                                       name=f"{node.name}_Q4" if node.name else "", domain="com.microsoft",
                                       gather_axis=axis, quantize_axis=1, block_size=block_size)], s.bits


def _planned_gather(node, table, form: "TensorQuant", src_dir: Path, out: DataFile, new_inits: dict):
    """GatherBlockQuantized over ``table`` [vocab, hidden] in ``form`` (uint8 data, ``bits`` 4 or 8), in row
    chunks; returns the nodes (the scales' Cast, the lookup), the form written and the bits per stored scale."""
    from onnx import TensorProto, helper

    from .mixquant import quantize

    dims = tuple(table.dims)
    if len(dims) == 2 and dims[1] % form.block and dims[1] % 32 == 0:
        # a lookup returns whole rows, so the table cannot be padded like a MatMul's input axis: a block
        # that does not divide the width falls back to 32 (and the record says so)
        form = replace(form, block=32)
    if len(dims) != 2 or dims[1] % form.block:
        raise ValueError(f"{table.name}: a planned embedding needs a 2-D table whose width is a multiple of "
                         f"{form.block}; got {dims}")
    qname, sname = f"{table.name}_Q{form.bits}", f"{table.name}_scales"
    out.align()
    q_start, scales, zero_points = out.offset, [], []
    for start in range(0, dims[0], _GATHER_ROWS):
        blocks = quantize(_read(table, src_dir, slice(start, start + _GATHER_ROWS)), form)
        packed = blocks.packed()
        out.file.write(packed.tobytes())
        out.offset += packed.nbytes
        scales.append(blocks.scales)
        zero_points.append(blocks.packed_zero_points())
    width = dims[1] * form.bits // 8
    q = TensorProto(name=qname, data_type=TensorProto.UINT8, dims=[dims[0], width])
    _point(q, out.path.name, q_start, out.offset - q_start)
    all_scales = np.concatenate(scales)
    s = write_scales(out, sname, all_scales, half=False)  # a lookup's: float32 (export/scales.py)
    inputs = [qname, node.input[1], sname]
    new_inits.update({t.name: t for t in (q, *s.initializers)})
    if not form.symmetric:
        zps = np.concatenate(zero_points)
        zp = out.tensor(f"{table.name}_zero_points", TensorProto.UINT8, zps.shape, zps)
        inputs.append(zp.name)
        new_inits[zp.name] = zp
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    gather = helper.make_node("GatherBlockQuantized", inputs, [node.output[0]],
                              name=f"{node.name}_Q{form.bits}" if node.name else "", domain="com.microsoft",
                              gather_axis=axis, quantize_axis=1, block_size=form.block, bits=form.bits)
    return [*s.nodes, gather], form, s.bits
