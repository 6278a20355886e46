"""Carry a GGUF file's own quantized blocks into the ONNX graph, without rounding anything twice.

A GGUF export first builds and validates the fp32 graph from transformers' dequantized
weights. This module then replaces each MatMul weight (and the embedding's Gather) whose
source tensors are quantized in the file by ONNX Runtime's ``MatMulNBits`` (or
``GatherBlockQuantized``) holding the file's own integers and scales:

==========  ==================================  =======  =====  ================================
GGUF type   value (per block)                   bits     block  form
==========  ==================================  =======  =====  ================================
Q4_0        d * (q - 8), q in 0..15              4        32     q, scale d, zero point 8
Q8_0        d * q, q in -128..127                8        32     q + 128, scale d, zero point 128
Q5_0        d * (q - 16), q in 0..31             8        32     q + 112, scale d, zero point 128
Q6_K        d * sc * (q - 32), q in 0..63        8        16     q + 96, scale d*sc, zero point 128
Q4_1        d * q + m                            4        32     q, scale d, zero point 8, + offset
Q4_K        d*sc * q - dmin*mn (sub-blocks 32)   4        32     q, scale d*sc, zero point 8, + offset
Q5_1 / K    as Q4_1 / Q4_K with q in 0..31       8        32     q + 112, zero point 128, + offset
==========  ==================================  =======  =====  ================================

Affine formats (Q4_1, Q4_K, Q5_1, Q5_K) have a per-block offset whose zero point ``-offset/d`` is
not an integer. ONNX Runtime's CPU ``MatMulNBits`` accepts a float zero point at 4 bits only, and
then dequantizes the whole weight on every call (about 150 ms for a 1536 x 8960 weight, 16x an
fp32 MatMul), and refuses it at 8 bits; ``GatherBlockQuantized`` takes uint8 zero points only.
So the offset is kept apart, exactly: ``x @ W = x @ (scale * (q - zp)) + blocksum(x) @ offset``,
with ``blocksum(x)`` the sums of x over each block of the input axis ([n, K/block]) and
``offset`` a [K/block, N] fp32 matrix (one float per block, the size of a float zero point).
``offset = m + zp * d`` is the only rounding (fp32, once). An embedding's offset rows are
gathered and spread over their blocks by a 0/1 [K/block, K] matrix (exact).

Where every block's offset is an integral multiple of its scale (``offset = scale * (zp - z)``, z in
the kernel's range), the form takes uint8 zero points instead and needs no offset matmul. llama.cpp's
quantizers do not aim for it: in the catalog's Q4_K_M and Q4_1 files 0.04-0.27% of blocks are
integral and no tensor is, so their offsets stay.

A fused weight (q|k|v, gate|up) whose parts have different kernel layouts (Q4_K_M's q/k Q4_K with v
Q6_K) splits by output rows, one MatMulNBits per layout and a Concat, instead of widening every part
to the widest bits and smallest block. A tied output layer reads the embedding's own initializer
(written in MatMulNBits' [vocab, K/block, bytes] shape, which GatherBlockQuantized gathers along its
last axis) and offsets; only the scales are written twice (the two ops want different ranks).
A MatMulNBits' scales that float16 holds exactly (the file's own ``d`` of Q4_0, Q4_1, Q5_0 and Q8_0
blocks) are stored at half width and widened at load (export/scales.py); a K-quant's ``d * sc`` products
stay float32 unless float16 holds every one, and so do a lookup's.

Every other type (F32, F16, BF16, Q2_K, Q3_K, the IQ types) keeps the fp32 weight of the
validated graph: where no exact form exists, precision goes up, never down.

8-bit ``MatMulNBits`` has no fp32-activation path on ONNX Runtime's CPU (accuracy_level 1
dequantizes every call, slower than fp32), so 8-bit forms are written only at accuracy_level 4
(int8 activations per block, as llama.cpp's own dot products); at a lower accuracy level those
weights stay fp32.

Each form is checked before it is written: its blocks, dequantized in numpy, must equal the
graph's fp32 weight (transformers' dequantization, after its q/k row permutation for llama)
bit for bit for the exact forms, and to fp32 rounding for the offset forms. A weight whose
blocks do not reproduce it stays fp32, with the reason recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..bundle.extra import KeptTensor
from .mixquant import pack_blocks, pack_zero_points

QK_K = 256  # elements per K-quant super-block


@dataclass(frozen=True)
class BlockForm:
    """A [N, K] weight as ``scale * (q - zp) + offset`` per block of the input axis.

    ``q``: [N, K/block, block] uint8 in 0..2**bits-1; ``scales``, ``offsets`` (or None): [N, K/block]
    float32; ``zero_points`` (or None): [N, K/block] uint8, the kernel's integer zero points, else
    ``zp = 2**(bits-1)`` (MatMulNBits' default). A form has offsets or zero points, never both.
    """

    q: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    bits: int
    block: int
    zero_points: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, as ONNX Runtime reads the form (the offset added last)."""
        zp = (np.float32(1 << (self.bits - 1)) if self.zero_points is None
              else self.zero_points.astype(np.float32)[..., None])
        w = self.scales[..., None] * (self.q.astype(np.float32) - zp)
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(w.shape[0], -1)

    def packed(self) -> np.ndarray:
        return pack_blocks(self.q, self.bits)

    def packed_zero_points(self) -> np.ndarray:
        return pack_zero_points(self.zero_points, self.bits)

    def integral(self) -> "BlockForm | None":
        """The candidate with integer zero points instead of the offsets: z = zp - offset/scale rounded,
        or None where some z falls outside the kernel's range. The caller keeps it only where it
        reproduces the dequantized source bit for bit (nothing is rounded to make it fit)."""
        if self.offsets is None:
            return None
        zp = np.float32(1 << (self.bits - 1))
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.round(zp - self.offsets / self.scales)
        if not np.isfinite(z).all() or z.min() < 0 or z.max() > (1 << self.bits) - 1:
            return None
        return BlockForm(self.q, self.scales, None, self.bits, self.block, z.astype(np.uint8))

    def widened(self, bits: int, block: int) -> "BlockForm":
        """The same values at ``bits`` >= self.bits and ``block`` dividing self.block (exact: q moves by
        the zero points' difference, and each block's scale and offset repeat over its sub-blocks).
        Only offset forms widen: zero points are chosen last, on the form a node will hold."""
        q = self.q if bits == self.bits else (self.q + ((1 << (bits - 1)) - (1 << (self.bits - 1)))).astype(np.uint8)
        if block == self.block:
            return BlockForm(q, self.scales, self.offsets, bits, block)
        split = self.block // block
        n = q.shape[0]
        off = None if self.offsets is None else np.repeat(self.offsets, split, axis=1)
        return BlockForm(q.reshape(n, -1, block), np.repeat(self.scales, split, axis=1), off, bits, block)

    def rows(self, index: np.ndarray | slice) -> "BlockForm":
        off = None if self.offsets is None else self.offsets[index]
        zps = None if self.zero_points is None else self.zero_points[index]
        return BlockForm(self.q[index], self.scales[index], off, self.bits, self.block, zps)


def _concat(forms: list[BlockForm]) -> BlockForm:
    """Forms of one bits and block (offsets, no zero points) stacked along the output axis; a part
    without offsets gets offset 0."""
    offsets = None
    if any(f.offsets is not None for f in forms):
        offsets = np.concatenate([f.offsets if f.offsets is not None else np.zeros_like(f.scales) for f in forms])
    return BlockForm(np.concatenate([f.q for f in forms]), np.concatenate([f.scales for f in forms]), offsets,
                     forms[0].bits, forms[0].block)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (a little-endian fp16 field)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles are elements 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5_x)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., n] bits: element j is bit j (Q5_0/Q5_1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :n]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> (scale, min) [..., 8] 6-bit integers of the eight sub-blocks.

    Bytes 0-3: low 6 bits are scales 0-3, top 2 bits the high bits of scales 4-7; bytes 4-7: the
    same for mins; bytes 8-11: low nibble the low 4 bits of scales 4-7, high nibble of mins 4-7.
    """
    s = scales.astype(np.uint8)
    lo_s, lo_m, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_s & 63, (mix & 15) | ((lo_s >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_m & 63, (mix >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, mn


def _decode(kind: str, raw: np.ndarray) -> BlockForm | None:
    """A GGUF tensor's bytes ([N, bytes per row] uint8) as its exact block form, or None (kept float)."""
    n = raw.shape[0]
    f32 = np.float32
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[kind]
        b = raw.reshape(n, -1, size)
        d = _f16(b[..., 0:2].reshape(n, -1, 2))
        if kind == "Q8_0":
            q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return BlockForm(q, d, None, 8, 32)
        affine = kind in ("Q4_1", "Q5_1")
        m = _f16(b[..., 2:4]) if affine else None
        start = 4 if affine else 2
        if kind.startswith("Q4"):
            q = _nibbles_split(b[..., start:start + 16])
            return BlockForm(q, d, None if m is None else m + f32(8) * d, 4, 32)
        q5 = _nibbles_split(b[..., start + 4:start + 20]) | (_high_bits(b[..., start:start + 4], 32) << 4)
        return BlockForm((q5 + 112).astype(np.uint8), d, None if m is None else m + f32(16) * d, 8, 32)
    if kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        b = raw.reshape(n, -1, size)  # [N, super-blocks, bytes]
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        scale = (d[..., None] * sc.astype(f32))  # [N, S, 8], exact: fp16 x 6-bit integer
        minimum = (dmin[..., None] * mn.astype(f32))
        if kind == "Q4_K":
            qs = b[..., 16:144].reshape(n, -1, 4, 32)  # chunk c holds sub-blocks 2c (low) and 2c+1 (high)
            q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
            zp, bits = f32(8), 4
        else:
            qh = b[..., 16:48]  # [N, S, 32]: bit i of byte j is the high bit of sub-block i's element j
            qs = b[..., 48:176].reshape(n, -1, 4, 32)
            low = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, S, 8, 32]
            q = ((low | (high << 4)) + 112).astype(np.uint8)
            zp, bits = f32(16), 8
        return BlockForm(q.reshape(n, -1, 32), scale.reshape(n, -1), (zp * scale - minimum).reshape(n, -1), bits, 32)
    if kind == "Q6_K":
        b = raw.reshape(n, -1, 210)
        ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208].view(np.int8)
        d = _f16(b[..., 208:210])
        # Each 128-element half h reads 64 ql bytes (low nibbles: elements 0-63, high: 64-127) and
        # 32 qh bytes (bit pairs 0,2,4,6: elements 0-31, 32-63, 64-95, 96-127).
        low = np.stack([ql.reshape(n, -1, 2, 64) & 15, ql.reshape(n, -1, 2, 64) >> 4], axis=3).reshape(n, -1, 2, 128)
        qh2 = qh.reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
        high = (qh2 & 3).reshape(n, -1, 2, 128)
        q = ((low | (high << 4)) + 96).astype(np.uint8).reshape(n, -1, 16)
        scale = (d[..., None] * sc.astype(f32)).reshape(n, -1)  # fp16 x int8: exact
        return BlockForm(q, scale, None, 8, 16)
    return None


