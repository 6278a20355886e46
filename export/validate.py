"""Check an exported graph against PyTorch before a bundle is written.

Paths compared (as optimum's validator does): a multi-token prefill with an
empty past, a 1-token step on top of that past, and a multi-token (verify-sized)
step on top of a past. Then, for every *edge* below max_context (each sliding-window
length, and the trained context): the cache is filled (in chunks) or rewound to just
before the edge, a verify block straddles it on top of that prefix, and one step
follows. A window or a position rule the graph gets wrong shows only past such an
edge, which a 13-token check never reaches. All run through the real OrtEngine, so
the IO binding, chunked prefill, rewind and cache writes are validated too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..bundle.extra import ComparisonRecord, ExactSteps, ValidationRecord
from ..engines.base import EngineOptions
from ..engines.ort import OrtEngine
from ..errors import ExportValidationError
from ..bundle.manifest import ModelEntry
from .release import release_memory

if TYPE_CHECKING:
    from .graph import DecoderSpec

# fp32 graphs reorder float sums relative to PyTorch; across ~30 layers that moves
# logits by ~1e-5 of their scale. 1e-3 of the scale still catches any real bug
# (a wrong rotary or mask moves logits by O(1)).
FP32_RELATIVE_TOLERANCE = 1e-3
FP16_RELATIVE_TOLERANCE = 3e-2


# Prefill chunk size when filling the cache up to an edge: bounds the attention scores a
# long fill materialises ([heads, chunk, T] floats) and exercises chunked prefill too.
_FILL_CHUNK = 256
# Rows compared at the end of each fill chunk (a chunk's logits for every row would cost
# chunk x vocab floats for nothing: the verify blocks check the edges row by row).
_FILL_ROWS = 2


@dataclass(frozen=True)
class Segment:
    """One forward of the validation run: tokens ``start .. start+length-1`` on a cache of ``start``."""

    name: str
    start: int
    length: int
    compare: int  # the last this many rows are compared with PyTorch

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def rows(self) -> range:
        return range(self.end - self.compare, self.end)


def validation_plan(edges: tuple[int, ...], max_context: int, *, prefill: int = 7,
                    verify: int = 5) -> list[Segment]:
    """The forwards export validation runs, in order (the cache is rewound where a segment starts earlier).

    Always a ``prefill``-token prefill, a 1-token step and a ``verify``-token verify. Then per edge
    e: fill to e - verify // 2 (or rewind to it), a verify block straddling e, one step after it.
    """
    plan = [Segment("prefill", 0, prefill, prefill), Segment("step", prefill, 1, 1),
            Segment("verify", prefill + 1, verify, verify)]
    length = plan[-1].end
    for edge in edges:
        start = min(max(1, edge - verify // 2), max_context - verify - 1)
        while length < start:  # fill the cache in chunks up to the block
            n = min(_FILL_CHUNK, start - length)
            plan.append(Segment(f"prefill chunk to position {length + n - 1}", length, n, min(n, _FILL_ROWS)))
            length += n
        plan.append(Segment(f"verify across edge {edge}", start, verify, verify))
        plan.append(Segment(f"step after edge {edge}", start + verify, 1, 1))
        length = start + verify + 1
    return plan


def _torch_logits(model: Any, ids: np.ndarray, layers: int | None = None,
                  rows: np.ndarray | None = None) -> np.ndarray:
    """PyTorch logits [len(rows) or n, vocab] of one full forward over ``ids`` [n].

    ``layers`` runs only the first that many decoder layers; ``rows`` keeps only those positions'
    logits (a 4k-token reference would otherwise hold 4k x vocab floats).
    """
    import torch

    keep = {} if rows is None else {"logits_to_keep": torch.from_numpy(np.asarray(rows, np.int64))}
    with torch.no_grad(), _first_layers(model, layers):
        return model(torch.from_numpy(ids[None]), use_cache=False, **keep).logits[0].float().numpy()


class _first_layers:
    """Temporarily cut an HF decoder to its first n layers (the early-exit draft's reference)."""

    def __init__(self, model: Any, n: int | None) -> None:
        self.model, self.n = model, n

    def __enter__(self):
        if self.n is not None:
            import torch

            body = self.model.base_model  # model.model, gpt2's transformer, gpt_neox's gpt_neox
            name = "layers" if hasattr(body, "layers") else "h"
            self.saved = (body, name, getattr(body, name), self.model.config.num_hidden_layers)
            setattr(body, name, torch.nn.ModuleList(list(getattr(body, name))[: self.n]))
            self.model.config.num_hidden_layers = self.n
        return self

    def __exit__(self, *exc):
        if self.n is not None:
            body, name, layers, count = self.saved
            setattr(body, name, layers)
            self.model.config.num_hidden_layers = count


def _ort_logits(engine: OrtEngine, ids: np.ndarray, plan: list[Segment]) -> list[np.ndarray]:
    """Run ``plan`` on one cache (rewinding where a segment starts before the cached length)."""
    kv = engine.new_cache()
    out = []
    for seg in plan:
        if kv.length > seg.start:
            kv.rewind(kv.length - seg.start)
        out.append(engine.forward(ids[seg.start:seg.end], kv, num_logits=seg.compare).copy())
    return out


def validate_graph(model: Any, entry: ModelEntry, graph: Path, *, relative_tolerance: float,
                   edges: tuple[int, ...] = (), prefill: int = 7, verify: int = 5, seed: int = 0,
                   strict: bool = True, head_ids: np.ndarray | None = None,
                   layers: int | None = None) -> ValidationRecord:
    """Raise ExportValidationError naming the segment if ORT and PyTorch disagree.

    ``edges``: positions the run must straddle (export/features.validation_edges).
    ``layers`` / ``head_ids``: the graph is an early-exit and/or truncated-head copy; it is
    compared with the first ``layers`` layers of the PyTorch model, at the ``head_ids`` columns.
    """
    plan = validation_plan(edges, entry.max_context, prefill=prefill, verify=verify)
    length = max(seg.end for seg in plan)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, entry.vocab_size, size=length).astype(np.int64)
    positions = np.unique(np.concatenate([np.asarray(seg.rows) for seg in plan]))
    reference = _torch_logits(model, ids, layers, positions)
    if head_ids is not None:
        reference = reference[:, head_ids]
    row_of = {int(p): i for i, p in enumerate(positions)}
    engine = OrtEngine(entry, graph, EngineOptions())
    got = _ort_logits(engine, ids, plan)
    scale = max(1.0, float(np.abs(reference).max()))
    tolerance = relative_tolerance * scale
    diffs, agree, total = {}, 0, 0
    for seg, logits in zip(plan, got):
        ref = reference[[row_of[p] for p in seg.rows]]
        diff = float(np.abs(logits - ref).max())
        diffs[seg.name] = diff
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ref)
        if strict and not diff <= tolerance:  # also catches NaN
            raise ExportValidationError(
                f"logits of the {seg.name} ({seg.length} tokens at positions {seg.start}..{seg.end - 1}) differ "
                f"from PyTorch by {diff:.3g}, above the tolerance {tolerance:.3g} ({relative_tolerance:g} x logit "
                f"scale {scale:.3g}) for {entry.graph}")
    return ValidationRecord(diffs, tolerance, agree / total)


