"""Build one ONNX decoder graph with a dynamic new-token axis, straight from weights.

Why a direct builder rather than ``torch.onnx.export`` or transformers' exporter:
the runtime needs a precise, stable IO contract (position-major KV cache whose
prefix is one contiguous block, K/V of the *new* tokens as outputs so the engine
writes them in place, logits only for the last ``num_logits`` positions so a
512-token prefill does not materialise 512 x vocab floats). Writing the graph
from the weights gives exactly that contract for every architecture we support,
builds a 1.5B graph in seconds with no tracing, streams weights to external data
without holding a second copy, and every graph is still checked against PyTorch
(export/validate.py) before a bundle is written.

The same graph serves prefill (n = prompt length), a decode step (n = 1) and a
speculative verify (n = k + 1).

IO (batch is always 1; n new tokens, P cached positions, T = P + n). Every tensor name is the
:class:`~specedge.bundle.manifest.ModelIO` field given here (``io.input_ids``, ...; the defaults in
brackets), the same object the manifest records, so the engines bind what the graph declares::

    input_ids      [input_ids]            int64 [1, n]
    positions      [position_ids]         int64 [1, n]      must be P .. P+n-1
    num_logits     [num_logits_to_keep]   int64 [1]         logits for the last m positions
    past_key       [past_key.%d]          kv    [P, n_kv_heads, head_dim]
    past_value     [past_value.%d]        kv    [P, n_kv_heads, head_dim]
    ->
    logits         [logits]               float32 [1, m, vocab]
    new_key        [new_key.%d]           kv    [n, n_kv_heads, head_dim]   (rotary already applied)
    new_value      [new_value.%d]         kv    [n, n_kv_heads, head_dim]

The fused-GQA graph (``attention="gqa"``) instead shares one [1, n_kv_heads, max_context, head_dim]
buffer as ``past_key``/``past_value`` input and ``present_key``/``present_value`` output, and takes
``seqlens_k`` and ``total_sequence_length``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..bundle.manifest import ModelIO
from .mixquant import EMBEDDING_TABLE

OPSET = 18  # ReduceMean takes axes as an input from 18 on, as ORT's int4 quantizer (opset 21) expects
_ONNX_DTYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
# Tensors above this many bytes go to the external data file; tiny ones (norm weights
# are a few KB) stay inline so the graph is readable in Netron.
_EXTERNAL_THRESHOLD = 1024
# A non-contiguous weight (a transposed view) is written in blocks of rows of about this size,
# so writing it never holds a second whole copy.
_WRITE_CHUNK_BYTES = 64 << 20
# ORT memory-maps external data; 64-byte alignment keeps every tensor SIMD-aligned.
_ALIGN = 64


@dataclass(frozen=True)
class RopeTable:
    """One set of rotary frequencies: cos/sin of ``position * inv_freq``, times ``scaling``.

    ``inv_freq`` has rotary_dim / 2 entries; rotary_dim < head_dim is partial rotary (the
    first rotary_dim channels of each head rotate, the rest pass through, as transformers does).
    """

    inv_freq: tuple[float, ...]
    scaling: float = 1.0  # HF's attention_scaling (yarn, longrope): multiplies cos and sin

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


@dataclass(frozen=True)
class DecoderSpec:
    """Architecture facts the graph needs, one field per feature (no per-family branches in the builder).

    Weights are given separately, by canonical name (export/families/base.py). Which norms a layer
    has is read from the weights present: ``layers.{i}.attn_norm`` / ``mlp_norm`` (pre-norms),
    ``layers.{i}.attn_post_norm`` / ``mlp_post_norm`` (post-norms, Gemma 2/3 and OLMo 2),
    ``layers.{i}.q_norm`` / ``k_norm`` (see ``qk_norm``), each with an optional ``_bias``.
    """

    architecture: str  # the family's builder name (manifest metadata): "llama", "gpt2", "qwen3", ...
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float
    attn_scale: float
    inv_freq: tuple[float, ...] = ()  # rotary inverse frequencies [rotary_dim/2] of rope table 0; empty: no rope
    rope_scaling: float = 1.0  # multiplies cos/sin of table 0 (HF's attention_scaling)
    tied_embeddings: bool = False
    max_positions: int = 0  # learned position table size (gpt2); 0: positions come from rope only
    activation: str = "silu"  # MLP activation (export/features.ACTIVATIONS)
    # Per layer: sliding-window length W (query p sees keys p-W+1..p, as transformers masks
    # `kv_idx > q_idx - W`), or 0 for full causal attention. Empty: every layer is full.
    layer_windows: tuple[int, ...] = ()
    norm: str = "rms"  # "rms" (RMSNorm; Gemma's 1 + w is folded into the weight) or "layer" (LayerNorm + bias)
    mlp: str = "gated"  # "gated": down(act(gate) * up); "plain": down(act(fc)) (gpt2, NeoX, Starcoder2)
    # q/k normalisation before rotary: "" none, "head" over each head's head_dim (Qwen3, Gemma 3;
    # a [heads, head_dim] weight is per head, StableLM), "full" over the whole projection (OLMo 2).
    qk_norm: str = ""
    parallel_residual: bool = False  # x + attn(norm1 x) + mlp(norm2 x) (GPT-NeoX, StableLM)
    embed_scale: float = 1.0  # multiplies the token embedding (Gemma sqrt(hidden), Granite embedding_multiplier)
    residual_scale: float = 1.0  # x + scale * block(x) (Granite residual_multiplier)
    logit_scale: float = 1.0  # multiplies the logits (Granite 1 / logits_scaling)
    final_softcap: float = 0.0  # logits = c tanh(logits / c) when > 0 (Gemma 2 final_logit_softcapping)
    attn_softcap: float = 0.0  # scores = c tanh(scores / c) before the mask when > 0 (Gemma 2)
    # Further rope tables (index 1, 2, ...; table 0 is inv_freq/rope_scaling) and the table each
    # layer uses, -1 for no rope (SmolLM3's NoPE layers). Empty layer_rope: every layer uses
    # table 0 when inv_freq is set, none otherwise.
    rope_tables: tuple[RopeTable, ...] = ()
    layer_rope: tuple[int, ...] = ()

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window in tokens, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def tables(self) -> tuple[RopeTable, ...]:
        """Every rope table, index = the value in ``layer_rope``."""
        return ((RopeTable(self.inv_freq, self.rope_scaling),) if self.inv_freq else ()) + self.rope_tables

    def rope(self, layer: int) -> int:
        """Index of layer ``layer``'s rope table, or -1 when it has none."""
        if self.layer_rope:
            return self.layer_rope[layer]
        return 0 if self.inv_freq else -1


