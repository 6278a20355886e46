"""The cost model: what a step costs here, learned online, and how it is measured.

One object, :class:`CostModel`, owns every step cost the runtime reasons about:

- ``target_cost(n)``: one target forward on n tokens (a verify of k = n - 1 drafts);
- ``draft_token_s``: one draft step (one proposed token);
- ``catchup_cost(tokens)``: the draft reading history it has not seen (its deferred
  prompt prefill, or tokens committed by plain steps), a one-off per catch-up.

The loop feeds it every step (:meth:`CostModel.observe`); the adaptive controller
and the latency cap ask it. Nothing else estimates a cost. :func:`time_forward`
("time n tokens, then rewind") is the one measurement primitive, used by
:func:`measure` (``specedge tune``) and by the bench.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..bundle.extra import CostProfile, MachineFingerprint
from .options import DEFAULT_DRAFT_WINDOW

# Weight of the newest observation in every moving average the runtime keeps (step costs here,
# acceptance in the k controller, mode rates in the loop): 0.2 follows a change of machine load
# or of the text within ~5 steps, yet one slow step or one unlucky block does not swing k.
EMA_WEIGHT = 0.2


def ema(old: float | None, new: float, weight: float = EMA_WEIGHT) -> float:
    """Exponential moving average: ``new`` when there is no ``old`` yet, else
    ``(1 - weight) * old + weight * new``."""
    return new if old is None else (1 - weight) * old + weight * new


# 10 timed repeats after 2 warm-up runs: medians over 10 settle within a few % on a noisy
# 2-core box, and the whole profile stays under ~30 s for a 1.5B int4 target.
REPEATS = 10
WARMUP = 2


@dataclass(frozen=True)
class StepOutcome:
    """One loop step, as the cost model and the controller learn from it."""

    k: int  # draft length chosen (0 = a plain step)
    drafted: int  # tokens actually proposed (<= k; the verify scored drafted + 1)
    accepted: int  # draft tokens the verifier accepted
    draft_s: float  # drafting seconds, catch-up excluded
    verify_s: float  # the target's forward on drafted + 1 tokens
    catchup_s: float = 0.0  # seconds of the draft's catch-up in this step (counted apart from draft_s)
    catchup_tokens: int = 0  # tokens that catch-up read
    # The proposal cost no draft-model forward in this step (a prompt/suffix lookup, or a draft
    # carried over from a pipelined step): its draft time says nothing about the draft model's c.
    lookup: bool = False
    # Lookup steps: the tokens the lookup had ready when k was chosen (its chain length, which the
    # suffix drafter bounds by its match length: the lookup's confidence). 0 for other steps.
    offered: int = 0
    match: int = 0  # ... and the length of the match it continued (0: not known; 1: a guess)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a step drafting k commits in expectation: ``1 + sum_{j<=k} prod_{i<j} acceptance[i]``
    (Leviathan et al. 2023, Thm 3.8, with per-position acceptance; ``acceptance[i]``: the
    probability that draft token i+1 is accepted given all earlier ones were; needs k entries).
    With one acceptance a at every position it is ``(1 - a^(k+1)) / (1 - a)``."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acceptance[i]
        total += reach
    return total


@dataclass
class CostModel:
    """Step costs in seconds, learned by exponential moving averages.

    Update rule: :func:`ema` with weight ``beta`` (:data:`EMA_WEIGHT`). Costs are averaged per verify length;
    unmeasured lengths are interpolated from measured ones, or start from an optimistic
    prior so that they get tried and measured.
    """

    target_s: dict[int, float] = field(default_factory=dict)  # verify length n (= k+1) -> seconds
    draft_token_s: float | None = None
    draft_catchup_token_s: float | None = None  # per token of a catch-up feed (the draft's prefill)
    beta: float = EMA_WEIGHT

    # An untried verify length is assumed to cost 1 + 0.15 per extra token of a 1-token step:
    # optimistic for memory-bound decoding, so it is tried once and then measured.
    PRIOR_VERIFY_SLOPE = 0.15
    # Until a catch-up is measured, a catch-up token is assumed to cost this share of a draft
    # step: a batched feed reads the weights once for all its tokens, but is compute-bound
    # (`specedge tune`, int4 Qwen 0.5B feeding 64 tokens on a 2-core AVX2 EPYC: 0.30-0.34).
    PRIOR_CATCHUP_SHARE = 0.35
    USUAL_FEED = 2  # a normal step feeds the target's correction/bonus token (+ the last draft token)

    # --- persistence -------------------------------------------------------------
    @classmethod
    def from_profile(cls, profile: CostProfile, *, uses_draft_model: bool = True, exact: bool = True) -> "CostModel":
        """From a recorded profile (``specedge tune``). ``uses_draft_model=False``: a drafter that
        runs no model (prompt lookup) costs microseconds per token and never catches up.
        ``exact=False``: plain steps run one row, so a plain step costs the profile's 1-row step (a
        profile without one leaves it to the first plain step to measure; until then it is
        extrapolated from the verify lengths)."""
        target_s = dict(profile.target_s)
        if not exact:
            target_s.pop(1, None)
            if profile.target_one_row_s is not None:
                target_s[1] = profile.target_one_row_s
        model = cls(target_s, profile.draft_token_s, profile.draft_catchup_token_s)
        if not uses_draft_model:
            model.draft_token_s = model.draft_catchup_token_s = 0.0
        return model

    # --- the costs ---------------------------------------------------------------
    def target_cost(self, n: int) -> float | None:
        """Seconds of a target forward on n tokens; None before any target step was measured."""
        known = self.target_s
        if n in known:
            return known[n]
        if not known:
            return None
        lengths = sorted(known)
        below = [m for m in lengths if m < n]
        above = [m for m in lengths if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
            return known[lo] + (known[hi] - known[lo]) * (n - lo) / (hi - lo)
        base = known.get(1, known[lengths[0]] / (1 + self.PRIOR_VERIFY_SLOPE * (lengths[0] - 1)))
        if len(lengths) >= 2 and below:
            lo, hi = lengths[-2], lengths[-1]
            slope = max((known[hi] - known[lo]) / (hi - lo), 0.0)
            return known[hi] + slope * (n - hi)
        return base * (1 + self.PRIOR_VERIFY_SLOPE * (n - 1))

    def draft_cost(self, k: int) -> float:
        """Seconds to draft k tokens (catch-up excluded; 0 while unmeasured)."""
        return (self.draft_token_s or 0.0) * k

    def step_cost(self, k: int) -> float | None:
        """Seconds of a step drafting k tokens: ``k * t_draft + t_target(k+1)``; None if unknown."""
        t_target = self.target_cost(k + 1)
        return None if t_target is None else t_target + self.draft_cost(k)

    def catchup_cost(self, catchup_tokens: int, draft_token_s: float | None = None) -> float:
        """Seconds to feed ``catchup_tokens`` of unseen history to the draft (0 for the usual feed).
        Unmeasured, a catch-up token costs a share of a draft step: ``draft_token_s`` when given (a
        caller's prior for an unmeasured draft), else the measured one (0 when none was)."""
        if catchup_tokens <= self.USUAL_FEED:
            return 0.0
        per_token = self.draft_catchup_token_s
        if per_token is None:
            step = self.draft_token_s if draft_token_s is None else draft_token_s
            per_token = (step or 0.0) * self.PRIOR_CATCHUP_SHARE
        return catchup_tokens * per_token

    def loss_if_rejected(self, k: int, catchup_tokens: int = 0, *, lookup: bool = False) -> float | None:
        """Seconds a step drafting k loses against a plain step when no draft token is accepted
        (both then commit one token): ``catch-up + k * t_draft + t_target(k+1) - t_target(1)``;
        None before any target step was measured.

        ``lookup``: the draft is a lookup, which runs no model (no draft or catch-up cost). An
        unmeasured draft model is assumed to cost as much as a target step per token (a draft
        slower than that is no draft): the worst case is what an exploration budget must cover.
        """
        t_plain, t_step = self.target_cost(1), self.target_cost(k + 1)
        if t_plain is None or t_step is None:
            return None
        if lookup or k == 0:
            return t_step - t_plain
        per_token = self.draft_token_s if self.draft_token_s is not None else t_plain
        return self.catchup_cost(catchup_tokens, per_token) + k * per_token + t_step - t_plain

    def lookup_view(self) -> "CostModel":
        """This model as a lookup step sees it: the same target costs (the dict is shared, not
        copied, so every observe() here updates both) and a draft that costs nothing."""
        return CostModel(self.target_s, 0.0, 0.0, self.beta)

    def latency_limit(self, max_latency_s: float | None, limit: int) -> int:
        """Largest k (<= limit) whose block is expected to commit within ``max_latency_s``.

        A block's tokens reach the caller only when it commits, so a long draft delays the
        next flush: k * (draft time per token) + verify(k+1) must stay under the bound.
        Before any target step was measured there is nothing to judge by: no cap.
        """
        if max_latency_s is None or not self.target_s:
            return limit
        k = 0
        while k < limit and self.step_cost(k + 1) <= max_latency_s:
            k += 1
        return k

    # --- learning ----------------------------------------------------------------
    def _ema(self, old: float | None, new: float) -> float:
        return ema(old, new, self.beta)

    def observe(self, step: StepOutcome) -> None:
        """Learn from one step: the verify's cost at its length, the draft's per-token cost,
        and a catch-up's per-token cost when one was paid."""
        n_verify = step.drafted + 1
        self.target_s[n_verify] = self._ema(self.target_s.get(n_verify), step.verify_s)
        if step.catchup_tokens > self.USUAL_FEED and step.catchup_s > 0:
            self.draft_catchup_token_s = self._ema(self.draft_catchup_token_s, step.catchup_s / step.catchup_tokens)
        if step.drafted > 0 and not step.lookup:
            self.draft_token_s = self._ema(self.draft_token_s, step.draft_s / step.drafted)


# ----------------------------------------------------------------------------- measurement
def time_forward(engine, kv, ids: np.ndarray) -> float:
    """Seconds of one forward of ``ids`` (int64 ``[n]``, all n logits) on ``kv``, which is then
    rewound by n: every call sees the same cache length."""
    t = time.perf_counter()
    engine.forward(ids, kv, num_logits=len(ids))
    elapsed = time.perf_counter() - t
    kv.rewind(len(ids))
    return elapsed


def median_forward(engine, kv, ids: np.ndarray, *, repeats: int = REPEATS, warmup: int = WARMUP) -> float:
    """Median of ``repeats`` :func:`time_forward` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        time_forward(engine, kv, ids)
    return float(np.median([time_forward(engine, kv, ids) for _ in range(repeats)]))


def measure(target, draft=None, *, max_verify: int = 9, context: int = 128, threads: int = 0) -> CostProfile:
    """Time target steps of 1..max_verify tokens, a 1-token draft step and a draft catch-up of
    one draft window, on a cache of ``context`` positions. Returns the profile (seconds) that
    :meth:`CostModel.from_profile` reads."""
    rng = np.random.default_rng(0)
    out: dict = {"target_s": {}}
    for name, engine in (("target", target), ("draft", draft)):
        if engine is None:
            continue
        kv = engine.new_cache()
        ctx = min(context, kv.capacity - max_verify - 1)
        ids = rng.integers(0, engine.vocab_size, size=ctx + max(max_verify, DEFAULT_DRAFT_WINDOW)).astype(np.int64)
        engine.forward(ids[:ctx], kv, num_logits=1)
        if name == "target":
            for n in range(1, max_verify + 1):
                out["target_s"][n] = median_forward(engine, kv, ids[ctx:ctx + n])
            # The batch-invariant wrapper's plain step runs 2 rows; fast mode's runs the bare engine's 1.
            bare = getattr(engine, "inner", engine)
            out["target_one_row_s"] = median_forward(bare, kv, ids[ctx:ctx + 1])
        else:
            out["draft_token_s"] = median_forward(engine, kv, ids[ctx:ctx + 1])
            # A catch-up feed (the draft's deferred prefill, bounded by the draft window) costs
            # per token far less than a step: the adaptive controller weighs it against the
            # expected reply length before the first speculative step.
            n = max(min(DEFAULT_DRAFT_WINDOW, kv.capacity - ctx - 1), 1)
            out["draft_catchup_token_s"] = median_forward(engine, kv, ids[ctx:ctx + n]) / n
    return CostProfile(machine=MachineFingerprint.here(threads), context=context, **out)