def compare_graphs(entry_a: ModelEntry, graph_a: Path, entry_b: ModelEntry, graph_b: Path, *,
                   n_tokens: int = 64, seed: int = 0) -> ComparisonRecord:
    """Teacher-forced agreement of two graphs (e.g. int4 vs fp32) on a random sequence (``n_tokens``,
    or the whole context where that is shorter)."""
    n_tokens = min(n_tokens, entry_a.max_context, entry_b.max_context)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, entry_a.vocab_size, size=n_tokens).astype(np.int64)
    logits = []
    for entry, graph in ((entry_a, graph_a), (entry_b, graph_b)):
        engine = OrtEngine(entry, graph, EngineOptions())
        logits.append(engine.forward(ids, engine.new_cache(), num_logits=n_tokens).copy())
        del engine  # one session at a time: the next one's weights are not added to this one's
    a, b = logits
    if not np.isfinite(b).all():
        raise ExportValidationError(f"{graph_b.name} produced non-finite logits")
    return ComparisonRecord(top1_agreement=float((a.argmax(-1) == b.argmax(-1)).mean()),
                            max_abs_diff=float(np.abs(a - b).max()))


# Only the tokens near the top of a row can change the argmax: a greedy pick flips between a verify row and
# a 1-row step only where a token in the top of one of them overtakes the other's winner. A screened head
# (export/head_screen.py) leaves every token outside the rescored rows at its int4 copy's logit, and which
# tokens are rescored depends on the row count, so over the whole vocabulary the difference measures the
# screen's tail (Qwen2.5-Coder-1.5B: 1.23 over every token, 0.24 over the top 64 of either row, the
# same 0.24 as the top 16; the top 256 already reach the tail). 64 ranks leave room on flat distributions.
VARIANCE_TOP_TOKENS = 64
# Verify lengths measured (up to the bundle's largest, k + 1, which is measured too): the CPU kernels pick
# their path by the number of rows (2 rows can match a 1-row step where 3..9 do not), so a bound from one
# length would not cover the others.
VARIANCE_VERIFY_LENGTHS = (2, 3, 5, 9)


