"""The speculation loop: prefill, then draft -> verify in one pass -> commit -> rewind.

Plain decoding is the same loop with k = 0 every step (one target token per
forward, sampled through the same verifier), so the baseline and speculation
share every line except the draft.

Per step, with ``P`` = positions in the target cache and ``last`` the newest
committed token (not yet in the cache)::

    proposal = drafter.propose(history, k)                 # d1..dk'
    logits   = target.forward([last, d1..dk'])             # positions P..P+k', ONE pass
    verdict  = verify(proposal, logits)                    # n accepted + 1 target token
    target_kv.rewind(k' - n)                               # drop rejected d(n+1)..dk'
    drafter.accept(history + verdict.tokens, n)

Pipelined steps (verify-while-draft, PEARL's post-verify) run the target's verify
of block n in a worker thread while the drafter already drafts block n+1 on the
guess that block n is fully accepted. ONNX Runtime releases the GIL inside
``run``, so both sessions compute at once. If the guess was right (all of block n
accepted and the target's bonus token equals the draft's first guess) the rest
of the early draft becomes block n+1's proposal; otherwise it is discarded, and
the drafter's token-matching ``accept`` rewinds its cache past it. The target's
cache only ever holds what its verify wrote, and is rewound exactly as in a
sequential step, so committed output is unchanged.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..engines.base import Engine, KVCache
from .policies import PLAIN, Controller, DraftPlan
from .costs import EMA_WEIGHT, CostModel, StepOutcome, ema
from .drafting import ANY_SOURCE, LOOKUP_SOURCE, NO_LOOKUP, Drafter
from .options import MODES
from .sampling import SamplingConfig
from .stats import GenerationStats
from .verify import NEAR_TIE_GAP, Proposal, verify


# Prompt tokens per prefill forward. Each chunk's K/V is committed (``kv.length`` advances) before the
# next runs, so a cancel inside a long prefill keeps the chunks already done: a voice agent's
# preemptive request on an interim transcript is cut 150-400 ms in, often inside a cold prefill, and
# the final request then computes only what the cut one had not. Every prefill (generate, stream,
# prefill-ahead, a reused prefix's rest) is split by this one rule. The size: a 512-token prefill in
# chunks of 128 took 0.93x (SmolLM2-135M fp32) and 1.01x (Qwen2.5-Coder-1.5B int4, GGUF blocks) the time
# of one forward, chunks of 64 1.07x and 1.04x, with bit-identical logits (2-core Xeon with AMX, quiet;
# docs/results/2026-12-06-export-memory-2.md). A chunk is ~70 ms of SmolLM2's prefill there, ~1.5 s of Qwen's.
PREFILL_CHUNK = 128


def prefill(target: Engine, kv: KVCache, ids: np.ndarray) -> np.ndarray:
    """Forward ``ids`` (int64 ``[n]``, n >= 1) at positions ``kv.length ..`` in chunks of
    :data:`PREFILL_CHUNK` tokens; returns the last position's logits ``[1, vocab]``. A forward that
    raises (a cancel) leaves ``kv.length`` after the last whole chunk."""
    ids = np.asarray(ids, np.int64)
    for start in range(0, len(ids) - PREFILL_CHUNK, PREFILL_CHUNK):
        target.forward(ids[start:start + PREFILL_CHUNK], kv, num_logits=1)
    last = (len(ids) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    return target.forward(ids[last:], kv, num_logits=1)


@dataclass
class LoopResult:
    tokens: list[int] = field(default_factory=list)  # new tokens, EOS included when it ended the run
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_new_tokens), "context" (max_context)
    stats: GenerationStats = field(default_factory=GenerationStats)


class ModeSelector:
    """Chooses sequential or pipelined steps from measured committed tokens per second.

    Keeps an exponential moving average (:func:`~.costs.ema`, as the k controller) of each mode's
    rate and uses the faster one; every ``probe_every`` steps it runs the other mode once
    so a change in conditions (acceptance, machine load) is noticed.
    """

    def __init__(self, probe_every: int = 12, beta: float = EMA_WEIGHT) -> None:
        self.rate: dict[str, float | None] = {"sequential": None, "pipelined": None}
        self.probe_every = probe_every
        self.beta = beta
        self._steps = 0

    def choose(self) -> str:
        self._steps += 1
        for mode, rate in self.rate.items():
            if rate is None:
                return mode  # measure each mode once before judging
        best = max(self.rate, key=lambda m: self.rate[m])
        if self._steps % self.probe_every == 0:
            return "pipelined" if best == "sequential" else "sequential"
        return best

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        self.rate[mode] = ema(self.rate[mode], tokens / seconds, self.beta)


class _Run:
    """State of one generation: history, result, the pipelined carry-over proposal."""

    def __init__(self, target: Engine, target_kv: KVCache, prompt: np.ndarray, max_new_tokens: int,
                 eos_token_ids: tuple[int, ...], sampling: SamplingConfig, rng: np.random.Generator,
                 drafter: Drafter | None, controller: Controller | None, result: LoopResult,
                 stop: Callable[[list[int]], int | None] | None = None, near_tie: float = NEAR_TIE_GAP,
                 max_latency_s: float | None = None,
                 horizon: Callable[[int, int], float] | None = None, costs: CostModel | None = None) -> None:
        self.stop = stop
        self.horizon = horizon
        self.max_latency_s = max_latency_s
        self.costs = costs if costs is not None else CostModel()  # fed every step; the latency cap asks it
        self.near_tie = near_tie
        self.target = target
        self.kv = target_kv
        self.max_new_tokens = max_new_tokens
        self.eos = set(eos_token_ids)
        self.sampling = sampling
        self.rng = rng
        self.drafter = drafter
        self.controller = controller
        self.result = result
        self.stats = result.stats
        self.history = [int(t) for t in prompt]
        self.carry: Proposal | None = None  # block n+1's proposal, drafted during block n's verify
        self.step_lookup = False  # this step's proposal runs no draft model (a lookup, or the carry)
        self.step_carry = False  # ... because it is the carry (the draft model's, drafted during the last verify)
        self.step_offer = NO_LOOKUP  # ... and what that lookup had ready
        self.step_source = ANY_SOURCE  # the drafter's source the controller chose for this step
        self.start = time.perf_counter()

    def commit(self, block: list[int]) -> list[int]:
        """Truncate a block at EOS / a stop / max_new_tokens; set finish_reason when the run ends.

        Stats count only what is committed here, so nothing past a stop is counted.
        """
        result, stats = self.result, self.stats
        # Prompt + output never exceed max_context (the cache's capacity): a block accepted whole
        # right at the end would otherwise commit one token more than plain decoding, which stops
        # when the history fills the context, and the output would depend on k.
        room = min(self.max_new_tokens - len(result.tokens), self.kv.capacity - len(self.history))
        out = []
        for token in block[:room]:
            out.append(token)
            if token in self.eos:
                result.finish_reason = "stop"
                break
        if self.stop is not None and out:
            keep = self.stop(out)  # e.g. a stop string completed by out[keep - 1]
            if keep is not None:
                out = out[:keep]
                result.finish_reason = "stop_string"
        if result.finish_reason is None and len(result.tokens) + len(out) >= self.max_new_tokens:
            result.finish_reason = "length"
        result.tokens.extend(out)
        self.history.extend(out)
        now = time.perf_counter() - self.start
        stats.token_times_s.extend([now] * len(out))
        stats.new_tokens = len(result.tokens)
        stats.total_s = now
        return out

    def limit(self) -> int:
        """Largest useful k: the verify writes k+1 positions; drafting past max_new_tokens is waste."""
        return min(self.kv.capacity - len(self.history), self.max_new_tokens - len(self.result.tokens) - 1)

    def choose_k(self) -> int:
        """This step's k (0: a plain step); sets the step's source and lookup offer."""
        plan = self._plan()
        self.step_source = plan.source
        return plan.k

    def _plan(self) -> DraftPlan:
        self.step_lookup = False
        self.step_carry = False
        self.step_offer = NO_LOOKUP
        limit = self.costs.latency_limit(self.max_latency_s, self.limit())
        if self.drafter is None or self.controller is None or limit <= 0:
            return PLAIN
        if self.carry is not None:
            self.step_lookup = True  # drafted during the last verify: this step runs no draft model
            self.step_carry = True
            return DraftPlan(min(len(self.carry.tokens), limit))
        # The history list itself is passed: no O(context) copy.
        offer = self.drafter.lookup_offer(self.history, limit)
        catchup = self.drafter.pending_tokens(self.history)
        generated = len(self.result.tokens)
        remaining = None if self.horizon is None else \
            self.horizon(generated, self.max_new_tokens - generated)
        plan = self.controller.choose(limit, catchup_tokens=catchup, expected_remaining=remaining,
                                      lookup_tokens=offer.tokens, lookup_match=offer.match)
        # A controller that does not choose a source gets the drafter's own order: a lookup when one exists.
        self.step_lookup = plan.source == LOOKUP_SOURCE or (plan.source == ANY_SOURCE and offer.tokens > 0)
        if self.step_lookup:
            self.step_offer = offer
        return plan

    def _settle_source(self, proposal: Proposal) -> None:
        """A proposal says whether a draft model made it: under ``ANY_SOURCE`` the drafter's own order
        may prefer its model to a weak lookup it offered (the auto drafter does, to a guess)."""
        if len(proposal.tokens) and not self.step_carry and self.step_lookup == proposal.from_model:
            self.step_lookup = not proposal.from_model
            if proposal.from_model:
                self.step_offer = NO_LOOKUP

    def _verify_and_commit(self, proposal: Proposal, logits: np.ndarray) -> tuple[list[int], int]:
        verdict = verify(proposal, logits, self.sampling, self.rng, self.near_tie)
        self.kv.rewind(len(proposal.tokens) - verdict.n_accepted)
        self.stats.near_ties += verdict.near_ties
        return self.commit(verdict.tokens), verdict.n_accepted

    def _record(self, k: int, drafted: int, accepted: int, draft_s: float, verify_s: float,
                committed: int) -> None:
        stats = self.stats
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        # EOS inside the block commits only its first `committed` tokens, all accepted draft
        # tokens: the stats count just those, so nothing past the stop is counted. The
        # controller still learns what the draft really achieved.
        if committed <= accepted:
            stats.record_step(k, committed, committed)
        else:
            stats.record_step(k, drafted, accepted)
        # A pipelined carry is the draft model's tokens, drafted (and paid for) during the last verify.
        stats.record_source("plain" if drafted == 0 else "lookup" if self.step_lookup and not self.step_carry
                            else "model", draft_s + verify_s, committed)
        # Feeding history the draft missed (its deferred prefill, tokens of plain steps) is a
        # one-off, not a per-token draft cost: keep it out of the estimate of c.
        catchup = self.drafter.catchup_s if drafted else 0.0
        catchup_tokens = self.drafter.catchup_tokens if drafted else 0
        stats.catchup_s += catchup
        stats.catchup_tokens += catchup_tokens
        step = StepOutcome(k, drafted, accepted, max(draft_s - catchup, 0.0), verify_s, catchup, catchup_tokens,
                           lookup=self.step_lookup, offered=self.step_offer.tokens, match=self.step_offer.match)
        self.costs.observe(step)
        if self.controller is not None:
            self.controller.observe(step)

    def step_sequential(self, k: int) -> list[int]:
        t0 = time.perf_counter()
        # A plain step needs only the last token: converting the whole history to an array
        # (O(context) per token) is paid only when a drafter reads it.
        proposal = self._take_carry(k) or (self.drafter.propose(np.asarray(self.history, np.int64), k,
                                                                self.step_source)
                                           if k > 0 else Proposal.empty())
        self._settle_source(proposal)
        drafted = len(proposal.tokens)
        t1 = time.perf_counter()
        last = np.array(self.history[-1:], np.int64)
        step_ids = np.concatenate([last, proposal.tokens]) if drafted else last
        logits = self.target.forward(step_ids, self.kv, num_logits=drafted + 1)
        block, accepted = self._verify_and_commit(proposal, logits)
        t2 = time.perf_counter()
        if k > 0:  # after a plain step the drafter catches up on its next propose
            self.drafter.accept(np.asarray(self.history, np.int64), accepted)
        t3 = time.perf_counter()
        self._record(k, drafted, accepted, (t1 - t0) + (t3 - t2), t2 - t1, len(block))
        return block

    def _take_carry(self, k: int) -> Proposal | None:
        carry, self.carry = self.carry, None
        if carry is None or k <= 0:
            return None
        if len(carry.tokens) > k:
            probs = carry.draft_probs[:k] if carry.draft_probs is not None else None
            carry = Proposal(carry.tokens[:k], probs, carry.from_model)
        return carry

    def step_pipelined(self, k: int, pool: ThreadPoolExecutor) -> list[int]:
        t0 = time.perf_counter()
        arr = np.asarray(self.history, np.int64)
        proposal = self._take_carry(k) or self.drafter.propose(arr, k, self.step_source)
        self._settle_source(proposal)
        drafted = len(proposal.tokens)
        t1 = time.perf_counter()
        if drafted == 0:
            self.drafter.accept(arr, 0)
            return self.step_sequential(0)

        def run_verify():
            s = time.perf_counter()
            out = self.target.forward(np.concatenate([arr[-1:], proposal.tokens]), self.kv, num_logits=drafted + 1)
            return out, time.perf_counter() - s

        future = pool.submit(run_verify)
        # Draft block n+1 while the target verifies block n, assuming block n is accepted whole.
        # One extra token: the first is the guess of the target's bonus token, the other k
        # become block n+1's proposal when the guess holds.
        ahead = self.drafter.propose(np.concatenate([arr, proposal.tokens]), k + 1)
        t2 = time.perf_counter()
        logits, verify_busy = future.result()
        t3 = time.perf_counter()
        block, accepted = self._verify_and_commit(proposal, logits)
        guessed = (accepted == drafted and len(ahead.tokens) > 0 and len(block) == drafted + 1
                   and block[-1] == int(ahead.tokens[0]))
        if guessed and len(ahead.tokens) > 1:
            probs = ahead.draft_probs[1:] if ahead.draft_probs is not None else None
            self.carry = Proposal(ahead.tokens[1:], probs, ahead.from_model)
        else:
            self.drafter.accept(np.asarray(self.history, np.int64), accepted)  # discards the early draft
        t4 = time.perf_counter()
        draft_busy = (t1 - t0) + (t2 - t1) + (t4 - t3)
        overlap = max(0.0, (t2 - t1) + verify_busy - (t3 - t1))
        self.stats.overlap_s += overlap
        self.stats.pipelined_steps += 1
        self._record(k, drafted, accepted, draft_busy, verify_busy, len(block))
        return block


def run(target: Engine, target_kv: KVCache, prompt: np.ndarray, *, max_new_tokens: int,
        eos_token_ids: tuple[int, ...], sampling: SamplingConfig, rng: np.random.Generator,
        drafter: Drafter | None = None, controller: Controller | None = None, result: LoopResult | None = None,
        mode: str = "sequential", stop: Callable[[list[int]], int | None] | None = None,
        near_tie: float = NEAR_TIE_GAP, max_latency_s: float | None = None,
        horizon: Callable[[int, int], float] | None = None, costs: CostModel | None = None,
        reuse: int = 0) -> Iterator[list[int]]:
    """Generate, yielding each block's committed tokens as soon as the block commits.

    ``prompt``: int64 ``[P]``, with P < target_kv.capacity (the caller checks, before any
    session runs). ``mode``: "sequential", "pipelined" (verify-while-draft) or "auto"
    (measured choice per step). Fills ``result`` (tokens, finish_reason, stats) as it
    goes; closing the iterator early (a cancel) leaves it consistent. ``stop(block)``
    sees each block about to commit and returns how many of its tokens to keep when the
    run must end inside it (a stop string), else None. ``max_latency_s`` caps the draft
    length so a block is expected to commit within that many seconds (voice agents).
    ``horizon(generated, budget_left)`` estimates how many more tokens this reply will
    run; the adaptive controller weighs a draft's one-off catch-up against it (None:
    unknown, never weighed). ``costs``: the step-cost model this run feeds and the latency
    cap reads (the adaptive controller's own, so both see one estimate); None = a fresh one.
    ``reuse``: the target cache already holds the K/V of ``prompt[:reuse]`` (a conversation's
    earlier turns, runtime/slots.py); only the rest is prefilled. 0 = a cold start.
    """
    result = result if result is not None else LoopResult()
    stats = result.stats
    stats.prompt_tokens = len(prompt)
    stats.drafter = drafter.name if drafter is not None else "none"
    state = _Run(target, target_kv, np.asarray(prompt, np.int64), max_new_tokens, eos_token_ids, sampling, rng,
                 drafter, controller, result, stop, near_tie, max_latency_s, horizon, costs)

    if not 0 <= reuse < len(prompt) or reuse > target_kv.length:
        raise ValueError(f"reuse {reuse} must leave >= 1 prompt token and be held by the cache ({target_kv.length})")
    target_kv.rewind(target_kv.length - reuse)  # reuse 0: an empty cache
    stats.reused_tokens = reuse
    logits = prefill(target, target_kv, prompt[reuse:])
    first = verify(Proposal.empty(), logits, sampling, rng, near_tie)
    stats.prefill_s = time.perf_counter() - state.start
    stats.near_ties += first.near_ties
    block = state.commit(first.tokens)
    stats.time_to_first_token_s = stats.total_s
    yield block
    if result.finish_reason:
        return
    if drafter is not None:
        t0 = time.perf_counter()
        drafter.begin(np.asarray(prompt, np.int64))
        stats.draft_s += time.perf_counter() - t0

    selector = ModeSelector() if mode == "auto" else None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specedge-verify") \
        if mode != "sequential" and drafter is not None else None
    try:
        while True:
            if len(state.history) >= target_kv.capacity:
                result.finish_reason = "context"  # no room for the next token's K/V
                return
            k = state.choose_k()
            step_mode = selector.choose() if selector else mode
            step_start = time.perf_counter()
            before = len(result.tokens)
            if step_mode == "pipelined" and k > 0 and pool is not None:
                block = state.step_pipelined(k, pool)
            else:
                step_mode = "sequential"
                block = state.step_sequential(k)
            if selector is not None and k > 0:
                selector.observe(step_mode, len(result.tokens) - before, time.perf_counter() - step_start)
            stats.overhead_s = (stats.total_s - stats.prefill_s - stats.draft_s - stats.verify_s
                                + stats.overlap_s)
            yield block
            if result.finish_reason:
                return
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
