"""Draft-length controllers: how many tokens to draft before the next verify.

``choose(limit) -> k`` picks 0..limit (0 = a plain target step); ``observe(...)``
feeds back what the step cost and how much of it was accepted; ``snapshot()`` is
all the loop and the Generator read back (stats, and what the next reply starts from).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class ControllerSnapshot:
    """What a controller reports after a run (read by the Generator, never probed)."""

    acceptance: tuple[float, ...] = ()  # learned per-position acceptance (empty: none learned)
    observed: int = 0  # positions 0..observed-1 have had at least one outcome
    catchup_deferred: int = 0  # steps run plain because a catch-up would not have paid off
    mode_s: tuple[tuple[str, float], ...] = ()  # ("speculative" | "plain", seconds) pairs; empty: not tracked


class Controller(Protocol):
    """Chooses the draft length k of each step."""

    name: str

    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None) -> int:
        """k in 0..limit. ``catchup_tokens``: what the drafter reads before drafting;
        ``expected_remaining``: tokens this reply is still expected to run (None = unknown)."""
        ...

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float, *,
                catchup_s: float = 0.0, catchup_tokens: int = 0) -> None: ...

    def snapshot(self) -> ControllerSnapshot: ...


class FixedK:
    """Always draft ``k`` tokens (fewer only near the context or token limit)."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise InvalidParameterError(f"draft_tokens must be >= 0; got {k}")
        self.k = k

    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None) -> int:
        return min(self.k, limit)

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float, *,
                catchup_s: float = 0.0, catchup_tokens: int = 0) -> None:
        pass

    def snapshot(self) -> ControllerSnapshot:
        return ControllerSnapshot()


@dataclass
class CostProfile:
    """Step costs in seconds: one target step of n tokens, and one draft token."""

    target_s: dict[int, float] = field(default_factory=dict)  # verify length n (= k+1) -> seconds
    draft_token_s: float | None = None
    draft_catchup_token_s: float | None = None  # per token of a catch-up feed (the draft's prefill)

    def as_dict(self) -> dict:
        return {"target_s": {str(n): t for n, t in sorted(self.target_s.items())},
                "draft_token_s": self.draft_token_s, "draft_catchup_token_s": self.draft_catchup_token_s}

    @classmethod
    def from_dict(cls, obj: dict) -> "CostProfile":
        return cls({int(n): float(t) for n, t in obj.get("target_s", {}).items()}, obj.get("draft_token_s"),
                   obj.get("draft_catchup_token_s"))


