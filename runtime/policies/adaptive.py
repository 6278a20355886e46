"""AdaptiveK: k chosen per step to maximise expected committed tokens per second.

Why each rule and constant has its value, with the traces behind them: docs/design/policy.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InvalidParameterError
from ..costs import EMA_WEIGHT, CostModel, StepOutcome, ema, expected_tokens
from .base import DraftPlan, PolicySetup, Snapshot


@dataclass(frozen=True)
class AdaptiveSnapshot(Snapshot):
    """What an AdaptiveK carries to the next reply."""

    acceptance: tuple[float, ...] = ()  # learned per-position acceptance (empty: none learned)
    observed: int = 0  # positions 0..observed-1 have had at least one outcome


class AdaptiveK:
    """Chooses k to maximise expected committed tokens per second, from a CostModel's step costs.

    Following Leviathan et al. 2023 (Thm 3.8) with per-position acceptance: if
    ``alpha[i]`` is the probability that draft token i+1 is accepted given all earlier
    ones were, a step drafting k tokens commits ``E(k) = 1 + sum_{j<=k} prod_{i<j} alpha[i]``
    tokens and costs ``T(k) = k * t_draft + t_target(k+1)``. The controller picks
    ``argmax_k E(k) / T(k)`` over k = 0..limit; k = 0 is a plain target step
    (E = 1, T = t_target(1)), so when speculation does not pay it switches off. A k > 0
    must beat the plain rate by ``SPECULATION_MARGIN`` (the model's measured optimism).

    Update rule: exponential moving averages (:func:`~specedge.runtime.costs.ema`) with weight
    ``beta`` (:data:`~specedge.runtime.costs.EMA_WEIGHT`). Acceptance at position i is observed
    only where the step reached it (all earlier tokens accepted). The step costs are the
    CostModel's (``costs``), which the loop feeds; this class only reads them.

    Positions never reached yet borrow the acceptance of the deepest observed one. Every step that
    accepts all it drafted moves the estimates of positions past it towards the last position's
    (at the same EMA weight), so one early rejection deep in a draft does not pin k below it for good.

    Probing: while k = 0 wins, no acceptance is observed, so every ``probe_every``
    plain steps it drafts once at the last positive k to refresh the estimates.

    One-off catch-up: before a draft model can propose it must read the history it has not seen
    (its deferred prompt prefill, or tokens committed by plain steps). That cost
    ``C = catchup_tokens * t_catchup`` is paid once, so speculation starts only when
    ``expected_remaining * (1/rate(0) - 1/rate(k)) >= C``: the time saved over the tokens still
    expected exceeds the one-off. A probe that would pay a catch-up runs only when C is at most
    ``PROBE_CATCHUP_SHARE`` of the plain time since the last probe, which caps what exploring costs.
    """

    name = "adaptive"

    PRIOR_ACCEPTANCE = 0.6  # optimistic start: speculation is tried before it is judged
    PROBE_CATCHUP_SHARE = 0.1  # a probe's catch-up may cost at most 10% of the plain time it follows
    # Speculation must promise this much more than a plain step before it is chosen: the cost model
    # leaves out per-step bookkeeping, and realised speedups came out below predicted ones
    # (docs/design/policy.md#speculation-margin).
    SPECULATION_MARGIN = 1.1

    def __init__(self, max_k: int, *, beta: float = EMA_WEIGHT, probe_every: int = 16,
                 costs: CostModel | None = None, start_k: int | None = None,
                 acceptance: list[float] | None = None, observed: int = 0) -> None:
        """``acceptance``/``observed``: per-position estimates to start from (the previous
        reply's, so the first catch-up is judged on what drafts achieved, not on a prior)."""
        if max_k < 0:
            raise InvalidParameterError(f"max_draft_tokens must be >= 0; got {max_k}")
        if not 0 < beta <= 1:
            raise InvalidParameterError(f"beta must be in (0, 1]; got {beta}")
        self.max_k = max_k
        self.beta = beta
        self.probe_every = probe_every
        self.alpha = [self.PRIOR_ACCEPTANCE] * max_k
        self.observed = 0  # positions 0..observed-1 have had at least one outcome
        if acceptance:
            carried = [min(max(float(a), 0.0), 1.0) for a in acceptance[:max_k]]
            self.alpha[:len(carried)] = carried
            self.observed = min(observed, len(carried))
        self.costs = costs if costs is not None else CostModel()
        self._plain_streak = 0
        self._plain_s_since_probe = 0.0
        self._last_positive_k = start_k if start_k else min(4, max_k)
        self.mode_s = {"speculative": 0.0, "plain": 0.0}
        self.catchup_deferred = 0  # steps run plain because a catch-up would not have paid off

    @classmethod
    def from_snapshot(cls, setup: PolicySetup, learned: AdaptiveSnapshot | None) -> "AdaptiveK":
        """The next reply's controller: the call's k bounds and costs, the last reply's acceptance."""
        return cls(setup.max_draft_tokens, costs=setup.costs, start_k=setup.start_k,
                   acceptance=list(learned.acceptance) if learned is not None else None,
                   observed=learned.observed if learned is not None else 0)

    # --- model ------------------------------------------------------------------
    def expected_tokens(self, k: int) -> float:
        # Positions never reached yet borrow the acceptance of the deepest observed one:
        # acceptance varies slowly with depth, and a fixed prior there would pin k below
        # the first unexplored position forever.
        deepest = self.observed - 1
        return expected_tokens([self.alpha[i] if i <= deepest or deepest < 0 else self.alpha[deepest]
                                for i in range(k)], k)

    def rate(self, k: int) -> float:
        """Expected committed tokens per second for draft length k (0 if unknown)."""
        cost = self.costs.step_cost(k)
        return 0.0 if cost is None else self.expected_tokens(k) / cost

    def effective_rate(self, k: int) -> float:
        """``rate(k)``, discounted by ``SPECULATION_MARGIN`` when k > 0 (what choices compare)."""
        return self.rate(k) if k == 0 else self.rate(k) / self.SPECULATION_MARGIN

    def catchup_pays(self, k: int, catchup_tokens: int, expected_remaining: float | None) -> bool:
        """Whether drafting k now saves more over ``expected_remaining`` tokens than the catch-up costs."""
        one_off = self.costs.catchup_cost(catchup_tokens)
        if one_off == 0.0 or expected_remaining is None:
            return True
        rate_plain, rate_k = self.rate(0), self.effective_rate(k)
        if rate_plain <= 0 or rate_k <= rate_plain:
            return False
        return expected_remaining * (1 / rate_plain - 1 / rate_k) >= one_off

    def best_k(self, limit: int) -> int:
        """The k in 0..min(limit, max_k) with the highest :meth:`effective_rate` (pure: no probe,
        no state change); 0 before a plain step was measured."""
        limit = min(limit, self.max_k)
        if limit <= 0 or self.costs.target_cost(1) is None:
            return 0
        return max(range(limit + 1), key=self.effective_rate)

    # --- protocol -----------------------------------------------------------------
    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None,
               lookup_tokens: int = 0, lookup_match: int = 0) -> DraftPlan:
        """The next step's k, from the drafter's own order of sources (``lookup_*`` are not read: one
        acceptance model covers whatever the drafter proposes)."""
        return DraftPlan(self.choose_k(limit, catchup_tokens=catchup_tokens, expected_remaining=expected_remaining))

    def choose_k(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None) -> int:
        """k for the next step. ``catchup_tokens``: what the drafter must feed before drafting;
        ``expected_remaining``: tokens this reply is still expected to run (None = unknown).
        Probes and catch-up deferrals are counted here (not in :meth:`best_k`)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        if self.costs.target_cost(1) is None:
            return 0  # first step: measure a plain step before judging speculation
        best = self.best_k(limit)
        if best > 0 and not self.catchup_pays(best, catchup_tokens, expected_remaining):
            self.catchup_deferred += 1
            return 0  # not a k = 0 verdict on speculation itself: no probe is due for it
        if best == 0:
            self._plain_streak += 1
            if self._plain_streak >= self.probe_every and \
                    self.costs.catchup_cost(catchup_tokens) <= self.PROBE_CATCHUP_SHARE * self._plain_s_since_probe:
                self._plain_streak = 0
                self._plain_s_since_probe = 0.0
                return min(self._last_positive_k, limit)
            return 0
        self._plain_streak = 0
        self._plain_s_since_probe = 0.0
        self._last_positive_k = best
        return best

    def observe(self, step: StepOutcome) -> None:
        """Learn the acceptance per position from one step (its costs are the CostModel's)."""
        b = self.beta
        if step.drafted == 0:
            self._plain_s_since_probe += step.verify_s
        else:
            reached = min(step.accepted + 1, step.drafted)  # positions whose outcome the step observed
            for i in range(reached):
                if i >= self.observed > 0:
                    self.alpha[i] = self.alpha[self.observed - 1]  # start from what it borrowed
                outcome = 1.0 if i < step.accepted else 0.0
                self.alpha[i] = ema(self.alpha[i], outcome, b)
            self.observed = max(self.observed, reached)
            if step.accepted == step.drafted:
                # All accepted: the positions past the draft drift towards the last one reached.
                for i in range(reached, self.observed):
                    self.alpha[i] = ema(self.alpha[i], self.alpha[reached - 1], b)
        self.mode_s["speculative" if step.drafted else "plain"] += step.draft_s + step.verify_s

    def snapshot(self) -> AdaptiveSnapshot:
        return AdaptiveSnapshot(catchup_deferred=self.catchup_deferred, mode_s=tuple(self.mode_s.items()),
                                acceptance=tuple(self.alpha), observed=self.observed)