def batch_variance(entry: ModelEntry, graph: Path, *, max_verify: int = 9, prefix: int = 16, trials: int = 4,
                   top: int = VARIANCE_TOP_TOKENS, seed: int = 1) -> float:
    """Largest logit difference between the rows of a multi-token step and the same tokens one at a time,
    over the tokens ranked in the first ``top`` of either row (the whole row when it is that narrow).

    This is how far the graph is from batch-invariant where it matters: a greedy argmax can only differ
    between speculative and plain decoding where the top-2 gap is below twice this
    (runtime/verify.py ``near_tie_gap``). ``trials`` random prompts of ``prefix`` tokens, each followed
    by a verify of every length of VARIANCE_VERIFY_LENGTHS up to ``max_verify`` (the bundle's largest k + 1),
    and of ``max_verify`` itself, that fits the context.
    """
    lengths = sorted({n for n in VARIANCE_VERIFY_LENGTHS if n < max_verify} | {max(2, max_verify)})
    rng = np.random.default_rng(seed)
    engine = OrtEngine(entry, graph, EngineOptions())
    worst = 0.0
    for _ in range(trials):
        for verify in lengths:
            if prefix + verify > entry.max_context:
                continue
            ids = rng.integers(0, entry.vocab_size, size=prefix + verify).astype(np.int64)
            kv = engine.new_cache()
            engine.forward(ids[:prefix], kv, num_logits=1)
            batched = engine.forward(ids[prefix:], kv, num_logits=verify).astype(np.float64)
            kv.rewind(verify)
            single = np.stack([engine.forward(ids[prefix + i:prefix + i + 1], kv, num_logits=1)[-1].astype(np.float64)
                               for i in range(verify)])
            worst = max(worst, _top_difference(batched, single, top))
    return worst


def _top_difference(a: np.ndarray, b: np.ndarray, top: int) -> float:
    """Max |a - b| per row over the tokens in the first ``top`` of a's row or of b's. ``a``, ``b``: [rows, V]."""
    if top >= a.shape[-1]:
        return float(np.abs(a - b).max())
    cut = a.shape[-1] - top
    ranked = np.concatenate([np.argpartition(a, cut, axis=-1)[:, cut:], np.argpartition(b, cut, axis=-1)[:, cut:]],
                            axis=-1)
    return float(np.abs(np.take_along_axis(a, ranked, -1) - np.take_along_axis(b, ranked, -1)).max())


def steps_match_verify_rows(engine, vocab_size: int, max_context: int, *, max_verify: int = 9, prefix: int = 32,
                            seed: int = 2) -> bool:
    """Whether, on this machine, every verify length 2..``max_verify`` gives rows bit-identical to as
    many 1-token steps through ``engine`` (a :class:`BatchInvariantEngine`), logits and K/V alike.

    Every length, not one: the CPU kernels choose their path by the number of rows, and a verify of
    M rows can round differently from a 2-row step (Qwen2.5-Coder-1.5B block-64 int4 on an AVX-512
    EPYC: 2-token verifies matched, 3..9 did not; block 32 matched at every length).
    """
    rng = np.random.default_rng(seed)
    for verify in range(2, max_verify + 1):
        start = max(1, min(prefix, max_context - verify - 1))  # small contexts (>= 16) still fit
        if start + verify > max_context:
            break
        ids = rng.integers(0, vocab_size, size=start + verify).astype(np.int64)
        kv = engine.new_cache()
        engine.forward(ids[:start], kv)
        rows = engine.forward(ids[start:], kv, num_logits=verify).copy()
        # the positions written, not the whole buffers (an 8B model's cache is 0.27 GB at 1k context)
        rows_kv = [kv.committed(a).copy() for a in kv.keys + kv.values]
        kv.rewind(verify)
        steps = np.stack([engine.forward(ids[start + i:start + i + 1], kv)[0].copy() for i in range(verify)])
        if not (np.array_equal(steps, rows) and all(np.array_equal(kv.committed(a), b)
                                                    for a, b in zip(kv.keys + kv.values, rows_kv))):
            return False
    return True