class AdaptiveK:
    """Online cost model choosing k to maximise expected committed tokens per second.

    Following Leviathan et al. 2023 (Thm 3.8) with per-position acceptance: if
    ``alpha[i]`` is the probability that draft token i+1 is accepted given all earlier
    ones were, a step drafting k tokens commits ``E(k) = 1 + sum_{j<=k} prod_{i<j} alpha[i]``
    tokens and costs ``T(k) = k * t_draft + t_target(k+1)``. The controller picks
    ``argmax_k E(k) / T(k)`` over k = 0..limit; k = 0 is a plain target step
    (E = 1, T = t_target(1)), so when speculation does not pay it switches off. A k > 0
    must beat the plain rate by ``SPECULATION_MARGIN`` (the model's measured optimism).

    Update rule: exponential moving averages with weight ``beta`` (0.2: a change in
    acceptance is followed within ~5 steps, yet one unlucky block does not switch
    speculation off). Acceptance at position i is observed only where the step
    reached it (all earlier tokens accepted). Costs are averaged per verify length;
    unmeasured lengths are interpolated from measured ones, or start from an
    optimistic prior so that they get tried and measured.

    Positions never reached yet borrow the acceptance of the deepest observed one.

    Probing: while k = 0 wins, no acceptance is observed, so every ``probe_every``
    plain steps it drafts once at the last positive k to refresh the estimates.

    One-off catch-up: before a draft model can propose it must read the history it
    has not seen (its deferred prompt prefill, or tokens committed by plain steps).
    That cost ``C = catchup_tokens * t_catchup`` is paid once, and only the rest of
    the reply can pay it back, so speculation starts only when
    ``expected_remaining * (1/rate(0) - 1/rate(k)) >= C``, the time saved over the
    tokens still expected exceeding the one-off. A probe that would pay a catch-up
    runs only when C is at most ``PROBE_CATCHUP_SHARE`` of the plain time since the
    last probe, which caps what exploring can cost. Without this, a 15-token voice
    reply spent half its decode time prefilling a draft it hardly used.
    """

    name = "adaptive"

    # An untried verify length is assumed to cost 1 + 0.15 per extra token of a 1-token step:
    # optimistic for memory-bound decoding, so it is tried once and then measured.
    PRIOR_VERIFY_SLOPE = 0.15
    PRIOR_ACCEPTANCE = 0.6  # optimistic start: speculation is tried before it is judged
    # Until a catch-up is measured, a catch-up token is assumed to cost this share of a draft
    # step: a batched feed reads the weights once for all its tokens, but is compute-bound
    # (`specedge tune`, int4 Qwen 0.5B feeding 64 tokens on a 2-core AVX2 EPYC: 0.30-0.34).
    PRIOR_CATCHUP_SHARE = 0.35
    PROBE_CATCHUP_SHARE = 0.1  # a probe's catch-up may cost at most 10% of the plain time it follows
    # Speculation must promise this much more than a plain step before it is chosen. The cost
    # model leaves out per-step bookkeeping (the draft's cache sync, the verifier, the commit):
    # realised/predicted speedup came out at 0.88-0.96 in the Qwen int4 bench on the AVX2 box,
    # so a predicted 1.05x was a measured loss. Below this margin, plain steps are the safe bet.
    SPECULATION_MARGIN = 1.1
    USUAL_FEED = 2  # a normal step feeds the target's correction/bonus token (+ the last draft token)

    def __init__(self, max_k: int, *, beta: float = 0.2, probe_every: int = 16,
                 profile: CostProfile | None = None, start_k: int | None = None,
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
        self.profile = profile or CostProfile()
        self._plain_streak = 0
        self._plain_s_since_probe = 0.0
        self._last_positive_k = start_k if start_k else min(4, max_k)
        self.mode_s = {"speculative": 0.0, "plain": 0.0}
        self.catchup_deferred = 0  # steps run plain because a catch-up would not have paid off

    # --- model ------------------------------------------------------------------
    def target_cost(self, n: int) -> float | None:
        known = self.profile.target_s
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

    def expected_tokens(self, k: int) -> float:
        # Positions never reached yet borrow the acceptance of the deepest observed one:
        # acceptance varies slowly with depth, and a fixed prior there would pin k below
        # the first unexplored position forever.
        deepest = self.observed - 1
        total, reach = 1.0, 1.0
        for i in range(k):
            reach *= self.alpha[i] if i <= deepest or deepest < 0 else self.alpha[deepest]
            total += reach
        return total

    def rate(self, k: int) -> float:
        """Expected committed tokens per second for draft length k (0 if unknown)."""
        t_target = self.target_cost(k + 1)
        if t_target is None:
            return 0.0
        t_draft = (self.profile.draft_token_s or 0.0) * k
        return self.expected_tokens(k) / (t_target + t_draft)

    def effective_rate(self, k: int) -> float:
        """``rate(k)``, discounted by ``SPECULATION_MARGIN`` when k > 0 (what choices compare)."""
        return self.rate(k) if k == 0 else self.rate(k) / self.SPECULATION_MARGIN

    def catchup_cost(self, catchup_tokens: int) -> float:
        """Seconds to feed ``catchup_tokens`` of unseen history to the draft (0 for the usual feed)."""
        if catchup_tokens <= self.USUAL_FEED:
            return 0.0
        per_token = self.profile.draft_catchup_token_s
        if per_token is None:
            per_token = (self.profile.draft_token_s or 0.0) * self.PRIOR_CATCHUP_SHARE
        return catchup_tokens * per_token

    def catchup_pays(self, k: int, catchup_tokens: int, expected_remaining: float | None) -> bool:
        """Whether drafting k now saves more over ``expected_remaining`` tokens than the catch-up costs."""
        one_off = self.catchup_cost(catchup_tokens)
        if one_off == 0.0 or expected_remaining is None:
            return True
        rate_plain, rate_k = self.rate(0), self.effective_rate(k)
        if rate_plain <= 0 or rate_k <= rate_plain:
            return False
        return expected_remaining * (1 / rate_plain - 1 / rate_k) >= one_off

    # --- protocol -----------------------------------------------------------------
    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None) -> int:
        """k for the next step. ``catchup_tokens``: what the drafter must feed before drafting;
        ``expected_remaining``: tokens this reply is still expected to run (None = unknown)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        if self.target_cost(1) is None:
            return 0  # first step: measure a plain step before judging speculation
        best = max(range(limit + 1), key=self.effective_rate)
        if best > 0 and not self.catchup_pays(best, catchup_tokens, expected_remaining):
            self.catchup_deferred += 1
            return 0  # not a k = 0 verdict on speculation itself: no probe is due for it
        if best == 0:
            self._plain_streak += 1
            if self._plain_streak >= self.probe_every and \
                    self.catchup_cost(catchup_tokens) <= self.PROBE_CATCHUP_SHARE * self._plain_s_since_probe:
                self._plain_streak = 0
                self._plain_s_since_probe = 0.0
                return min(self._last_positive_k, limit)
            return 0
        self._plain_streak = 0
        self._plain_s_since_probe = 0.0
        self._last_positive_k = best
        return best

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float, *,
                catchup_s: float = 0.0, catchup_tokens: int = 0) -> None:
        """Feed back one step. ``draft_s`` excludes the catch-up, reported apart as
        ``catchup_s`` seconds for ``catchup_tokens`` tokens."""
        b = self.beta
        n_verify = n_drafted + 1
        old = self.profile.target_s.get(n_verify)
        self.profile.target_s[n_verify] = verify_s if old is None else (1 - b) * old + b * verify_s
        if n_drafted == 0:
            self._plain_s_since_probe += verify_s
        if catchup_tokens > self.USUAL_FEED and catchup_s > 0:
            per_token = catchup_s / catchup_tokens
            old_c = self.profile.draft_catchup_token_s
            self.profile.draft_catchup_token_s = per_token if old_c is None else (1 - b) * old_c + b * per_token
        if n_drafted > 0:
            per_token = draft_s / n_drafted
            old_d = self.profile.draft_token_s
            self.profile.draft_token_s = per_token if old_d is None else (1 - b) * old_d + b * per_token
            reached = min(n_accepted + 1, n_drafted)  # positions whose outcome the step observed
            for i in range(reached):
                if i >= self.observed > 0:
                    self.alpha[i] = self.alpha[self.observed - 1]  # start from what it borrowed
                outcome = 1.0 if i < n_accepted else 0.0
                self.alpha[i] = (1 - b) * self.alpha[i] + b * outcome
            self.observed = max(self.observed, reached)
        self.mode_s["speculative" if n_drafted else "plain"] += draft_s + verify_s

    def snapshot(self) -> ControllerSnapshot:
        return ControllerSnapshot(tuple(self.alpha), self.observed, self.catchup_deferred, tuple(self.mode_s.items()))