# Rows decoded at once: the decoders' temporaries (nibbles, high bits, the stacked q) are several copies
# of their input, about 1 GB for a whole 151,936-row embedding; 8192 rows of one are 60 MB.
_DECODE_ROWS = 8192


def _decode_rows(kind: str, raw: np.ndarray) -> BlockForm | None:
    """:func:`_decode` of ``raw`` ([N, bytes per row] uint8), ``_DECODE_ROWS`` rows at a time into one form."""
    n = raw.shape[0]
    first = _decode(kind, raw[:_DECODE_ROWS])
    if first is None or n <= _DECODE_ROWS:
        return first
    parts = [first.q, first.scales, first.offsets, first.zero_points]
    whole = [None if a is None else np.empty((n, *a.shape[1:]), a.dtype) for a in parts]
    for start in range(0, n, _DECODE_ROWS):
        form = first if start == 0 else _decode(kind, raw[start:start + _DECODE_ROWS])
        for out, a in zip(whole, (form.q, form.scales, form.offsets, form.zero_points)):
            if out is not None:
                out[start:start + _DECODE_ROWS] = a
    return BlockForm(whole[0], whole[1], whole[2], first.bits, first.block, whole[3])


def _llama_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order transformers' GGUF loader gives llama's q/k weights: llama.cpp stores each head's
    rotary pairs interleaved; the loader moves them back to halves (rows of head h: pairs, then halves)."""
    half = n_rows // n_heads // 2
    return np.arange(n_rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(-1)


class GgufTensors:
    """The tensors of one GGUF file, by name (the ``gguf`` package reads the header; each tensor is read on demand)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        field = self.reader.fields.get("general.architecture")
        self.arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""

    def kind(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def raw(self, name: str) -> np.ndarray:
        """The tensor's data as the reader's ``tensor.data`` holds it (same dtype and shape), read from the
        file: not the reader's memory map, whose pages once touched stay in the process's RSS while the
        map lives, so the whole file would end up counted in the export's peak."""
        t = self.tensors[name]
        like = t.data  # a view of the memory map: its dtype and shape, no page is touched
        return np.fromfile(self.path, dtype=like.dtype, count=int(like.size),
                           offset=int(t.data_offset)).reshape(like.shape)

    def form(self, name: str) -> BlockForm | None:
        t = self.tensors[name]
        rows = int(t.shape[1]) if len(t.shape) > 1 else 1
        return _decode_rows(t.tensor_type.name, self.raw(name).view(np.uint8).reshape(rows, -1))


def source_names(arch: str, n_layers: int) -> dict[str, list[list[str]]]:
    """Graph weight name -> candidate GGUF tensor lists (each list fused along the output axis).

    The base decoder's layout (export/families/base.py): qkv = q|k|v, gate_up = gate|up, o, down,
    the embedding, and the output layer, which transformers reads from ``output`` or, tied, from
    ``token_embd``. Names come from the ``gguf`` package's own HF -> GGUF map.
    """
    import gguf

    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        return {}
    names = gguf.get_tensor_name_map(archs[arch], n_layers)

    def g(hf: str) -> str | None:
        found = names.get_name(hf)
        return None if found is None else found + ".weight"

    out: dict[str, list[list[str]]] = {"embed": [[g("model.embed_tokens")]],
                                       "lm_head": [[g("lm_head")], [g("model.embed_tokens")]]}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        out[f"layers.{i}.qkv"] = [[g(f"{p}.self_attn.{x}_proj") for x in "qkv"]]
        out[f"layers.{i}.o"] = [[g(f"{p}.self_attn.o_proj")]]
        out[f"layers.{i}.gate_up"] = [[g(f"{p}.mlp.gate_proj"), g(f"{p}.mlp.up_proj")]]
        out[f"layers.{i}.down"] = [[g(f"{p}.mlp.down_proj")]]
    return {k: [c for c in cands if None not in c] for k, cands in out.items()}


# Output rows dequantized at once when a form is checked: the temporaries of a whole embedding
# (151,936 x 1,536 in Qwen2.5) are several fp32 copies of it, about 4 GB; 4096 rows of an 8B model's
# 14,336-wide down projection are 0.23 GB each.
_CHECK_ROWS = 4096


def _reproduces(form: BlockForm, reference: np.ndarray) -> bool:
    """``form`` dequantizes to ``reference`` ([N, K]): bit for bit without an offset, else to fp32 rounding
    (one rounding of ``m + zp*d`` and one of the sum: 2 ulp of the block's largest term). Checked
    ``_CHECK_ROWS`` output rows at a time."""
    n = form.q.shape[0]
    if reference.shape != (n, form.q.shape[1] * form.block):
        return False
    return all(_rows_reproduce(form.rows(slice(start, start + _CHECK_ROWS)), reference[start:start + _CHECK_ROWS])
               for start in range(0, n, _CHECK_ROWS))


def _rows_reproduce(form: BlockForm, reference: np.ndarray) -> bool:
    deq = form.dequantize()
    if form.offsets is None:
        return bool(np.array_equal(deq, reference))
    zp = float(1 << (form.bits - 1))
    bound = (np.abs(form.scales) * (2 ** form.bits + zp) + np.abs(form.offsets))[..., None]
    err = np.abs(deq - reference).reshape(form.q.shape[0], -1, form.block)
    return bool((err <= 2 * np.finfo(np.float32).eps * bound).all())


@dataclass(frozen=True)
class Part:
    """Output rows ``start:stop`` of a fused weight, held by one MatMulNBits node in ``form``."""

    start: int
    stop: int
    form: BlockForm
    sources: tuple[str, ...]
    kinds: str  # their GGUF types, "+"-joined


def _fused_forms(tensors: GgufTensors, names: list[str], reference: np.ndarray, n_heads: int, n_kv_heads: int,
                 zero_points: bool = True) -> tuple[list[Part] | None, str]:
    """The forms of ``names`` (fused along the output axis) reproducing ``reference`` ([N, K]), or (None, why not).

    Consecutive parts of one kernel layout (bits and block) stay fused in one node; where the layout
    changes (Q4_K_M's q/k Q4_K with v Q6_K) the weight splits, so q|k keep 4 bits and only v runs at
    8 bits block 16 (widening the whole q|k|v instead costs about 1.4x its 1-row time). A part whose
    offsets are all integral multiples of its scales (``BlockForm.integral``) takes integer zero points
    instead, when that reproduces the reference bit for bit (``zero_points``: MatMulNBits only; the
    embedding's GatherBlockQuantized keeps offsets, which cost one gathered row there).
    """
    forms, kinds, start = [], [], 0
    for name in names:
        kinds.append(tensors.kind(name))
        form = tensors.form(name)
        if form is None:
            return None, f"{kinds[-1]} has no exact MatMulNBits form"
        rows = form.q.shape[0]
        part = reference[start:start + rows]
        start += rows
        if not _reproduces(form, part):
            # transformers moves llama's q/k rows back from llama.cpp's interleaved rotary order.
            heads = n_kv_heads if ".attn_k." in name else n_heads
            permuted = form.rows(_llama_rows(rows, heads)) if rows % (2 * heads) == 0 else None
            if permuted is None or not _reproduces(permuted, part):
                return None, f"the blocks of {name} do not reproduce the dequantized weight"
            form = permuted
        forms.append(form)
    if start != reference.shape[0]:
        return None, f"the fused parts have {start} rows, the weight {reference.shape[0]}"
    parts, first, row = [], 0, 0
    for i in range(1, len(forms) + 1):
        if i < len(forms) and (forms[i].bits, forms[i].block) == (forms[first].bits, forms[first].block):
            continue
        group = _concat(forms[first:i])
        stop = row + group.q.shape[0]
        exact = group.integral() if zero_points else None
        if exact is not None and _reproduces(exact, reference[row:stop]):
            group = exact
        parts.append(Part(row, stop, group, tuple(names[first:i]), "+".join(sorted(set(kinds[first:i])))))
        first, row = i, stop
    return parts, "+".join(sorted(set(kinds)))


def import_gguf(src: Path, dst: Path, gguf_path: Path, weights: dict[str, np.ndarray], *, n_layers: int,
                n_heads: int, n_kv_heads: int, accuracy_level: int, head_ids: np.ndarray | None = None,
                note: Callable[[str], None] = lambda _: None,
                progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[list[Path], dict[str, KeptTensor]]:
    """Rewrite the validated fp32 graph ``src`` into ``dst`` (+ .data) with the file's own blocks.

    ``weights``: the model's canonical fp32 weights ([in, out] for linears, [vocab, hidden] for
    ``embed``; ``lm_head`` absent when tied), the reference each form must reproduce; for a
    vocabulary-truncated draft, the full ones, and ``head_ids`` the output rows its head keeps. Returns the files
    written and, per graph weight (MatMul B or the embedding), what was kept. ``progress(done, total)``
    after each weight a GGUF tensor maps to.
    """
    import onnx
    from onnx import helper

    from .rtn import DataFile
    from .scales import write_scales

    tensors = GgufTensors(gguf_path)
    candidates = source_names(tensors.arch, n_layers)
    # The graph without its weights: those replaced by the file's blocks are never read (a 1.5B model's
    # fp32 weights are 7 GB); the ones kept are read below, one at a time.
    model = onnx.load(str(src), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    record: dict[str, KeptTensor] = {}
    new_nodes, new_inits, dropped = [], [], set()
    # Each initializer goes to the data file as it is made (as export/rtn.py writes quantized weights):
    # memory holds one weight's forms at a time, not the whole quantized model in ONNX protos.
    data_path = dst.with_name(dst.name + ".data")
    out = DataFile(data_path)

    def reference(key: str) -> np.ndarray:
        if key == "embed":
            return weights["embed"]
        w = weights[key] if key in weights else weights["embed"].T  # tied: the head is the embedding
        return np.ascontiguousarray(w.T)  # [out, in]

    def choose(key: str) -> tuple[list[Part] | None, KeptTensor]:
        why, kinds, names = "no GGUF tensor maps to it", "", []
        for names in candidates.get(key, []):
            if any(n not in tensors.tensors for n in names):
                continue
            if key == "lm_head" and shared_head(names):
                return parts_of["embed"], record["embed"]
            parts, kinds = _fused_forms(tensors, names, reference(key), n_heads, n_kv_heads,
                                        zero_points=key != "embed")
            if parts is None:
                why, kinds = kinds, "+".join(sorted({tensors.kind(n) for n in names}))
                continue
            if key == "lm_head" and head_ids is not None:
                # a vocabulary-truncated head keeps these output rows (its one part: one source tensor)
                parts = [Part(0, len(head_ids), parts[0].form.rows(head_ids), parts[0].sources, parts[0].kinds)]
            if any(p.form.bits == 8 for p in parts) and accuracy_level < 4:
                return None, KeptTensor(tuple(names), kinds, "fp32", 0, False,
                                        "8-bit MatMulNBits has no fp32-activation path on CPU: kept fp32 at "
                                        f"accuracy_level {accuracy_level}")
            form = parts[0].form
            return parts, KeptTensor(tuple(names), kinds, f"int{form.bits}", form.block,
                                     form.offsets is not None, "")
        return None, KeptTensor(tuple(names), kinds, "fp32", 0, False, why)

    def shared_head(names: list[str]) -> bool:
        """A tied head reads the embedding's own blocks (one initializer for both, not a copy): the same
        GGUF tensor, every output row, and the embedding kept in blocks."""
        return ("lm_head" not in weights and head_ids is None and parts_of.get("embed") is not None
                and tuple(names) == record["embed"].sources)

    def const(name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        new_inits.append(out.tensor(name, helper.np_dtype_to_tensor_dtype(array.dtype), array.shape, array))
        return name

    def scales_of(name: str, scales: np.ndarray, half: bool = True) -> str:
        """The file's scales as a float32 tensor (stored as float16 where that holds them and ``half``: a
        MatMulNBits'; a lookup's stay float32, export/scales.py)."""
        written = write_scales(out, name, scales, half=half)
        new_inits.extend(written.initializers)
        new_nodes.extend(written.nodes)
        return written.name

    def blocksum(x: str, block: int, n_blocks: int) -> str:
        """[..., K] -> [..., K/block] sums over each block, computed once per input and block."""
        if (x, block) not in sums:
            tag = f"{x}.gguf_b{block}"
            shape = const(f"{tag}_shape", np.array([-1, n_blocks, block], np.int64))
            axes = const(f"{tag}_axes", np.array([-1], np.int64))
            new_nodes.append(helper.make_node("Reshape", [x, shape], [f"{tag}_blocks"], name=f"{tag}_reshape"))
            new_nodes.append(helper.make_node("ReduceSum", [f"{tag}_blocks", axes], [f"{tag}_sums"],
                                              name=f"{tag}_blocksum", keepdims=0))
            sums[(x, block)] = f"{tag}_sums"
        return sums[(x, block)]

    def matmul(name: str, x: str, out: str, form: BlockForm, data: str | None, offsets: str | None) -> None:
        """``out`` = x @ form^T by MatMulNBits (+ blocksum(x) @ offsets). ``data``/``offsets``: initializers
        already written (a tied head reading the embedding's: offsets [N, K/block], so a Gemm with transB)."""
        n_out, n_blocks = form.q.shape[0], form.q.shape[1]
        data = data or const(f"{name}.gguf_q", form.packed())
        inputs = [x, data, scales_of(f"{name}.gguf_scales", form.scales)]
        if form.zero_points is not None:
            inputs.append(const(f"{name}.gguf_zero_points", form.packed_zero_points()))
        main = out if form.offsets is None else f"{name}.gguf_main"
        new_nodes.append(helper.make_node("MatMulNBits", inputs, [main], name=f"{name}.gguf_matmul",
                                          domain="com.microsoft", K=n_blocks * form.block, N=n_out, bits=form.bits,
                                          block_size=form.block, accuracy_level=accuracy_level))
        if form.offsets is None:
            return
        # x @ W = MatMulNBits(x) + blocksum(x) @ offsets: [rows, K/block] @ [K/block, N], broadcast back
        # onto [1, n, N] / [n, N].
        xs = blocksum(x, form.block, n_blocks)
        if offsets is None:
            off = const(f"{name}.gguf_offsets", np.ascontiguousarray(form.offsets.T.astype(np.float32)))
            new_nodes.append(helper.make_node("MatMul", [xs, off], [f"{name}.gguf_offset"],
                                              name=f"{name}.gguf_offset_matmul"))
        else:
            flat = const(f"{name}.gguf_flat", np.array([-1, n_blocks], np.int64))
            new_nodes.append(helper.make_node("Reshape", [xs, flat], [f"{name}.gguf_sums2d"],
                                              name=f"{name}.gguf_flatten"))
            new_nodes.append(helper.make_node("Gemm", [f"{name}.gguf_sums2d", offsets], [f"{name}.gguf_offset"],
                                              name=f"{name}.gguf_offset_gemm", transB=1))
        new_nodes.append(helper.make_node("Add", [main, f"{name}.gguf_offset"], [out], name=f"{name}.gguf_add"))

    def gather(node, form: BlockForm, shared: bool) -> tuple[str, str | None]:
        """The embedding as GatherBlockQuantized (+ its offset rows); returns the data and offsets
        initializers. ``shared``: the tied head reads the same data, so it is written in MatMulNBits'
        [vocab, K/block, block*bits/8] shape and gathered along its last axis."""
        n_out, n_blocks = form.q.shape[0], form.q.shape[1]
        key, ids = node.input[0], node.input[1]
        if shared:
            data = const(f"{key}.gguf_q", form.packed())
            scales = scales_of(f"{key}.gguf_scales3", form.scales[..., None], half=False)
            rows = f"{key}.gguf_rows3"
        else:
            data = const(f"{key}.gguf_q", form.packed().reshape(n_out, -1))
            scales = scales_of(f"{key}.gguf_scales", form.scales, half=False)
            rows = node.output[0] if form.offsets is None else f"{key}.gguf_rows"
        new_nodes.append(helper.make_node("GatherBlockQuantized", [data, ids, scales], [rows],
                                          name=f"{key}.gguf_gather", domain="com.microsoft", bits=form.bits,
                                          block_size=form.block, gather_axis=0, quantize_axis=2 if shared else 1))
        if shared:  # [*ids, K/block, block] -> [*ids, K]
            flat = rows
            rows = node.output[0] if form.offsets is None else f"{key}.gguf_rows"
            shape = const(f"{key}.gguf_row_shape", np.array([0] * id_rank[ids] + [-1], np.int64))
            new_nodes.append(helper.make_node("Reshape", [flat, shape], [rows], name=f"{key}.gguf_row_reshape"))
        if form.offsets is None:
            return data, None
        # offsets [vocab, K/block] gathered, spread over their blocks by a 0/1 [K/block, K] matrix
        off = const(f"{key}.gguf_offsets", form.offsets.astype(np.float32))
        spread = const(f"{key}.gguf_spread", np.repeat(np.eye(n_blocks, dtype=np.float32), form.block, axis=1))
        new_nodes.extend([
            helper.make_node("Gather", [off, ids], [f"{key}.gguf_off_rows"], name=f"{key}.gguf_off_gather", axis=0),
            helper.make_node("MatMul", [f"{key}.gguf_off_rows", spread], [f"{key}.gguf_off_wide"],
                             name=f"{key}.gguf_off_spread"),
            helper.make_node("Add", [rows, f"{key}.gguf_off_wide"], [node.output[0]], name=f"{key}.gguf_add")])
        return data, off

    parts_of: dict[str, list[Part] | None] = {}
    sums: dict[tuple[str, int], str] = {}
    embed_inits: tuple[str, str | None] | None = None
    id_rank = {i.name: len(i.type.tensor_type.shape.dim) for i in graph.input}
    def weight_of(node) -> str | None:
        """The graph weight a node reads that a GGUF tensor may hold (MatMul B, the embedding), or None."""
        key = node.input[0] if node.op_type == "Gather" else node.input[1] if node.op_type == "MatMul" else None
        return key if key is not None and key in inits and (key == "embed" or key in candidates) else None

    total, done = sum(weight_of(n) is not None for n in graph.node), 0
    try:
        for node in graph.node:
            key = weight_of(node)
            if key is None:
                new_nodes.append(node)
                continue
            progress(done, total)  # the weights finished before this one
            done += 1
            parts, kept = choose(key)
            if key == "embed":  # a tied head may read its blocks; no other weight's forms are kept
                parts_of[key] = parts
            if parts is None:
                record[key] = kept
                new_nodes.append(node)
                continue
            dropped.add(key)
            if node.op_type == "Gather":
                record[key] = kept
                lm = candidates.get("lm_head", [])
                tied = next((names for names in lm if all(n in tensors.tensors for n in names)), None)
                share = (tied is not None and tuple(tied) == kept.sources and "lm_head" not in weights
                         and head_ids is None and node.input[1] in id_rank)
                embed_inits = gather(node, parts[0].form, share)
                if share:
                    note("the tied output layer reads the embedding's blocks (one copy)")
                else:
                    embed_inits = None
                continue
            if key == "lm_head" and parts is parts_of.get("embed") and embed_inits is not None:
                record[key] = kept
                matmul(key, node.input[0], node.output[0], parts[0].form, *embed_inits)
                continue
            if len(parts) == 1:
                record[key] = kept
                matmul(key, node.input[0], node.output[0], parts[0].form, None, None)
                continue
            for i, part in enumerate(parts):
                form = part.form
                record[f"{key}[{part.start}:{part.stop}]"] = KeptTensor(part.sources, part.kinds, f"int{form.bits}",
                                                                        form.block, form.offsets is not None, "")
                matmul(f"{key}.part{i}", node.input[0], f"{key}.gguf_part{i}", form, None, None)
            new_nodes.append(helper.make_node("Concat", [f"{key}.gguf_part{i}" for i in range(len(parts))],
                                              [node.output[0]], name=f"{key}.gguf_concat", axis=-1))
        progress(total, total)
        read = {name for n in new_nodes for name in n.input}  # an initializer another node still reads stays
        # the weights kept float are copied into dst's data file in chunks, never read whole
        kept_inits = [out.copy(t, src.parent) for t in graph.initializer if t.name not in dropped or t.name in read]
    finally:
        out.close()
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept_inits + new_inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    counts: dict[str, int] = {}
    for kept in record.values():
        counts[kept.kept] = counts.get(kept.kept, 0) + 1
    note("kept the GGUF's quantization: " + ", ".join(f"{n} weights {k}" for k, n in sorted(counts.items())))
    onnx.save_model(model, str(dst))
    if data_path.stat().st_size == 0:
        data_path.unlink()
    return [dst] + ([data_path] if data_path.exists() else []), record
