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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..engines.base import Engine, KVCache
from .drafters import Drafter
from .sampling import SamplingConfig
from .stats import GenerationStats
from .verify import Proposal, verify


@dataclass
class LoopResult:
    tokens: list[int] = field(default_factory=list)  # new tokens, EOS included when it ended the run
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_new_tokens), "context" (max_context)
    stats: GenerationStats = field(default_factory=GenerationStats)


def run(target: Engine, target_kv: KVCache, prompt: np.ndarray, *, max_new_tokens: int,
        eos_token_ids: tuple[int, ...], sampling: SamplingConfig, rng: np.random.Generator,
        drafter: Drafter | None = None, controller=None, result: LoopResult | None = None) -> Iterator[list[int]]:
    """Generate, yielding each block's committed tokens as soon as the block commits.

    ``prompt``: int64 ``[P]``, with P < target_kv.capacity (the caller checks, before any
    session runs). Fills ``result`` (tokens, finish_reason, stats) as it goes; closing
    the iterator early (a stop string, a cancel) leaves ``result`` consistent.
    """
    result = result if result is not None else LoopResult()
    stats = result.stats
    stats.prompt_tokens = len(prompt)
    stats.drafter = getattr(drafter, "name", "none") if drafter is not None else "none"
    eos = set(eos_token_ids)
    history = [int(t) for t in prompt]
    start = time.perf_counter()

    def commit(block: list[int]) -> list[int]:
        """Truncate a block at EOS / max_new_tokens; set finish_reason when the run ends."""
        room = max_new_tokens - len(result.tokens)
        out = []
        for token in block[:room]:
            out.append(token)
            if token in eos:
                result.finish_reason = "stop"
                break
        if result.finish_reason is None and len(result.tokens) + len(out) >= max_new_tokens:
            result.finish_reason = "length"
        result.tokens.extend(out)
        history.extend(out)
        now = time.perf_counter() - start
        stats.token_times_s.extend([now] * len(out))
        stats.new_tokens = len(result.tokens)
        stats.total_s = now
        return out

    target_kv.reset()
    logits = target.forward(np.asarray(prompt, np.int64), target_kv, num_logits=1)
    first = verify(Proposal.empty(), logits, sampling, rng)
    stats.prefill_s = time.perf_counter() - start
    stats.near_ties += first.near_ties
    block = commit(first.tokens)
    stats.time_to_first_token_s = stats.total_s
    yield block
    if result.finish_reason:
        return
    if drafter is not None:
        t0 = time.perf_counter()
        drafter.begin(np.asarray(prompt, np.int64))
        stats.draft_s += time.perf_counter() - t0

    while True:
        if len(history) >= target_kv.capacity:
            result.finish_reason = "context"  # no room for the next token's K/V
            return
        step_start = time.perf_counter()
        # Room: the verify writes k+1 positions; drafting past max_new_tokens is wasted work.
        limit = min(target_kv.capacity - len(history), max_new_tokens - len(result.tokens) - 1)
        k = controller.choose(limit) if (drafter is not None and controller is not None and limit > 0) else 0
        arr = np.asarray(history, np.int64)
        proposal = drafter.propose(arr, k) if k > 0 else Proposal.empty()
        drafted = len(proposal.tokens)
        t_drafted = time.perf_counter()

        step_ids = np.concatenate([arr[-1:], proposal.tokens]) if drafted else arr[-1:]
        logits = target.forward(step_ids, target_kv, num_logits=drafted + 1)
        verdict = verify(proposal, logits, sampling, rng)
        target_kv.rewind(drafted - verdict.n_accepted)
        t_verified = time.perf_counter()

        block = commit(verdict.tokens)
        stats.near_ties += verdict.near_ties
        if k > 0:  # after a plain step the drafter catches up on its next propose
            drafter.accept(np.asarray(history, np.int64), verdict.n_accepted)
        t_accepted = time.perf_counter()

        draft_s = (t_drafted - step_start) + (t_accepted - t_verified)
        verify_s = t_verified - t_drafted
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.record_step(k, drafted, verdict.n_accepted)
        if controller is not None:
            controller.observe(k, drafted, verdict.n_accepted, draft_s, verify_s)
        stats.overhead_s = stats.total_s - stats.prefill_s - stats.draft_s - stats.verify_s
        yield block
        if result.finish_reason:
            return