def exact_steps(entry: ModelEntry, graph: Path, *, max_verify: int = 9, reps: int = 9, seed: int = 2) -> ExactSteps:
    """Check, on this machine, that batch-invariant steps (engines/invariant.py) make a plain step
    bit-identical to a verify row, and measure what they cost.

    Returns an :class:`ExactSteps` (bit_identical, two_row_step_cost, one_row_step_ms):
    ``bit_identical`` is :func:`steps_match_verify_rows` over verify lengths 2..``max_verify``
    (the bundle's largest k + 1); ``two_row_step_cost`` is the median over ``reps`` paired timings
    of a 2-row step over a bare 1-row step (what exact plain decoding pays per token).
    """
    from ..engines.invariant import BatchInvariantEngine
    from ..runtime.costs import time_forward

    bare = OrtEngine(entry, graph, EngineOptions())
    engine = BatchInvariantEngine(bare)
    same = steps_match_verify_rows(engine, entry.vocab_size, entry.max_context, max_verify=max_verify, seed=seed)
    kv = engine.new_cache()
    prefix = max(1, min(32, entry.max_context - 2))
    engine.forward(np.random.default_rng(seed).integers(0, entry.vocab_size, size=prefix).astype(np.int64), kv)
    one, ratios = [], []
    token = np.asarray([1], np.int64)
    for _ in range(reps):
        one.append(time_forward(bare, kv, token))
        ratios.append(time_forward(engine, kv, token) / one[-1])
    return ExactSteps(bit_identical=same, two_row_step_cost=round(float(np.median(ratios)), 3),
                      one_row_step_ms=round(float(np.median(one)) * 1e3, 3))


def validation_layers(spec: DecoderSpec) -> int:
    """How many leading layers a layer-limited fp32 check builds: every distinct kind of layer of the
    model (its attention window, 0 = full, and its rope table, -1 = none, as SmolLM3's NoPE layers) in at
    least one layer, and at least two layers (a residual stream handed on from one layer to the next),
    never more than ``spec.n_layers``.

    The graph builder makes every layer from the same code, by the layer's window and rope; those
    leading layers therefore exercise every kind of layer the whole graph has.
    """
    kinds = [(spec.window(i), spec.rope(i)) for i in range(spec.n_layers)]
    first = max((kinds.index(kind) for kind in set(kinds)), default=0)
    return min(spec.n_layers, max(2, first + 1))


def compare_with_source(model: Any, entry: ModelEntry, graph: Path, *, n_tokens: int = 64, seed: int = 0,
                        layers: int | None = None, head_ids: np.ndarray | None = None) -> ComparisonRecord:
    """Teacher-forced agreement of a graph with the PyTorch source itself on the random sequence
    :func:`compare_graphs` uses (``n_tokens``, or the whole context where that is shorter): the
    quantized graph's check when no whole fp32 graph is loaded (layer-limited validation).

    ``layers`` / ``head_ids`` as in :func:`validate_graph`. Raises ExportValidationError on non-finite logits.
    """
    n_tokens = min(n_tokens, entry.max_context)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, entry.vocab_size, size=n_tokens).astype(np.int64)
    reference = _torch_logits(model, ids, layers)
    if head_ids is not None:
        reference = reference[:, head_ids]
    release_memory()  # what the source's forward freed (a streamed module's weights), before the session loads
    engine = OrtEngine(entry, graph, EngineOptions())
    got = engine.forward(ids, engine.new_cache(), num_logits=n_tokens).copy()
    if not np.isfinite(got).all():
        raise ExportValidationError(f"{graph.name} produced non-finite logits")
    return ComparisonRecord(top1_agreement=float((reference.argmax(-1) == got.argmax(-1)).mean()),
                            max_abs_diff=float(np.abs(reference - got).max()))
