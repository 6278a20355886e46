"""Per-tensor weight quantization for float checkpoints, chosen like llama.cpp's K-quant mixes.

A float source used to be rounded one way everywhere: symmetric int4 blocks of 32, the output
head and the embedding included. This module gives each graph weight its own form
(:class:`TensorQuant`): bits (4 or 8), elements per block, symmetric or asymmetric, and whether
each block's scale is searched. A *mix* (:data:`MIXES`) maps the graph's weight names
(``layers.3.qkv``, ``layers.3.down``, ``lm_head``, ``embed``: export/families/base.py) to forms.

The forms are the ones ONNX Runtime's CPU kernels run without a slow path:

* **asymmetric int4**: ``w = scale * (q - zp)`` with ``q`` and ``zp`` unsigned 4-bit integers
  (``zp`` packed two per byte, MatMulNBits' uint8 ``zero_points``). A float zero point is also
  accepted by the kernel but then dequantizes the whole weight on every call (export/gguf_import.py);
  an integral one runs in the int8-activation kernel (accuracy_level 4) like the symmetric form.
* **symmetric int8**: ``w = scale * (q - 128)``; no zero-point tensor (the kernel's default is 128),
  for the output head and the embedding (GatherBlockQuantized, bits=8).
* **searched scales** (``search``): for each block a few candidate ranges are tried
  (:data:`SEARCH_STEPS`), each rounded, its scale refitted by least squares with the integers
  fixed, and the one with the smallest squared error kept: a data-free relative of llama.cpp's
  ``make_qkx2_quants`` and of HQQ's zero-point optimisation, constrained to integral zero points.
  Weighting each element by ``rms(block) + |w_i|`` (llama.cpp's choice without an importance matrix)
  was measured worse on SmolLM2 (docs/results/2026-12-06-float-quantization.md), so errors weigh alike.
* **importance-weighted search** (``weighted``, the ``-imatrix`` mixes): each element's squared error
  weighted by its input channel's activation importance (export/importance.py), llama.cpp's importance
  matrix. Measured (docs/results/2026-12-07-shared-head-imatrix.md): SmolLM2's perplexity ratio
  1.049 -> 1.025, but Qwen2.5-Coder-0.5B's 1.041 -> 1.054, so it is offered by name, not by default.
* **error feedback** (``gptq``, the ``-gptq`` mixes, the default): the input channels are rounded one
  at a time and each one's rounding error is pushed onto the channels not yet rounded, weighted by the inputs'
  second moment ``H = E[x xᵀ]`` over calibration tokens, so that the *output* error ``x · (w - ŵ)``
  stays small rather than each weight's own (GPTQ, Frantar et al. 2022, in its lazy-batch form with
  per-block scales fixed when a block's first channel is reached). A block's scale and zero point
  are searched as above on the updated weights, weighted by ``diag(H)``. Measured
  (docs/results/2026-12-07-gptq.md): the mean KL divergence from the source 30% lower on SmolLM2 and 25%
  lower on Qwen2.5-Coder-0.5B than the same forms searched unweighted.

numpy (and torch, the export extra, for one factorization where it is installed); export/rtn.py writes
the results into the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import InvalidParameterError
from .scales import to_half

# Candidate ranges per block for a searched scale: the min/max range divided by (levels - 1 + d)
# for d in this grid. d < 0 widens the step (clips nothing, coarser); d > 0 narrows it (clips the
# extremes, finer for the bulk). llama.cpp's make_qkx2_quants walks a similar window of about one level.
SEARCH_STEPS = tuple(np.round(np.arange(-0.5, 2.01, 0.1), 2))
_ROWS_PER_CHUNK = 1024  # output rows quantized at once (bounds the search's temporaries)
IMPORTANCE_FLOOR = 0.01  # added to each channel's mean-normalised importance (_element_weights says why)

# The token embedding's initializer name in our graphs (export/graph.py): the one constant-table lookup the
# quantizers may quantize (the rotary cos/sin caches and learned position tables are gathered too, and stay
# float: they are small, and positions are where rounding hurts most).
EMBEDDING_TABLE = "embed"


@dataclass(frozen=True)
class TensorQuant:
    """How one graph weight is stored.

    ``bits``: 4 or 8; ``block``: elements of the input axis per scale (a power of two >= 16);
    ``symmetric``: no zero points (4 bits: zp 8, 8 bits: zp 128, the kernels' defaults);
    ``search``: each block's scale (and zero point) minimises the block's squared error over
    :data:`SEARCH_STEPS` candidate ranges instead of taking the min/max range; ``weighted`` (with
    ``search``): that error is weighted by each input channel's activation importance
    (export/importance.py), llama.cpp's importance matrix; ``gptq`` (with ``weighted``): the channels are
    rounded in order with error feedback through the inputs' second moment (:func:`_gptq`).
    """

    bits: int
    block: int
    symmetric: bool
    search: bool = False
    weighted: bool = False
    gptq: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise InvalidParameterError(f"bits must be 4 or 8; got {self.bits}")
        if self.block < 16 or self.block & (self.block - 1):
            raise InvalidParameterError(f"block must be a power of two >= 16; got {self.block}")
        if self.weighted and not self.search:
            raise InvalidParameterError("weighted rounding needs a searched form (search=True)")
        if self.gptq and not self.weighted:
            raise InvalidParameterError("error-feedback rounding needs a weighted form (weighted=True)")

    @property
    def method(self) -> str:
        """The manifest's name for how blocks were chosen (bundle/extra.py QuantizedTensor.method)."""
        return "gptq" if self.gptq else "imatrix" if self.weighted else "search" if self.search else "rtn"


@dataclass(frozen=True)
class Blocks:
    """A weight ``[N, K]`` (N outputs, K the input axis) as ``scales * (q - zero_points)`` per block.

    ``q``: [N, K/block, block] uint8 in 0..2**bits-1; ``scales``: [N, K/block] float32 (values float16 holds,
    export/scales.py, where the weights allow);
    ``zero_points``: [N, K/block] uint8 (the symmetric default 2**(bits-1) when symmetric).
    """

    q: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    bits: int
    symmetric: bool

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, as ONNX Runtime reads the blocks."""
        w = self.scales[..., None] * (self.q.astype(np.float32) - self.zero_points[..., None].astype(np.float32))
        return w.reshape(w.shape[0], -1)

    def packed(self) -> np.ndarray:
        return pack_blocks(self.q, self.bits)

    def packed_zero_points(self) -> np.ndarray:
        return pack_zero_points(self.zero_points, self.bits)


def pack_blocks(q: np.ndarray, bits: int) -> np.ndarray:
    """``q`` [N, K/block, block] uint8 levels -> [N, K/block, block*bits/8] uint8: MatMulNBits' B (4 bits:
    element 2j in the low nibble, 2j+1 in the high one). The one definition of the nibble order."""
    if bits == 8:
        return np.ascontiguousarray(q)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))


def pack_zero_points(zero_points: np.ndarray, bits: int) -> np.ndarray:
    """``zero_points`` [N, K/block] uint8 -> [N, ceil(K/block * bits / 8)] uint8: MatMulNBits' (and
    GatherBlockQuantized's) zero_points (4 bits: block 2j in the low nibble; an odd count padded with 0)."""
    if bits == 8:
        return np.ascontiguousarray(zero_points)
    if zero_points.shape[1] % 2:
        zero_points = np.concatenate([zero_points, np.zeros((zero_points.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray(zero_points[:, 0::2] | (zero_points[:, 1::2] << 4))


def quantize(weight: np.ndarray, form: TensorQuant, importance: np.ndarray | None = None) -> Blocks:
    """``weight`` [N, K] float32 (rows are outputs) as blocks of ``form``; K is zero-padded to a multiple of
    the block, as ONNX Runtime's quantizer pads it (``dequantize()`` then has the padded width).

    ``importance`` [K] (export/importance.py: the mean square of each input channel over calibration
    tokens): a searched form then minimises each block's squared error weighted by it, so the channels
    that carry the activations' energy are rounded finest. Unsearched forms ignore it. For a ``gptq``
    form ``importance`` is the inputs' second moment [K, K] instead (its diagonal is the importance).
    """
    n, k = weight.shape
    if form.gptq and importance is not None and np.ndim(importance) == 2:
        return _gptq(np.asarray(weight, np.float32), form, importance)
    weights = None if importance is None or not form.search else _element_weights(importance, k)
    if k % form.block:
        pad = form.block - k % form.block
        weight = np.pad(np.asarray(weight, np.float32), ((0, 0), (0, pad)))
        weights = None if weights is None else np.pad(weights, (0, pad))
        k = weight.shape[1]
    if weights is not None:
        weights = weights.reshape(k // form.block, form.block)
    parts = [_quantize_rows(np.asarray(weight[i:i + _ROWS_PER_CHUNK], np.float32).reshape(-1, k // form.block,
                                                                                           form.block), form, weights)
             for i in range(0, n, _ROWS_PER_CHUNK)]
    return Blocks(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                  np.concatenate([p[2] for p in parts]), form.bits, form.symmetric)


# GPTQ's dampening: this fraction of the mean diagonal is added to H's diagonal before it is inverted. H
# from a few thousand calibration tokens is singular in the directions they never visit; the paper's 1%
# keeps the feedback from chasing those (a channel that was silent gets no error pushed onto it).
GPTQ_DAMP = 0.01
# Channels rounded between two full updates of the channels after them (the paper's lazy batch: the same
# arithmetic, regrouped so most of it is one matrix product).
GPTQ_BATCH = 128
# Round the loudest channels first, every block's scale fixed from the source weights (the paper's act-order
# with static groups). Off: measured worse on Qwen2.5-Coder-0.5B (KL 0.0224 against 0.0213) and on SmolLM2 at
# the default mix's bits (0.120 against 0.0925), docs/results/2026-12-07-gptq.md; kept for the experiment script.
GPTQ_ACT_ORDER = False


def _gptq(weight: np.ndarray, form: TensorQuant, moment: np.ndarray) -> Blocks:
    """``weight`` [N, K] as blocks of ``form``, rounded channel by channel with error feedback.

    ``moment`` [K, K]: E[x xᵀ] of the inputs over calibration tokens. Rounding channel j leaves an error
    ``d`` in each row that the channels not yet rounded can partly cancel in the output ``x · w``: the best
    correction of those channels is ``-(d / U_jj) U_j,>j`` with U the upper Cholesky factor of H⁻¹ (GPTQ).
    Each block's scale and zero point are searched (weighted by diag H) when its first channel comes up,
    on the weights as corrected so far; the block's channels are then rounded with them one by one.
    """
    n, k = weight.shape
    h = np.array(moment, np.float64)
    if h.shape != (k, k):
        raise InvalidParameterError(f"the second moment is {h.shape[0]} x {h.shape[1]}; the weight has {k} inputs")
    block = form.block
    if k % block:  # padded channels are silent: zero weights, no feedback
        pad = block - k % block
        weight = np.pad(weight, ((0, 0), (0, pad)))
        h = np.pad(h, ((0, pad), (0, pad)))
        k = weight.shape[1]
    diag = np.diag(h).copy()
    silent = diag <= 0
    h[silent, silent] = 1.0
    h[np.diag_indices(k)] += GPTQ_DAMP * max(float(diag[~silent].mean()) if (~silent).any() else 1.0, 1e-12)
    element_weights = _element_weights(np.maximum(diag, 0), k).reshape(k // block, block)
    w = np.array(weight, np.float32)
    top = (1 << form.bits) - 1
    q = np.empty((n, k), np.uint8)
    if GPTQ_ACT_ORDER:
        # every block's scale fixed up front from the source weights, then the channels rounded loudest first
        _, scales, zero_points = _quantize_rows(w.reshape(n, k // block, block), form, element_weights)
        order = np.argsort(-diag, kind="stable")
    else:
        scales = np.empty((n, k // block), np.float32)
        zero_points = np.empty((n, k // block), np.uint8)
        order = np.arange(k)
    w = w[:, order]
    h = h[np.ix_(order, order)]
    upper = _inverse_upper_factor(h).astype(np.float32)  # the feedback runs in float32, as the paper's does
    batch = max(GPTQ_BATCH, block)
    for start in range(0, k, batch):
        stop = min(start + batch, k)
        part = w[:, start:stop].copy()
        errors = np.zeros_like(part)
        u = upper[start:stop, start:stop]
        for j in range(stop - start):
            channel = int(order[start + j])
            g = channel // block
            if not GPTQ_ACT_ORDER and channel % block == 0:  # the block's scale, from its corrected weights
                _, s, zp = _quantize_rows(part[:, j:j + block][:, None, :], form, element_weights[g:g + 1])
                scales[:, g], zero_points[:, g] = s[:, 0], zp[:, 0]
            scale = scales[:, g]
            step = np.where(scale > 0, scale, 1.0)
            zp_f = zero_points[:, g].astype(np.float32)
            x = part[:, j]
            level = np.clip(np.rint(x / step) + zp_f, 0, top)
            q[:, channel] = level
            error = (x - scale * (level - zp_f)) / u[j, j]
            part[:, j + 1:] -= np.outer(error, u[j, j + 1:])
            errors[:, j] = error
        w[:, stop:] -= errors @ upper[start:stop, stop:]
    return Blocks(q.reshape(n, k // block, block), scales, zero_points, form.bits, form.symmetric)


def _inverse_upper_factor(h: np.ndarray) -> np.ndarray:
    """The upper-triangular U with H⁻¹ = Uᵀ U (positive diagonal), float64, for a symmetric positive-definite H.

    With J the order reversal, J H J = L Lᵀ (Cholesky) gives H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J), and J L⁻¹ J is
    upper triangular: one factorization and one triangular solve, against an inverse and a factorization. Through
    torch (the export extra) where it is installed: numpy has no triangular solve, and this is 3x faster
    at Qwen-0.5B's MLP width (K = 4864: 3 s against 9 s on 2 cores)."""
    reversed_h = np.ascontiguousarray(h[::-1, ::-1])
    try:
        import torch
    except ImportError:
        return np.linalg.cholesky(np.linalg.inv(h)).T
    lower = torch.linalg.cholesky(torch.from_numpy(reversed_h))
    inverse = torch.linalg.solve_triangular(lower, torch.eye(len(h), dtype=lower.dtype), upper=False)
    return np.ascontiguousarray(inverse.numpy()[::-1, ::-1])


def _element_weights(importance: np.ndarray, k: int) -> np.ndarray:
    """[K] float32 error weights from an importance vector: normalised to mean 1, plus a floor."""
    importance = np.asarray(importance, np.float64).reshape(-1)
    if importance.shape != (k,):
        raise InvalidParameterError(f"importance has {importance.size} channels; the weight has {k}")
    mean = importance.mean()
    relative = importance / mean if mean > 0 else np.ones(k)
    # The floor keeps a channel that was silent on the calibration text from being rounded arbitrarily
    # (another text may use it): at 1% of the mean it never outweighs an active channel.
    return (relative + IMPORTANCE_FLOOR).astype(np.float32)


def _quantize_rows(w: np.ndarray, form: TensorQuant,
                   weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [n, blocks, block] -> (q uint8 [n, blocks, block], scales f32 [n, blocks], zero points uint8 [n, blocks]).

    ``weights`` [blocks, block] (searched forms only): each element's squared error counts this much."""
    ew = np.ones(w.shape[1:], np.float32) if weights is None else weights
    top = (1 << form.bits) - 1
    if form.symmetric:
        # scale = absmax / (2**(bits-1) - 1): q - zp spans -(2**(bits-1)-1)..2**(bits-1)-1, never clips.
        half = (1 << (form.bits - 1))
        zp = np.full(w.shape[:2], half, np.uint8)
        absmax = np.abs(w).max(axis=-1)
        candidates = [absmax / (half - 1 + d) for d in (SEARCH_STEPS if form.search else (0.0,))]
        lo_hi = None
    else:
        # The range always holds 0 (so an all-positive block still has an exact zero and zp in range).
        lo, hi = np.minimum(w.min(axis=-1), 0), np.maximum(w.max(axis=-1), 0)
        candidates = [(hi - lo) / (top + d) for d in (SEARCH_STEPS if form.search else (0.0,))]
        lo_hi = lo
    best_err = best_q = best_s = best_zp = None
    for step in candidates:
        # every scale is one float16 holds (stored at half width, export/scales.py), so the integers are
        # chosen against the scale as stored; rounded up, so that a min/max step still spans its range
        step = to_half(np.where(step > 0, step, 1.0), up=True)
        if lo_hi is not None:
            zp = np.clip(np.rint(-lo_hi / step), 0, top).astype(np.uint8)
        q = np.clip(np.rint(w / step[..., None]) + zp[..., None], 0, top).astype(np.uint8)
        d = q.astype(np.float32) - zp[..., None]
        if form.search:
            # least-squares scale with the integers fixed: argmin_s |w - s*d|^2 = <w,d>/<d,d>
            # (weighted: <w,d>_e / <d,d>_e with the element weights e)
            dd = (ew * d * d).sum(axis=-1)
            s = to_half(np.where(dd > 0, (ew * w * d).sum(axis=-1) / np.where(dd > 0, dd, 1), step))
        else:
            s = step
        err = (ew * (w - s[..., None] * d) ** 2).sum(axis=-1)
        if best_err is None:
            best_err, best_q, best_s, best_zp = err, q, s, zp
            continue
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_q = np.where(better[..., None], q, best_q)
        best_s = np.where(better, s, best_s)
        best_zp = np.where(better, zp, best_zp)
    zero = np.abs(w).max(axis=-1) == 0  # an all-zero block: scale 0 reproduces it exactly
    return best_q, np.where(zero, 0, best_s).astype(np.float32), best_zp.astype(np.uint8)


# --------------------------------------------------------------------------- mixes

Plan = Callable[[str], TensorQuant]


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` layers (Q4_K_M gives their ffn_down and attn_v 6 bits): the first
    and last eighth, and every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _layer(name: str) -> tuple[int, str] | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None


def make_plan(mix: str, n_layers: int, block: int = 32, int8_layer_block: int | None = None) -> Plan:
    """The mix ``mix`` (one of :data:`MIXES`) as a function graph weight name -> :class:`TensorQuant`.

    ``block``: every weight's block size (export --block-size / --tune); ``int8_layer_block`` (default
    ``block``): the block of a ``-more`` mix's 8-bit layer weights instead (:data:`WIDE_INT8_BLOCK` in
    bundles for fast mode). The output head and the embedding keep ``block``: a tied head reads the
    embedding's integers, and GatherBlockQuantized reads only the rows it gathers.
    """
    if mix not in MIXES:
        raise InvalidParameterError(f"unknown quantization mix {mix!r}; known: {', '.join(MIXES)}")
    gptq = mix.endswith(GPTQ)
    weighted = gptq or mix.endswith(IMATRIX)
    # the same forms, searched with importance weights (and rounded with error feedback)
    base = mix[:-len(GPTQ if gptq else IMATRIX)] if weighted else mix
    sym4 = TensorQuant(4, block, True)
    asym4 = TensorQuant(4, block, False, search=base != "asym4-head8-rtn", weighted=weighted, gptq=gptq)
    int8 = TensorQuant(8, block, True)
    int8_layer = TensorQuant(8, int8_layer_block or block, True)

    def plan(name: str) -> TensorQuant:
        if base == "rtn-sym4":
            return sym4
        if base == "asym4":
            return asym4
        if name == "lm_head" or (name == EMBEDDING_TABLE and base != "asym4-head8-embed4"):
            return int8
        where = _layer(name)
        if (base == "asym4-head8-more" and where is not None and where[1] in ("down", "qkv")
                and _more_bits(where[0], n_layers)):
            # Q4_K_M's 6-bit ffn_down and attn_v on these layers; v is fused with q and k here, so the
            # whole q|k|v weight goes up (GQA keeps it small: SmolLM2's is 576 x 960).
            return int8_layer
        return asym4

    return plan


# The block of a -more mix's 8-bit layer weights in a bundle exported for fast mode (not --exact). 256
# levels keep a wide block's rounding far below the int4 weights' (SmolLM2 default mix, KL divergence from
# the source 0.0925 -> 0.0911 nats at block 128), and a step reads 8.25 bits a weight instead of 9. Not for
# exact mode: on ONNX Runtime 1.32's CPU kernels an 8-bit block of 128 (an int4 block of 64) computes
# the odd rows of a 3-, 5-, 7- or 9-row verify apart from a 2-row step's (bit-level differences; block 32
# matches at every length on every CPU measured), so ``export --exact`` keeps the int4 block
# (docs/results/2026-12-07-wide-int8-blocks.md). The head screen's int4 copy takes it too
# (export/head_screen.py): it only ranks tokens.
WIDE_INT8_BLOCK = 128

IMATRIX = "-imatrix"  # a mix whose int4 search is weighted by activation importance ends so
GPTQ = "-gptq"  # a mix whose int4 blocks are rounded with error feedback (and weighted search) ends so

# Mix name -> what it does (export --quant-mix's help lists these).
MIXES = {
    "rtn-sym4": "symmetric int4 min/max blocks everywhere, head and embedding included (ONNX Runtime's quantizer; "
                "the layout before #37)",
    "asym4": "asymmetric int4 blocks with searched scales and integral zero points everywhere",
    "asym4-head8": "asymmetric searched int4 blocks; the output head and the embedding symmetric int8",
    "asym4-head8-rtn": "asym4-head8 with min/max (unsearched) int4 blocks",
    "asym4-head8-embed4": "asymmetric searched int4 blocks, the embedding included; the output head symmetric int8",
    "asym4-head8-more": "asym4-head8, plus int8 ffn down and q|k|v projections on llama.cpp's use_more_bits layers",
    "asym4-head8-imatrix": "asym4-head8 with each int4 block's search weighted by its input channels' activation "
                           "importance on calibration text (llama.cpp's importance matrix)",
    "asym4-head8-more-imatrix": "asym4-head8-more, its int4 search weighted by activation importance",
    "asym4-head8-gptq": "asym4-head8-imatrix, its int4 blocks rounded input channel by input channel with each "
                        "rounding error fed back to the channels after it (GPTQ) through the calibration inputs' "
                        "second moment",
    "asym4-head8-more-gptq": "asym4-head8-more, its int4 blocks rounded with error feedback (GPTQ); the least KL "
                             "divergence from the source measured, at minutes more export time (a quantized draft "
                             "takes asym4-head8-more)",
}
# The least KL divergence from the source per stored bit measured on SmolLM2 and Qwen2.5-Coder-0.5B
# (docs/results/2026-12-07-gptq.md: 0.144 -> 0.0925 and 0.028 -> 0.021 nats against asym4-head8-more at the
# same bytes; docs/results/2026-12-06-float-quantization.md for the mixes before).
DEFAULT_MIX = "asym4-head8-more-gptq"


def draft_mix(mix: str) -> str:
    """The mix a quantized draft takes for ``mix``: the same forms, without a ``-gptq`` mix's error feedback.

    A draft's rounding moves only how often its tokens are accepted (every token is the target's), so it is
    not worth the calibration run and the channel-by-channel rounding (about a minute of SmolLM2's two-minute
    export on 2 cores, and more than the rest of the export on larger models); the target, the user's model,
    gets them."""
    return mix[:-len(GPTQ)] if mix.endswith(GPTQ) else mix
