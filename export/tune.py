"""Choose a quantized target's (and draft's) block size on this machine (``specedge export --tune``).

Issue #16: which int4 layout is fastest depends on the CPU (on the AVX2 and AVX-512 EPYC boxes
block 128 gave the fastest step, docs/results/2026-12-02-qwen-variants*.md), while a coarser
block may cost greedy agreement with the full-precision model. So the exporter quantizes the
validated fp32 graph at each candidate block size and measures, for each:

* **the plain step** as the bundle will run it: 1 row (fast mode, the runtime's default), or with
  ``export --exact`` a 1-token step through :class:`~specedge.engines.invariant.BatchInvariantEngine`
  (2 rows, what exact plain decoding pays per token, engines/invariant.py), at
  ``TIMING_CONTEXT`` cached positions, and a 5-token verify, as medians over repetitions that
  rotate through the candidates (so drift on a shared machine hits them alike);
* **greedy agreement with fp32**: the fp32 graph decodes greedily from a few fixed prompts,
  then each candidate reads prompt + continuation in one forward; the agreement is the share
  of continuation positions where its argmax is fp32's token. That is the quantity a near
  tie flips, on the model's own output rather than on random ids;
* **exactness**: whether its exact steps equal verify rows bit for bit at every verify length
  (export/validate.py ``steps_match_verify_rows``). This is not a given: on an AVX-512 EPYC,
  block 64 stepped 18% faster than block 32 but its 3..9-token verify rows differed from its
  exact steps, so speculation could have differed from plain decoding at near ties.

The rule (:func:`choose`): among candidates whose agreement is at least the finest block's
(the untuned default) and, with ``--exact``, that are exact wherever the default is, the one with the
fastest step, if it beats the default's by more than ``MIN_GAIN``; otherwise the default. The
measurements and the choice go into the manifest (``extra.quant_tuning``) with the machine they
were taken on; ``specedge info`` says when a bundle was tuned elsewhere (it still runs there: a
block size is only a speed choice).

**One candidate at a time, finest first** (:func:`tune_block_size`), so that tuning can stop and
resume (issue #38): the fp32 reference is taken, then each candidate is quantized (by the caller)
and measured in full before the next; after each, everything measured so far (:class:`Measurements`)
goes to ``on_measured`` (export/tune_saved.py keeps it for a later run). A coarser
block's steps are timed in rounds rotated with the finest block's, and both medians are recorded
(``BlockCandidate.default_step_ms``), so a candidate measured in another run, under other load, is
still compared with the default on equal terms. A first Ctrl-C stops the measuring; the choice is
then made among the candidates measured so far (the default, measured first, is always one of
them unless the stop came before it) and the record says it was stopped. A second Ctrl-C is not
caught here: it aborts the export, as any Ctrl-C did before.

A quantized **draft** is tuned the same way with two differences: its step is timed as the draft
runs it (one row, no batch-invariant padding), and exactness is not required, because every draft
token is verified by the target (a draft's bits never reach the output). On the AVX-512 EPYC the
0.5B Qwen draft's 1-row step at block 128 took 0.71x block 32's in a 30-round experiment and 0.93x in
the export's own 15-round tuning, at equal agreement with its fp32 graph (0.863 vs 0.859).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ..bundle.extra import BlockCandidate, MachineFingerprint, QuantTuning
from ..errors import InvalidParameterError
from ..bundle.manifest import ModelEntry
from .release import release_memory

# MatMulNBits block sizes. 32 is the default export's (and ONNX Runtime GenAI's); 16 is not tried: it
# reads twice block 32's scales per weight, and the rule keeps a block only if it steps faster than 32.
CANDIDATE_BLOCKS = (32, 64, 128)
# Cached positions for the timed steps: a short chat turn. Attention is a small share of an int4
# step at this length (4-8% in docs/results/2026-12-03-profile-qwen-int4-avx512.md), so the
# matmul layout, which is what differs between candidates, dominates the comparison.
TIMING_CONTEXT = 256
# Rounds per candidate: the paired timing's 30-round medians moved 1-2% between runs on a quiet box;
# 15 kept the timing of three 1.5B candidates in one set of rounds under a minute (each coarser block
# is now timed beside the default in rounds of its own: 5 graphs' rounds instead of 3).
TIMING_REPS = 15
VERIFY_TOKENS = 5
# A coarser block must be faster than the default by more than this to be chosen: paired medians on a
# quiet 2-core box moved 1-2% between runs, so a smaller gain could be noise, and the default is
# the layout that every other measurement of the bundle family was taken on.
MIN_GAIN = 0.03
# Greedy tokens per calibration prompt: 5 x 64 = 320 positions, so one flipped token moves the
# agreement by 0.3 points (on Qwen2.5-Coder-1.5B int4 the blocks differed by 2 of 144 at 48 each).
# The rule asks a coarser block to agree at least as often as block 32, with no allowance for noise, on
# purpose: block 128 of Qwen2.5-Coder-1.5B (rtn-sym4) agreed on 2 of 320 fewer tokens, inside this
# measurement's noise, yet on 3,818 positions of held-out text its perplexity ratio to the source was
# 1.0718 against block 32's 1.0467 and its top-1 agreement 0.867 against 0.891 (`specedge eval`,
# docs/results/2026-12-06-export-memory-2.md): a coarser block that looks level here is usually worse.
CONTINUATION_TOKENS = 64
MAX_PROMPT_TOKENS = 192
# The measurement's settings, in the key of saved measurements (export/tune_saved.py TuneKey.method): a
# measurement taken with other settings is not reused.
METHOD = (f"steps at {TIMING_CONTEXT} positions, {TIMING_REPS} rounds beside the finest block, "
          f"{VERIFY_TOKENS}-token verify, {CONTINUATION_TOKENS}-token greedy continuations as token ids")
# Fixed calibration prompts: prose, an instruction, code, a voice-agent turn, a tool call. Plain text
# (no chat template), so every tokenizer reads them the same way.
CALIBRATION_TEXTS = (
    "The harbour master keeps a log of every ship that enters the port. On a busy morning the log "
    "records the name of the vessel, its cargo, the berth it was given and the time it tied up. ",
    "Explain in three short sentences why a cache makes repeated requests faster, and when it does not.",
    "def moving_average(values, window):\n    \"\"\"Mean of each run of `window` consecutive values.\"\"\"\n",
    "Caller: Hi, I booked a table for four at seven tonight but we are running late. Can you move it? "
    "Assistant:",
    'Reply with one JSON object with the keys "tool" and "arguments". Tools: find_slots(date), '
    'book(slot_id, name). Request: book the first free slot on 12 March for Ana Ruiz.\n',
)


@dataclass(frozen=True)
class Measurements:
    """What a tuning has measured so far, kept between runs by export/tune_saved.py: the fp32 graph's greedy
    continuations of the calibration prompts (token ids; () until taken) and each measured block's record."""

    references: tuple[tuple[int, ...], ...] = ()
    candidates: Mapping[int, BlockCandidate] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """One quantized graph under test."""

    block_size: int
    entry: ModelEntry
    graph: Path