@dataclass
class _Builder:
    """Accumulates nodes and initializers; large tensors stream to one external file."""

    dtype: np.dtype
    data_path: Path | None
    io: ModelIO = field(default_factory=ModelIO)  # the graph's tensor names (the manifest records the same)
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    _counter: int = 0
    _offset: int = 0
    _data_file: object = None

    def name(self, base: str) -> str:
        self._counter += 1
        return f"{base}_{self._counter}"

    def node(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", out: str | None = None,
             **attrs) -> list[str]:
        outs = [out] if out is not None else [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.name(op), domain=domain, **attrs))
        return outs

    def one(self, op: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        return self.node(op, inputs, out=out, **attrs)[0]

    def const(self, name: str, array: np.ndarray) -> str:
        tensor = TensorProto(name=name, data_type=_np_to_onnx(array.dtype), dims=array.shape)
        if self.data_path is not None and array.nbytes > _EXTERNAL_THRESHOLD:
            if self._data_file is None:
                self._data_file = open(self.data_path, "wb")
            pad = (-self._offset) % _ALIGN
            self._data_file.write(b"\0" * pad)
            self._offset += pad
            # Written from the array itself: no bytes copy of a large weight. A transposed view (a
            # [in, out] linear) is made contiguous a block of rows at a time, never whole.
            rows = max(1, _WRITE_CHUNK_BYTES // max(1, array[:1].nbytes)) if array.ndim else 1
            parts = [array] if array.flags.c_contiguous or array.ndim == 0 else (
                array[r:r + rows] for r in range(0, array.shape[0], rows))
            for part in parts:
                self._data_file.write(memoryview(np.ascontiguousarray(part)).cast("B"))
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.data_path.name), ("offset", str(self._offset)),
                               ("length", str(array.nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            self._offset += array.nbytes
        else:
            tensor.raw_data = np.ascontiguousarray(array).tobytes()
        self.inits.append(tensor)
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        return self.const(name, np.asarray(array, dtype=self.dtype))

    def scalar(self, name: str, value: float) -> str:
        return self.const(name, np.array(value, dtype=self.dtype))

    def ints(self, name: str, values: list[int]) -> str:
        return self.const(name, np.array(values, dtype=np.int64))

    def close(self) -> None:
        if self._data_file is not None:
            self._data_file.close()
            self._data_file = None


def _np_to_onnx(dtype: np.dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype in _ONNX_DTYPE:
        return _ONNX_DTYPE[dtype]
    return {np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32}[dtype]


def build_decoder(spec: DecoderSpec, weights: dict[str, np.ndarray], out_path: Path, *,
                  dtype: np.dtype = np.float32, untie_lm_head: bool = False, attention: str = "standard",
                  max_context: int = 2048, io: ModelIO = ModelIO(),
                  on_layer: Callable[[int], None] | None = None) -> list[Path]:
    """Write ``out_path`` (.onnx) and its external data; return the files written.

    ``weights`` uses the canonical names of :mod:`specedge.export.weights`
    (``embed``, ``layers.{i}.q`` with shape [in, out], ...). ``untie_lm_head``
    writes a separate [hidden, vocab] MatMul weight for tied models, so the
    weight-only quantizer (which rewrites MatMul nodes) can reach the output layer. ``io`` names
    the graph's inputs and outputs: pass the ModelIO the manifest entry records. ``on_layer(n)`` is
    called after each layer is written, with the number written so far (progress).
    """
    dtype = np.dtype(dtype)
    data_path = out_path.with_name(out_path.name + ".data")
    b = _Builder(dtype=dtype, data_path=data_path, io=io)
    try:
        graph = _decoder_graph(b, spec, weights, untie_lm_head, attention, max_context, on_layer)
        opsets = [helper.make_opsetid("", OPSET)]
        if attention == "gqa":
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="specedge")
        model.ir_version = 8  # readable by every ORT >= 1.14
        onnx.save_model(model, str(out_path))
    finally:
        b.close()
    return [out_path] + ([data_path] if data_path.exists() else [])


def _decoder_graph(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], untie_lm_head: bool,
                   attention: str = "standard", max_context: int = 2048,
                   on_layer: Callable[[int], None] | None = None) -> onnx.GraphProto:
    kv_type = _ONNX_DTYPE[b.dtype]
    io = b.io
    inputs = [
        helper.make_tensor_value_info(io.input_ids, TensorProto.INT64, [1, "new_tokens"]),
        helper.make_tensor_value_info(io.positions, TensorProto.INT64, [1, "new_tokens"]),
        helper.make_tensor_value_info(io.num_logits, TensorProto.INT64, [1]),
    ]
    outputs = [helper.make_tensor_value_info(io.logits, TensorProto.FLOAT, [1, "num_logits", s.vocab_size])]
    gqa = attention == "gqa"
    if gqa:
        inputs += [helper.make_tensor_value_info(io.seqlens_k, TensorProto.INT32, [1]),
                   helper.make_tensor_value_info(io.total_sequence_length, TensorProto.INT32, [])]
    for i in range(s.n_layers):
        for past, present, new in ((io.past_key, io.present_key, io.new_key),
                                   (io.past_value, io.present_value, io.new_value)):
            if gqa:
                shape = [1, s.n_kv_heads, "max_len", s.head_dim]
                inputs.append(helper.make_tensor_value_info(past % i, kv_type, shape))
                outputs.append(helper.make_tensor_value_info(present % i, kv_type, shape))
            else:
                inputs.append(helper.make_tensor_value_info(past % i, kv_type, ["past_len", s.n_kv_heads, s.head_dim]))
                outputs.append(helper.make_tensor_value_info(new % i, kv_type,
                                                             ["new_tokens", s.n_kv_heads, s.head_dim]))

    pos = b.one("Reshape", [io.positions, b.ints("shape_flat2", [-1])])  # [n]
    embed = b.weight(EMBEDDING_TABLE, w["embed"])
    # The fused GQA graph keeps activations [1, n, hidden] end to end, the shape GroupQueryAttention
    # and SkipSimplifiedLayerNormalization take: no Reshape around every attention call.
    ids = io.input_ids if gqa else b.one("Reshape", [io.input_ids, b.ints("shape_flat", [-1])])  # [1, n] / [n]
    x = b.one("Gather", [embed, ids], axis=0)  # [1, n, hidden] (gqa) / [n, hidden]
    if s.embed_scale != 1.0:
        # In the graph's dtype, as transformers scales in the weights' dtype (Gemma's normalizer).
        x = b.one("Mul", [x, b.scalar("embed_scale", s.embed_scale)])
    if s.max_positions:
        x = b.one("Add", [x, b.one("Gather", [b.weight("pos_embed", w["pos_embed"]), pos], axis=0)])
    attend = _GqaAttention(b, s, pos, max_context) if gqa else _StandardAttention(b, s, pos)
    # Contrib ops (com.microsoft) are in the gqa graph's opset already: its residual adds fuse
    # into the next RMSNorm (SkipSimplifiedLayerNormalization), which ORT's optimizer does not do
    # for a sum that is also the next residual.
    fuse = _Fusion(skip_norm=gqa and s.norm == "rms" and b.dtype == np.float32)
    pending = None  # the last block's output, not yet added to the residual stream
    for i in range(s.n_layers):
        x, pending = _layer(b, s, w, i, x, pending, attend, fuse)
        if on_layer is not None:
            on_layer(i + 1)
    x, normed = _add_norm(b, s, w, x, pending, "norm", fuse)
    return _finish(b, s, w, untie_lm_head, inputs, outputs, (normed, embed), seq_axis=1 if gqa else 0)


@dataclass(frozen=True)
class _Fusion:
    """Which contrib-op fusions the graph writes itself (only graphs that already use com.microsoft ops)."""

    skip_norm: bool = False  # residual Add + RMSNorm -> SkipSimplifiedLayerNormalization


def _used_tables(s: DecoderSpec) -> list[int]:
    return sorted({s.rope(i) for i in range(s.n_layers)} - {-1})


class _StandardAttention:
    """Attention in plain ONNX ops over a position-major cache; rotary and masks computed per step.

    The cached prefix ``past_key/value.i`` [P, kvh, hd] is read in place: it is never
    concatenated with the new rows nor transposed (see ``_past_scores``). Scores against the
    prefix [n, H, P] and against the n new keys [n, H, n] are concatenated instead (a few
    floats per query head and position, not kvh * hd), softmaxed together under one mask,
    and split again at P for the two value products.
    """

    def __init__(self, b: _Builder, s: DecoderSpec, pos: str) -> None:
        self.b, self.s = b, s
        # Causal mask over the cache: key slot j holds position j, so query at position p
        # may attend to slots 0..p. Built once per step per window, shared by its layers.
        n_new = b.one("Gather", [b.one("Shape", [b.io.input_ids]), b.ints("one_idx", [1])])  # [1]
        self.past_len = b.one("Gather", [b.one("Shape", [b.io.past_key % 0]), b.ints("zero_idx", [0])])  # [1]
        total = b.one("Squeeze", [b.one("Add", [self.past_len, n_new])])
        key_pos = b.one("Range", [b.const("zero_i", np.array(0, np.int64)), total,
                                  b.const("one_i", np.array(1, np.int64))])  # [T]
        key_row = b.one("Unsqueeze", [key_pos, b.ints("ax0", [0])])  # [1, T]
        query_col = b.one("Unsqueeze", [pos, b.ints("ax1", [1])])  # [n, 1]
        causal = b.one("LessOrEqual", [key_row, query_col])  # [n, T]
        self.masks: dict[int, str] = {}  # window (0 = full) -> additive mask [n, 1, T], fp32 (over heads)
        for window in sorted({s.window(i) for i in range(s.n_layers)}):
            allowed = causal
            if window:
                # Sliding window: the query at position p also drops keys at p - W and earlier.
                lowest = b.one("Sub", [query_col, b.const(b.name("window"), np.array(window, np.int64))])
                allowed = b.one("And", [causal, b.one("Greater", [key_row, lowest])])
            mask = b.one("Where", [allowed, b.const(b.name("zero_f"), np.array(0.0, np.float32)),
                                   b.const(b.name("neg_inf"), np.array(-np.inf, np.float32))])
            self.masks[window] = b.one("Unsqueeze", [mask, b.ints(b.name("ax1m"), [1])])
        # own_head[0, j, 0, j', 0] = (j == j'): keeps each query head's own kv head's block.
        kvh = s.n_kv_heads
        self.own_head = b.weight("own_kv_head", np.eye(kvh).reshape(1, kvh, 1, kvh, 1))
        # cos/sin [n, 1, rotary_dim] per rope table, computed in fp32 for accuracy at long positions.
        self.rope: dict[int, tuple[str, str]] = {}
        tables = s.tables()
        pos_f = b.one("Unsqueeze", [b.one("Cast", [pos], to=TensorProto.FLOAT), b.ints("ax1b", [1])])  # [n, 1]
        for t in _used_tables(s):
            inv_freq = b.const(b.name("inv_freq"), np.asarray(tables[t].inv_freq, np.float32)[None, :])
            freqs = b.one("Mul", [pos_f, inv_freq])  # [n, rd/2]
            emb = b.one("Concat", [freqs, freqs], axis=-1)  # [n, rd]
            scale = b.const(b.name("rope_scale"), np.array(tables[t].scaling, np.float32))
            cos, sin = (b.one("Mul", [b.one(op, [emb]), scale]) for op in ("Cos", "Sin"))
            if b.dtype != np.float32:
                cos, sin = (b.one("Cast", [c], to=_ONNX_DTYPE[b.dtype]) for c in (cos, sin))
            self.rope[t] = tuple(b.one("Unsqueeze", [c, b.ints(b.name("ax1c"), [1])]) for c in (cos, sin))

    def __call__(self, w: dict[str, np.ndarray], i: int, q: str, k: str, v: str) -> str:
        """q [n, H*hd], k/v [n, kvh*hd] (projected) -> attention output [n, H*hd]; writes new_key/value.i."""
        b, s = self.b, self.s
        h, kvh, hd = s.n_heads, s.n_kv_heads, s.head_dim
        kv_type = _ONNX_DTYPE[b.dtype]
        table = s.rope(i)
        rope = self.rope.get(table)
        rd = s.tables()[table].rotary_dim if rope else 0
        q = _heads(b, s, w, f"layers.{i}.q_norm", q, h)
        if rope:
            q = _rotate(b, q, *rope, rd, hd)
        # The new K/V are graph outputs by name (no Identity nodes: ORT keeps those as real copies).
        k = _heads(b, s, w, f"layers.{i}.k_norm", k, kvh, out=None if rope else b.io.new_key % i)
        if rope:
            k = _rotate(b, k, *rope, rd, hd, out=b.io.new_key % i)
        v = b.one("Reshape", [v, b.ints(b.name("v_shape"), [-1, kvh, hd])], out=b.io.new_value % i)

        q = b.one("Mul", [q, b.scalar(b.name("attn_scale"), s.attn_scale)])  # [n, H, hd]
        scores = b.one("Concat", [self._past_scores(i, q), self._new_scores(q, k)], axis=-1)  # [n, H, T]
        if b.dtype != np.float32:
            # Softmax in fp32: fp16 exp() of large score gaps loses the tail mass.
            scores = b.one("Cast", [scores], to=TensorProto.FLOAT)
        if s.attn_softcap:
            scores = _softcap(b, scores, s.attn_softcap)  # before the mask, as transformers does
        probs = b.one("Softmax", [b.one("Add", [scores, self.masks[s.window(i)]])], axis=-1)  # [n, H, T]
        if b.dtype != np.float32:
            probs = b.one("Cast", [probs], to=kv_type)
        # The probabilities split back at P: the small [n, H, T] rows are cut, never the cache.
        past_probs = b.one("Slice", [probs, b.ints(b.name("zero"), [0]), self.past_len, b.ints(b.name("ax2"), [2])])
        new_probs = b.one("Slice", [probs, self.past_len, b.ints(b.name("int_max"), [np.iinfo(np.int64).max]),
                                    b.ints(b.name("ax2"), [2])])
        attn = b.one("Add", [self._past_mix(i, past_probs), self._new_mix(new_probs, v)])  # [n, kvh, g, hd]
        return b.one("Reshape", [attn, b.ints(b.name("a_flat"), [0, h * hd])])  # [n, H*hd]

    def _past_scores(self, i: int, q: str) -> str:
        """Scaled q [n, H, hd] against the cached keys, read in place -> scores [n, H, P].

        ``past_key.i`` [P, kvh, hd] is viewed as [P, kvh*hd] (a Reshape: no copy) and each
        query row is spread over kvh*hd columns, zero outside its own kv head's hd columns,
        so one MatMul against that view's transpose (a last-two-axes Transpose, which ORT
        fuses into the GEMM as transB and TensorRT into its matrix op) gives every head's
        scores. The zeros cost kvh-fold multiply-adds on the prefix; a per-head MatMul
        would instead need the prefix copied head-major (the Concat + Transpose this replaces).
        """
        b, s = self.b, self.s
        kvh, hd = s.n_kv_heads, s.head_dim
        if kvh > 1:
            q = b.one("Mul", [b.one("Reshape", [q, b.ints(b.name("q_grp"), [0, kvh, s.n_heads // kvh, 1, hd])]),
                              self.own_head])  # [n, kvh, g, kvh, hd]
            q = b.one("Reshape", [q, b.ints(b.name("q_spread"), [0, s.n_heads, kvh * hd])])  # [n, H, kvh*hd]
        # 0 copies P, also an empty prefill past, where a -1 would have to be inferred from 0 elements.
        keys = b.one("Reshape", [b.io.past_key % i, b.ints(b.name("kv_rows"), [0, kvh * hd])])  # [P, kvh*hd]
        return b.one("MatMul", [q, b.one("Transpose", [keys], perm=[1, 0])])  # [n, H, P]

    def _past_mix(self, i: int, probs: str) -> str:
        """probs [n, H, P] over the cached values, read in place -> [n, kvh, g, hd].

        ``past_value.i`` viewed as [P, kvh*hd]: one MatMul mixes every head's values for
        every query head ([n, H, kvh*hd]); each query head keeps its own kv head's block.
        """
        b, s = self.b, self.s
        kvh, hd = s.n_kv_heads, s.head_dim
        values = b.one("Reshape", [b.io.past_value % i, b.ints(b.name("kv_rows"), [0, kvh * hd])])  # [P, kvh*hd]
        mixed = b.one("MatMul", [probs, values])  # [n, H, kvh*hd]
        if kvh == 1:
            return b.one("Reshape", [mixed, b.ints(b.name("mix"), [0, 1, s.n_heads, hd])])  # [n, 1, g, hd]
        mixed = b.one("Reshape", [mixed, b.ints(b.name("mix"), [0, kvh, s.n_heads // kvh, kvh, hd])])
        # Adding the other heads' zeroed blocks is exact: x + 0 == x.
        return b.one("ReduceSum", [b.one("Mul", [mixed, self.own_head]), b.ints(b.name("ax3"), [3])],
                     keepdims=0)  # [n, kvh, g, hd]

    def _new_scores(self, q: str, k: str) -> str:
        """Scaled q [n, H, hd] against the new keys k [n, kvh, hd], per kv head -> scores [n, H, n].

        Only the n new rows are transposed here (a copy of n rows, not of the prefix).
        """
        b, s = self.b, self.s
        kvh, g, hd = s.n_kv_heads, s.n_heads // s.n_kv_heads, s.head_dim
        # GQA without repeating K: query head h uses kv head h // g, so view the queries as
        # [kvh, g, n, hd] and broadcast the keys over the group axis.
        q = b.one("Transpose", [b.one("Reshape", [q, b.ints(b.name("q_grp"), [0, kvh, g, hd])])],
                  perm=[1, 2, 0, 3])  # [kvh, g, n, hd]
        k_t = b.one("Unsqueeze", [b.one("Transpose", [k], perm=[1, 2, 0]), b.ints(b.name("ax"), [1])])  # [kvh,1,hd,n]
        scores = b.one("Transpose", [b.one("MatMul", [q, k_t])], perm=[2, 0, 1, 3])  # [n, kvh, g, n]
        return b.one("Reshape", [scores, b.ints(b.name("s_heads"), [0, s.n_heads, -1])])  # [n, H, n]

    def _new_mix(self, probs: str, v: str) -> str:
        """probs [n, H, n] over the new values v [n, kvh, hd], per kv head -> [n, kvh, g, hd]."""
        b, s = self.b, self.s
        kvh, g, hd = s.n_kv_heads, s.n_heads // s.n_kv_heads, s.head_dim
        probs = b.one("Transpose", [b.one("Reshape", [probs, b.ints(b.name("p_grp"), [0, kvh, g, -1])])],
                      perm=[1, 2, 0, 3])  # [kvh, g, n, n]
        v_t = b.one("Unsqueeze", [b.one("Transpose", [v], perm=[1, 0, 2]), b.ints(b.name("ax"), [1])])  # [kvh,1,n,hd]
        return b.one("Transpose", [b.one("MatMul", [probs, v_t])], perm=[2, 0, 1, 3])  # [n, kvh, g, hd]


# ORT's GroupQueryAttention rotates inside the op only when its cos/sin cache width
# (rotary_dim / 2) is a multiple of 8 (ORT 1.32 refuses others at run time: "cos_cache dimension 1
# must be <= head_size / 2 and a multiple of 8"); other rotary dims rotate before the op.
_GQA_ROTARY_MULTIPLE = 8


class _GqaAttention:
    """Attention through ORT's fused GroupQueryAttention over a [1, kvh, max_context, hd] cache."""

    def __init__(self, b: _Builder, s: DecoderSpec, pos: str, max_context: int) -> None:
        self.b, self.s, self.max_context = b, s, max_context
        self.fused: dict[int, tuple[str, str]] = {}  # table -> (cos_cache, sin_cache) [max_context, rd/2]
        self.outside: dict[int, tuple[str, str]] = {}  # table -> (cos, sin) [n, 1, rd], gathered by position
        positions = np.arange(max_context, dtype=np.float64)[:, None]
        tables = s.tables()
        for n, t in enumerate(_used_tables(s)):
            table = tables[t]
            # Rotary tables for every position the cache can hold, in fp64 then cast. The first is named
            # cos_cache / sin_cache: manifest.POSITION_TABLES reads its row count as the graph's position limit.
            cos_name, sin_name = ("cos_cache", "sin_cache") if n == 0 else (f"cos_cache.{t}", f"sin_cache.{t}")
            angles = positions * np.asarray(table.inv_freq, np.float64)[None, :]  # [max_context, rd/2]
            if (table.rotary_dim // 2) % _GQA_ROTARY_MULTIPLE == 0:
                self.fused[t] = (b.weight(cos_name, np.cos(angles) * table.scaling),
                                 b.weight(sin_name, np.sin(angles) * table.scaling))
            else:
                angles = np.concatenate([angles, angles], axis=-1)  # [max_context, rd]: rows gathered by position
                self.outside[t] = tuple(
                    b.one("Unsqueeze", [b.one("Gather", [b.weight(name, fn(angles) * table.scaling), pos], axis=0),
                                        b.ints(b.name("ax1r"), [1])])
                    for name, fn in ((cos_name, np.cos), (sin_name, np.sin)))

    def takes_packed(self, w: dict[str, np.ndarray], i: int) -> bool:
        """Whether layer ``i`` can hand GQA the fused q|k|v projection as is (no q/k norm, rope in the op)."""
        return not self.s.qk_norm and self.s.rope(i) not in self.outside

    def packed(self, i: int, qkv: str) -> str:
        """qkv [1, n, (H + 2 kvh) hd] -> attention output [1, n, H*hd]; GQA splits and rotates internally."""
        return self._attend(i, qkv, "", "")

    def __call__(self, w: dict[str, np.ndarray], i: int, q: str, k: str, v: str) -> str:
        """q [1, n, H*hd], k/v [1, n, kvh*hd] (projected) -> attention output [1, n, H*hd]; writes present_key/value.i."""
        b, s = self.b, self.s
        h, kvh, hd = s.n_heads, s.n_kv_heads, s.head_dim
        table = s.rope(i)
        outside = self.outside.get(table)
        if outside or f"layers.{i}.q_norm" in w and s.qk_norm == "head":
            q = _heads(b, s, w, f"layers.{i}.q_norm", q, h)
            k = _heads(b, s, w, f"layers.{i}.k_norm", k, kvh)
            if outside:
                rd = s.tables()[table].rotary_dim
                q, k = _rotate(b, q, *outside, rd, hd), _rotate(b, k, *outside, rd, hd)
            q, k, v = (b.one("Reshape", [t, b.ints(b.name("bnd"), [1, -1, width])])
                       for t, width in ((q, h * hd), (k, kvh * hd), (v, kvh * hd)))  # [1, n, *]
        return self._attend(i, q, k, v)

    def _attend(self, i: int, q: str, k: str, v: str) -> str:
        """GroupQueryAttention on [1, n, *] inputs (k = v = "": q is the packed q|k|v)."""
        b, s = self.b, self.s
        h, kvh = s.n_heads, s.n_kv_heads
        table = s.rope(i)
        # ORT's local_window_size is the number of keys a query sees, its own included: transformers'
        # window W exactly (W - 1 failed validation at the first step past the window).
        # A window that covers the whole cache is no window.
        window = s.window(i)
        attrs = {"local_window_size": window} if 0 < window < self.max_context else {}
        if s.attn_softcap:
            attrs["softcap"] = s.attn_softcap
        rope_inputs: list[str] = []
        if table in self.fused:
            rope_inputs = list(self.fused[table])
            attrs.update(do_rotary=1, rotary_interleaved=0)
        attn = b.node("GroupQueryAttention",
                      [q, k, v, b.io.past_key % i, b.io.past_value % i, b.io.seqlens_k, b.io.total_sequence_length,
                       *rope_inputs],
                      n_out=1, domain="com.microsoft", num_heads=h, kv_num_heads=kvh, scale=s.attn_scale, **attrs)[0]
        # GQA's 2nd/3rd outputs are the shared cache buffers; name them as graph outputs.
        b.nodes[-1].output.extend([b.io.present_key % i, b.io.present_value % i])
        return attn  # [1, n, H*hd]


def _layer(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], i: int, x: str, pending: str | None, attend,
           fuse: _Fusion) -> tuple[str, str]:
    """One decoder layer: the residual stream x [n, hidden] (gqa: [1, n, hidden]) plus ``pending``, the
    previous layer's block output not yet added to it (None before layer 0) -> (stream, this layer's
    pending output). Deferring the add lets it fuse into the next norm. Norms present in ``w`` are
    applied (see DecoderSpec)."""
    p = f"layers.{i}"
    h, kvh, hd = s.n_heads, s.n_kv_heads, s.head_dim
    x, normed = _add_norm(b, s, w, x, pending, f"{p}.attn_norm", fuse)
    qkv = _linear(b, normed, w, f"{p}.qkv")  # fused q|k|v: one GEMM instead of three
    if isinstance(attend, _GqaAttention) and attend.takes_packed(w, i):
        attended = attend.packed(i, qkv)  # GroupQueryAttention splits q|k|v itself: no Split node
    else:
        q, k, v = b.node("Split", [qkv, b.ints(b.name("qkv_split"), [h * hd, kvh * hd, kvh * hd])], n_out=3,
                         axis=-1)
        if s.qk_norm == "full":  # OLMo 2: over the whole projection, before the heads are split
            q = _maybe_norm(b, s, w, q, f"{p}.q_norm")
            k = _maybe_norm(b, s, w, k, f"{p}.k_norm")
        attended = attend(w, i, q, k, v)
    attn = _maybe_norm(b, s, w, _linear(b, attended, w, f"{p}.o"), f"{p}.attn_post_norm")
    if s.parallel_residual:
        mlp = _mlp(b, s, w, p, _maybe_norm(b, s, w, x, f"{p}.mlp_norm"))
        return x, _scaled(b, s, b.one("Add", [attn, mlp]))
    x, normed = _add_norm(b, s, w, x, _scaled(b, s, attn), f"{p}.mlp_norm", fuse)
    return x, _scaled(b, s, _mlp(b, s, w, p, normed))


def _scaled(b: _Builder, s: DecoderSpec, branch: str) -> str:
    """A block's output as it joins the residual stream (Granite's residual_multiplier)."""
    if s.residual_scale != 1.0:
        branch = b.one("Mul", [branch, b.scalar(b.name("residual_scale"), s.residual_scale)])
    return branch


def _add_norm(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], x: str, branch: str | None, key: str,
              fuse: _Fusion) -> tuple[str, str]:
    """(x + branch, norm ``key`` of that sum); branch None adds nothing, a norm absent from ``w`` is the identity.

    With ``fuse.skip_norm`` an RMSNorm with a [hidden] weight takes the add with it: one
    SkipSimplifiedLayerNormalization whose 4th output is the sum (the residual stream).
    """
    weight = w.get(key)
    if branch is not None and fuse.skip_norm and weight is not None and weight.ndim == 1:
        out = b.node("SkipSimplifiedLayerNormalization", [x, branch, b.weight(f"{key}.norm_w", weight)], n_out=4,
                     domain="com.microsoft", epsilon=s.norm_eps)
        b.nodes[-1].output[1] = b.nodes[-1].output[2] = ""  # mean and inv_std_var: not needed
        return out[3], out[0]
    if branch is not None:
        x = b.one("Add", [x, branch])
    return x, _maybe_norm(b, s, w, x, key)


def _mlp(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], p: str, normed: str) -> str:
    """The MLP and its post-norm, if any: [n, hidden] -> [n, hidden]."""
    if s.mlp == "gated":
        # act(gate) * up, from one fused gate|up GEMM: [n, intermediate].
        gate, up = b.node("Split", [_linear(b, normed, w, f"{p}.gate_up"),
                                    b.ints(b.name("gu_split"), [s.intermediate_size] * 2)], n_out=2, axis=-1)
        hidden = b.one("Mul", [_activate(b, s.activation, gate), up])
    else:
        hidden = _activate(b, s.activation, _linear(b, normed, w, f"{p}.fc"))
    return _maybe_norm(b, s, w, _linear(b, hidden, w, f"{p}.down"), f"{p}.mlp_post_norm")


def _heads(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], norm_key: str, t: str, n_heads: int,
           out: str | None = None) -> str:
    """[n, heads*hd] -> [n, heads, hd], with the per-head q/k norm when the spec has one."""
    per_head = s.qk_norm == "head" and norm_key in w
    t = b.one("Reshape", [t, b.ints(b.name("heads"), [-1, n_heads, s.head_dim])], out=None if per_head else out)
    return _norm(b, s, w, t, norm_key, out=out) if per_head else t


def _finish(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], untie_lm_head: bool, inputs: list,
            outputs: list, normed_and_embed: tuple[str, str], seq_axis: int = 0) -> onnx.GraphProto:
    """Keep the last num_logits positions of the final-normed hidden states, output layer, logit scaling
    and soft-capping. ``seq_axis``: 0 for [n, hidden] activations, 1 for [1, n, hidden]."""
    x, embed = normed_and_embed
    keep = b.one("Neg", [b.io.num_logits])
    x = b.one("Slice", [x, keep, b.ints("int_max", [np.iinfo(np.int64).max]),
                        b.ints("ax0s", [seq_axis])])  # [m, hidden] / [1, m, hidden]
    batched = seq_axis == 1  # MatMul keeps the leading 1: logits come out [1, m, vocab], no Unsqueeze
    if s.tied_embeddings and not untie_lm_head:
        # Gemm with transB reads the [vocab, hidden] embedding directly: the bundle holds it once.
        # Gemm is 2-D only: a [1, m, hidden] input is flattened first.
        if batched:
            x = b.one("Reshape", [x, b.ints("rows_flat", [-1, s.hidden_size])])
            batched = False
        logits = b.one("Gemm", [x, embed], transB=1)
    else:
        lm_head = w["lm_head"] if "lm_head" in w else w["embed"].T
        logits = b.one("MatMul", [x, b.weight("lm_head", lm_head)])
    if b.dtype != np.float32:
        logits = b.one("Cast", [logits], to=TensorProto.FLOAT)
    if s.logit_scale != 1.0:
        logits = b.one("Mul", [logits, b.const("logit_scale", np.array(s.logit_scale, np.float32))])
    if s.final_softcap:
        logits = _softcap(b, logits, s.final_softcap)
    if batched:
        b.nodes[-1].output[0] = b.io.logits  # the last node made the logits; nothing else reads its output
    else:
        b.nodes.append(helper.make_node("Unsqueeze", [logits, b.ints("ax0l", [0])], [b.io.logits], name="logits_out"))
    return helper.make_graph(b.nodes, "specedge_decoder", inputs, outputs, b.inits)


def _softcap(b: _Builder, x: str, cap: float) -> str:
    """cap * tanh(x / cap), on an fp32 tensor."""
    c = b.const(b.name("softcap"), np.array(cap, np.float32))
    return b.one("Mul", [b.one("Tanh", [b.one("Div", [x, c])]), c])


def _maybe_norm(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], x: str, key: str) -> str:
    return _norm(b, s, w, x, key) if key in w else x


def _norm(b: _Builder, s: DecoderSpec, w: dict[str, np.ndarray], x: str, key: str, out: str | None = None) -> str:
    """RMSNorm or LayerNorm over the last axis with weight ``w[key]`` (and ``w[key + '_bias']``).

    A weight with more than one axis ([heads, head_dim], StableLM's per-head q/k norms) scales
    after a unit-scale normalisation, as ONNX's LayerNormalization takes a last-axis scale only.
    """
    weight, bias = w[key], w.get(f"{key}_bias")
    if s.norm == "layer":
        width = weight.shape[-1]
        per_head = weight.ndim > 1
        scale = b.weight(f"{key}.ln_w", np.ones(width) if per_head else weight)
        if bias is None:
            bias = np.zeros(width)
        y = b.one("LayerNormalization", [x, scale, b.weight(f"{key}.ln_b", bias)], axis=-1, epsilon=s.norm_eps,
                  out=None if per_head else out)
        return b.one("Mul", [y, b.weight(f"{key}.ln_heads", weight)], out=out) if per_head else y
    # RMSNorm, written so ORT's optimizer fuses it into SimplifiedLayerNormalization.
    # Computed in fp32 even for fp16 graphs: the mean of squares overflows fp16.
    xf = b.one("Cast", [x], to=TensorProto.FLOAT) if b.dtype != np.float32 else x
    # Pow(x, 2) (not Mul(x, x)) is the pattern ORT's SimplifiedLayerNormFusion matches.
    var = b.one("ReduceMean", [b.one("Pow", [xf, b.const(b.name("two"), np.array(2.0, np.float32))]),
                               b.ints(b.name("axes"), [-1])], keepdims=1)
    eps = b.const(b.name("eps"), np.array(s.norm_eps, np.float32))
    normed = b.one("Div", [xf, b.one("Sqrt", [b.one("Add", [var, eps])])])
    if b.dtype != np.float32:
        normed = b.one("Cast", [normed], to=_ONNX_DTYPE[b.dtype])
    if bias is not None:
        raise ValueError(f"{key}: RMSNorm takes no bias")
    return b.one("Mul", [normed, b.weight(f"{key}.norm_w", weight)], out=out)


def _linear(b: _Builder, x: str, w: dict[str, np.ndarray], key: str) -> str:
    y = b.one("MatMul", [x, b.weight(key, w[key])])
    if f"{key}_bias" in w:
        y = b.one("Add", [y, b.weight(f"{key}_bias", w[f"{key}_bias"])])
    return y


def _rotate(b: _Builder, t: str, cos: str, sin: str, rotary_dim: int, head_dim: int, out: str | None = None) -> str:
    """HF rotary on [n, heads, head_dim]: the first rotary_dim channels r become r cos + rotate_half(r) sin
    (rotate_half(r) = [-r2, r1]); the rest pass through (partial rotary)."""
    half = rotary_dim // 2
    rest = None
    if rotary_dim < head_dim:
        t, rest = b.node("Split", [t, b.ints(b.name("rot_split"), [rotary_dim, head_dim - rotary_dim])], n_out=2,
                         axis=-1)
    t1, t2 = b.node("Split", [t, b.ints(b.name("split"), [half, half])], n_out=2, axis=-1)
    rotated = b.one("Concat", [b.one("Neg", [t2]), t1], axis=-1)
    y = b.one("Add", [b.one("Mul", [t, cos]), b.one("Mul", [rotated, sin])], out=None if rest else out)
    return b.one("Concat", [y, rest], axis=-1, out=out) if rest else y


def _activate(b: _Builder, name: str, x: str) -> str:
    """transformers' ACT2FN[name] (export/features.ACTIVATIONS), in opset-18 ops."""
    if name == "silu":
        return b.one("Mul", [x, b.one("Sigmoid", [x])])
    if name == "relu":
        return b.one("Relu", [x])
    if name == "gelu":  # exact: 0.5 x (1 + erf(x / sqrt 2))
        erf = b.one("Erf", [b.one("Mul", [x, b.scalar(b.name("c"), float(1 / np.sqrt(2.0)))])])
        return b.one("Mul", [b.one("Mul", [x, b.scalar(b.name("half"), 0.5)]),
                             b.one("Add", [erf, b.scalar(b.name("one"), 1.0)])])
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return _gelu_tanh(b, x)
    raise ValueError(f"activation {name!r} has no graph (export/features.py refuses it first)")


def _gelu_tanh(b: _Builder, x: str) -> str:
    """gelu_new / gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    cube = b.one("Mul", [b.one("Mul", [x, x]), x])
    inner = b.one("Mul", [b.one("Add", [x, b.one("Mul", [cube, b.scalar(b.name("c"), 0.044715)])]),
                          b.scalar(b.name("c"), float(np.sqrt(2.0 / np.pi)))])
    return b.one("Mul", [b.one("Mul", [x, b.scalar(b.name("half"), 0.5)]),
                         b.one("Add", [b.one("Tanh", [inner]), b.scalar(b.name("one"), 1.0)])])