def timed_rows(role: str, exact: bool) -> int:
    """Rows of the step tuning times: 2 for a target exported with ``--exact`` (its exact plain step, and
    exactness is then required), else 1 (fast mode's plain step, and every draft's)."""
    return 2 if role == "target" and exact else 1


def continuation_tokens(max_context: int) -> int:
    """Greedy tokens per calibration prompt: CONTINUATION_TOKENS, or half a small context."""
    return max(1, min(CONTINUATION_TOKENS, max_context // 2))


def calibration_prompts(encode: Callable[[str], list[int]], vocab_size: int, max_context: int) -> list[np.ndarray]:
    """Token ids of :data:`CALIBRATION_TEXTS` (ids outside the graph's vocabulary dropped), each
    cut so that prompt + continuation fits in ``max_context``."""
    room = max(1, min(MAX_PROMPT_TOKENS, max_context - continuation_tokens(max_context) - 1))
    prompts = []
    for text in CALIBRATION_TEXTS:
        ids = [i for i in encode(text) if 0 <= i < vocab_size][-room:]
        if ids:
            prompts.append(np.asarray(ids, np.int64))
    if not prompts:
        raise InvalidParameterError("the tokenizer maps none of the calibration text into the model's vocabulary")
    return prompts


def column_tokens(entry: ModelEntry, graph: Path) -> np.ndarray | None:
    """The token id of each logit column of ``graph``: a vocabulary-truncated head's ids (``--draft-vocab``;
    ``entry.head_tokens`` is relative to the folder ``entry.graph`` is relative to), or None where the
    column is the token id."""
    from ..bundle.manifest import load_head_tokens
    from ..engines.ort import bundle_folder

    return load_head_tokens(bundle_folder(graph, entry.graph), entry) if entry.head_tokens else None


def greedy_references(entry: ModelEntry, graph: Path, prompts: list[np.ndarray]) -> list[np.ndarray]:
    """fp32 greedy continuations (token ids, int64 ``[continuation_tokens(max_context)]``) of each prompt,
    one 1-token step at a time."""
    from ..engines.ort import OrtEngine

    tokens = continuation_tokens(entry.max_context)
    engine = OrtEngine(entry, graph)
    columns = column_tokens(entry, graph)
    out = []
    for prompt in prompts:
        kv = engine.new_cache()
        logits = engine.forward(prompt, kv)
        continuation = []
        for _ in range(tokens):
            column = int(np.argmax(logits[-1]))
            token = column if columns is None else int(columns[column])
            continuation.append(token)
            logits = engine.forward(np.asarray([token], np.int64), kv)
        out.append(np.asarray(continuation, np.int64))
    return out


def greedy_agreement(entry: ModelEntry, graph: Path, prompts: list[np.ndarray],
                     references: list[np.ndarray]) -> float:
    """Share of reference positions where this graph's argmax, fed the same prefix, is the reference token."""
    from ..engines.ort import OrtEngine

    engine = OrtEngine(entry, graph)
    columns = column_tokens(entry, graph)
    hits = total = 0
    for prompt, reference in zip(prompts, references):
        ids = np.concatenate([prompt, reference[:-1]])
        # Row j predicts the token after ids[len(prompt) - 1 + j], i.e. reference[j].
        logits = engine.forward(ids, engine.new_cache(), num_logits=len(reference))
        predicted = logits.argmax(-1)
        hits += int(((predicted if columns is None else columns[predicted]) == reference).sum())
        total += len(reference)
    return hits / total


def time_steps(candidates: list[Candidate], *, exact: bool = True, threads: int = 0, context: int = TIMING_CONTEXT,
               reps: int = TIMING_REPS, seed: int = 3) -> dict[int, tuple[float, float]]:
    """block size -> (1-token step ms, 5-token verify ms), medians over ``reps`` rotated rounds; the step
    runs through the batch-invariant engine (2 rows, a target's plain step) when ``exact``, else 1 row."""
    from ..engines.base import EngineOptions
    from ..engines.invariant import BatchInvariantEngine
    from ..engines.ort import OrtEngine
    from ..runtime.costs import time_forward

    rng = np.random.default_rng(seed)
    opened = []
    for c in candidates:
        # Spinning off: the candidates' sessions alternate on the same cores, and one session's spinning
        # workers would steal the next one's (as in bench/opprofile.py's paired timing).
        bare = OrtEngine(c.entry, c.graph, EngineOptions(intra_op_threads=threads, allow_spinning=False))
        engine = BatchInvariantEngine(bare) if exact else bare
        kv = engine.new_cache()
        fill = max(2, min(context, c.entry.max_context - VERIFY_TOKENS - 1))
        engine.forward(rng.integers(0, c.entry.vocab_size, fill).astype(np.int64), kv)
        opened.append((c, engine, kv))
    one = np.asarray([1], np.int64)
    verify = np.arange(1, VERIFY_TOKENS + 1, dtype=np.int64)
    steps: dict[int, list[float]] = {c.block_size: [] for c in candidates}
    verifies: dict[int, list[float]] = {c.block_size: [] for c in candidates}
    for _, engine, kv in opened:  # warm-up: first runs allocate and prepack
        for ids in (one, verify, one):
            time_forward(engine, kv, ids)
    for r in range(reps):
        shift = r % len(opened)
        for c, engine, kv in opened[shift:] + opened[:shift]:
            for ids, into in ((one, steps), (verify, verifies)):
                into[c.block_size].append(time_forward(engine, kv, ids))
    return {b: (statistics.median(steps[b]) * 1e3, statistics.median(verifies[b]) * 1e3) for b in steps}


def choose(candidates: tuple[BlockCandidate, ...], *, require_exact: bool = True) -> int:
    """The block size to ship (module docstring): the fastest step among candidates at least as
    faithful to fp32 as the finest block and (``require_exact``, a target) exact wherever it is, if it
    gains more than ``MIN_GAIN``; else the finest block."""
    if not candidates:
        raise InvalidParameterError("no block-size candidates to choose from")
    default = min(candidates, key=lambda c: c.block_size)
    faithful = [c for c in candidates if c.greedy_agreement >= default.greedy_agreement
                and (c.bit_identical or not default.bit_identical or not require_exact)]
    # Each step over the default's timed beside it (BlockCandidate.step_ratio): the default's own is 1.
    fastest = min(faithful, key=lambda c: (c.step_ratio(default), c.block_size))
    return fastest.block_size if fastest.step_ratio(default) < 1 - MIN_GAIN else default.block_size


def exact_everywhere(candidate: Candidate, max_verify: int) -> bool:
    """Whether the candidate's exact steps equal its verify rows at every length up to ``max_verify``."""
    from ..engines.invariant import BatchInvariantEngine
    from ..engines.ort import OrtEngine
    from .validate import steps_match_verify_rows

    engine = BatchInvariantEngine(OrtEngine(candidate.entry, candidate.graph))
    return steps_match_verify_rows(engine, candidate.entry.vocab_size, candidate.entry.max_context,
                                   max_verify=max_verify)


def measure_candidate(candidate: Candidate, prompts: list[np.ndarray], references: list[np.ndarray], *,
                      default: Candidate | None, max_verify: int, threads: int = 0,
                      exact_role: bool = False) -> BlockCandidate:
    """One candidate's record: greedy agreement with ``references``, exactness up to ``max_verify``, and
    its step and verify timed (exact 2-row steps when ``exact_role``), in rounds rotated with
    ``default``'s (the finest block, whose step is recorded beside) unless it is the default (None)."""
    agreement = greedy_agreement(candidate.entry, candidate.graph, prompts, references)
    exact = exact_everywhere(candidate, max_verify)
    timings = time_steps([candidate] if default is None else [default, candidate], exact=exact_role, threads=threads)
    step_ms, verify_ms = timings[candidate.block_size]
    return BlockCandidate(block_size=candidate.block_size, exact_step_ms=round(step_ms, 3),
                          verify_ms=round(verify_ms, 3), greedy_agreement=round(agreement, 4), bit_identical=exact,
                          default_step_ms=None if default is None else round(timings[default.block_size][0], 3))


def tune_block_size(blocks: tuple[int, ...], quantized: Callable[[int], Candidate], reference_entry: ModelEntry,
                    reference_graph: Path, prompts: list[np.ndarray], *, max_verify: int, threads: int = 0,
                    role: str = "target", exact: bool = False, saved: Measurements = Measurements(),
                    on_measured: Callable[[Measurements], None] = lambda _: None,
                    progress: Callable[[str], None] = lambda _: None) -> QuantTuning | None:
    """Measure each block size of ``blocks`` not already in ``saved`` (module docstring), finest first, and
    return the record with the choice; None when stopped before the finest block was measured (the caller
    keeps it, untuned).

    ``quantized(block)``: that block's candidate graph, quantized on first use (a block whose measurement
    is saved is never quantized here). ``saved``: what an earlier run measured; its fp32 references are
    reused too when they fit ``prompts``. ``on_measured``: called with everything measured so far after
    the references and after each block. ``max_verify``: the bundle's largest verify (max_draft_tokens
    + 1); ``role``: "target" or "draft"; ``exact`` (a target exported with ``--exact``): time exact 2-row
    steps and require exactness wherever the default block has it. Otherwise 1-row steps, as fast mode
    and every draft run them; exactness is then measured and recorded (exact mode refuses a target
    without it) but not required. A KeyboardInterrupt while measuring stops it (the module docstring);
    one outside this call is not caught.
    """
    exact_role = timed_rows(role, exact) == 2
    order = sorted(blocks)
    measured = {b: c for b, c in saved.candidates.items() if b in order}
    pending = [b for b in order if b not in measured]
    references = _fitting(saved.references, prompts, reference_entry)
    stopped = False
    if measured:
        reused = ", ".join(str(b) for b in order if b in measured)
        progress(f"tune: reusing the saved measurements of block {reused} (an earlier run of this export)")
    if pending:
        try:
            if references is None:
                progress("tune: fp32 greedy reference")
                references = greedy_references(reference_entry, reference_graph, prompts)
                release_memory()  # the fp32 session (4 bytes a parameter) is freed by the collector, before quantizing
                on_measured(_so_far(references, measured))
            else:
                progress("tune: reusing the saved fp32 greedy reference (an earlier run of this export)")
            for block in pending:
                candidate = quantized(block)
                default = None if block == order[0] else quantized(order[0])
                progress(f"tune: measuring block {block} (greedy agreement, exact steps, "
                         f"{'exact 2-row' if exact_role else '1-row'} steps"
                         f"{'' if default is None else f' beside block {default.block_size}'})")
                measured[block] = measure_candidate(candidate, prompts, references, default=default,
                                                    max_verify=max_verify, threads=threads, exact_role=exact_role)
                on_measured(_so_far(references, measured))
                release_memory()  # and its sessions before the next candidate's
        except KeyboardInterrupt:
            stopped = True
            done = ", ".join(str(b) for b in order if b in measured) or "none"
            progress(f"tune: stopped by Ctrl-C; block sizes measured: {done}. The export goes on with the "
                     "best of those (Ctrl-C again aborts it)")
    if order[0] not in measured:
        return None
    candidates = tuple(measured[b] for b in order if b in measured)
    return QuantTuning(machine=MachineFingerprint.here(threads), candidates=candidates,
                       chosen=choose(candidates, require_exact=exact_role),
                       positions=len(prompts) * continuation_tokens(reference_entry.max_context),
                       context=TIMING_CONTEXT, step_rows=2 if exact_role else 1, stopped=stopped)


def _fitting(saved: tuple[tuple[int, ...], ...], prompts: list[np.ndarray],
             entry: ModelEntry) -> list[np.ndarray] | None:
    """Saved fp32 references as arrays, or None unless there is one per prompt, each as long as this
    context's continuations and within the vocabulary (they are fed back to the graphs as input ids)."""
    tokens = continuation_tokens(entry.max_context)
    if len(saved) != len(prompts) or any(len(r) != tokens or not all(0 <= t < entry.vocab_size for t in r)
                                         for r in saved):
        return None
    return [np.asarray(r, np.int64) for r in saved]


def _so_far(references: list[np.ndarray], measured: dict[int, BlockCandidate]) -> Measurements:
    return Measurements(tuple(tuple(int(t) for t in r) for r in references), dict(measured))
