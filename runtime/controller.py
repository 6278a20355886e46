"""Draft-length controllers: how many tokens to draft before the next verify, and from where.

``choose(limit) -> DraftPlan`` picks k in 0..limit (0 = a plain target step) and the drafter's
source to draft from (``ANY_SOURCE`` unless the controller chooses one); ``observe(step)``
feeds back how much of the step was accepted (its costs go to the CostModel, which
the loop feeds; a controller only reads it); ``snapshot()`` is
all the loop and the Generator read back (stats, and what the next reply starts from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from ..errors import InvalidParameterError
from .costs import EMA_WEIGHT, CostModel, StepOutcome, ema, expected_tokens
from .drafting import ANY_SOURCE, LOOKUP_SOURCE, MODEL_SOURCE, SOURCES, STRONG_MATCH


@dataclass(frozen=True)
class DraftPlan:
    """A controller's choice for the next step."""

    k: int  # tokens to draft, 0..limit (0: a plain target step)
    source: str = ANY_SOURCE  # which of the drafter's sources drafts them (runtime/drafting.py SOURCES)

    def __post_init__(self) -> None:
        if self.k < 0 or self.source not in SOURCES:
            raise ValueError(f"a draft plan needs k >= 0 and a source in {SOURCES}; got {self.k}, {self.source!r}")


PLAIN = DraftPlan(0)


@dataclass(frozen=True)
class ControllerSnapshot:
    """What a controller reports after a run (read by the Generator, never probed)."""

    acceptance: tuple[float, ...] = ()  # learned per-position acceptance (empty: none learned)
    observed: int = 0  # positions 0..observed-1 have had at least one outcome
    catchup_deferred: int = 0  # steps run plain because a catch-up would not have paid off
    mode_s: tuple[tuple[str, float], ...] = ()  # ("speculative" | "plain", seconds) pairs; empty: not tracked
    # The default controller's (DefaultK) lookup side, one entry per LOOKUP_CONFIDENCE class, and its
    # exploration budget, carried to the next reply.
    lookup_acceptance: tuple[tuple[float, ...], ...] = ()
    lookup_observed: tuple[int, ...] = ()
    budget_s: float | None = None  # None: not tracked (other controllers)
    plain_s: float = 0.0  # what plain decoding would have spent on this reply's steps (DefaultK)
    overhead_s: float = 0.0  # net seconds speculation spent beyond that (negative: it saved time)
    lookup_steps: int = 0  # steps DefaultK served with a lookup (guesses included)
    model_steps: int = 0  # ... and with the draft model
    guess_steps: int = 0  # ... and with a guess (a lookup continuing a 1-token match)
    # DefaultK: the draft model's realized (tokens, seconds) per step, EMAs (catch-ups included).
    model_realized: tuple[float, float] | None = None
    lookup_share: float | None = None  # DefaultK: the share of decode tokens its strong lookups committed


class Controller(Protocol):
    """Chooses the draft length k of each step."""

    name: str

    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None,
               lookup_tokens: int = 0, lookup_match: int = 0) -> DraftPlan:
        """k in 0..limit and its source. ``catchup_tokens``: what the drafter's model reads before
        drafting; ``expected_remaining``: tokens this reply is still expected to run (None =
        unknown); ``lookup_tokens``/``lookup_match``: what the drafter's lookup has ready (no model)
        and the match length it continues (its ``LookupOffer``; match 0: not known)."""
        ...

    def observe(self, step: StepOutcome) -> None: ...

    def snapshot(self) -> ControllerSnapshot: ...


class FixedK:
    """Always draft ``k`` tokens (fewer only near the context or token limit)."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise InvalidParameterError(f"draft_tokens must be >= 0; got {k}")
        self.k = k

    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None,
               lookup_tokens: int = 0, lookup_match: int = 0) -> DraftPlan:
        return DraftPlan(max(min(self.k, limit), 0))

    def observe(self, step: StepOutcome) -> None:
        pass

    def snapshot(self) -> ControllerSnapshot:
        return ControllerSnapshot()


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
    ``beta`` (:data:`~specedge.runtime.costs.EMA_WEIGHT`: a change in acceptance is followed
    within ~5 steps, yet one unlucky block does not switch speculation off). Acceptance at position i is observed only where the step
    reached it (all earlier tokens accepted). The step costs are the CostModel's
    (``costs``), which the loop feeds; this class only reads them.

    Positions never reached yet borrow the acceptance of the deepest observed one. A position
    that was reached once but lies past the k now chosen is no longer observed, so one early
    rejection there would pin k below it for good; instead, every step that accepts all it drafted
    moves the estimates past it towards the last position's (the same smoothness in depth, at
    the same EMA weight: a stale estimate is forgotten as fast as a fresh one is learned), so k
    grows again where shorter drafts keep being accepted, and falls again at the next rejection. (Traced on the bench's agent replies: 12-token copies from an earlier reply, each
    accepted, drafted one token a step after a single early miss at position 2.)

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

    PRIOR_ACCEPTANCE = 0.6  # optimistic start: speculation is tried before it is judged
    PROBE_CATCHUP_SHARE = 0.1  # a probe's catch-up may cost at most 10% of the plain time it follows
    # Speculation must promise this much more than a plain step before it is chosen. The cost
    # model leaves out per-step bookkeeping (the draft's cache sync, the verifier, the commit):
    # realised/predicted speedup came out at 0.88-0.96 in the Qwen int4 bench on the AVX2 box,
    # so a predicted 1.05x was a measured loss. Below this margin, plain steps are the safe bet.
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

    def snapshot(self) -> ControllerSnapshot:
        return ControllerSnapshot(tuple(self.alpha), self.observed, self.catchup_deferred, tuple(self.mode_s.items()))


class DefaultK:
    """The default policy: per step, the source with the most expected tokens per second (a
    lookup, the draft model, or a plain step); exploring the draft model is paid from a budget.

    Per step, with ``lookup_tokens``/``lookup_match`` what the drafter's lookup has ready
    (runtime/auto_drafter.py), as llama.cpp keeps, among its drafters, the one with the most
    expected accepted tokens per cost:

    1. the lookup (SuffixDecoding, Oliaro et al., arXiv 2411.04975: it runs no model, so its
       draft costs microseconds): its k is chosen by an :class:`AdaptiveK` that sees the lookup's
       own per-position acceptance and the CostModel's target costs with a free draft
       (``CostModel.lookup_view``), capped where verifying more rows stops paying (on a 2-row
       exact step one token is free). Acceptance is learned apart for each class of offer
       (``LOOKUP_CONFIDENCE``): a 12-token match with an earlier reply is right far more often
       than a 2-token one (one shared estimate held the long copies of a repeated reply to 1-3
       tokens a step), and a *guess*, one token after a 1-token match, less often still; on an
       exact step its row is otherwise a recompute, so even a guess right a third of the time
       pays;
    2. the draft model: an :class:`AdaptiveK` over its acceptance and the CostModel's measured c,
       v(k) and catch-up chooses k, 0 when no k beats a plain step. Where a lookup was drafted
       too, the model runs instead only when its expected rate, this step's catch-up included,
       beats the lookup's (a 1-2 token lookup continuing a weak match against a draft model that
       is right 9 times in 10). A catch-up is a one-off the rest of the reply must repay
       (``AdaptiveK.catchup_pays``), but only the tokens the model itself will serve repay it: the
       expected rest of the reply is scaled by the share of tokens strong lookups do *not* commit
       (:meth:`lookup_share`, carried across replies). Traced on the bench's agent workload (Qwen int4
       on a 2-core AVX2 EPYC, where the draft's 64-token prompt prefill costs 9 plain steps): with
       lookups committing ~70% of each reply, the model started in most replies, won back 1-2 plain
       steps over its 4-9 steps, and ran at 198 ms a token against 139 for plain steps;
    3. otherwise a plain step.

    What the model really delivers: a model step also pays the catch-up on whatever lookup and plain
    steps committed since its last step, and it runs where lookups are weak (the harder tokens). So
    the model is chosen only while its *realized* rate, the committed tokens over the seconds of its
    steps (``REALIZED_WEIGHT`` EMAs that start from the prediction and are carried across replies;
    catch-ups included, but for the deferred prompt prefill of a reply's first model step), beats the
    rate of what it would replace (the lookup's, or a plain step's). On the bench's agent workload
    (JSON tool calls, Qwen int4 pair, six calls) the default's model steps cost 56 ms a token against
    30 for its lookups and 50-53 for plain steps; the default without its model ran 1.61x, with it
    1.39x (``specedge bench``'s ms/tok column; an interleaved A/B). While the model is passed over,
    its realized estimate drifts back towards the prediction (``REALIZED_FORGET`` a step), so it is
    tried again now and then (within the budget below); probes are exempt, as they are how a model
    that was passed over gets measured again.

    Exploration budget: every draft-model step (its drafts might all be rejected) is allowed
    only when the budget covers what it would then lose (``CostModel.loss_if_rejected``: its
    catch-up, its draft steps and its longer verify, against a plain step); otherwise its k
    shrinks until it fits, down to 0. The budget earns ``EXPLORE_SHARE`` of the plain-decoding
    time of every step, and each speculative step's realised net cost is charged (a step that
    saved time, lookups included, credits it). So as long as the realised costs match the
    model's, the draft model's net cost stays at most ``EXPLORE_SHARE`` of plain time where it
    never pays (priors, probes and catch-ups included), while speculation that pays funds the
    model's next steps. Lookups are not gated (a budget gate there held the repeat workload's
    lookups to one token until gains had built up: 1.72x against suffix-adaptive's 2.13x).
    The budget is capped at ``EXPLORE_SHARE`` of ``BUDGET_STEPS`` plain steps, so a long
    winning run cannot bank enough to buy a long losing one.
    """

    name = "default"

    # Where speculation never pays, probes, priors and catch-ups cost at most 2% of plain time
    # (the bound): below the run-to-run noise of a shared CPU box (5-10%), yet enough to
    # re-probe a draft model every ~100 plain steps at a probe costing ~2 target steps.
    EXPLORE_SHARE = 0.02
    # The budget holds at most 2% of 512 plain steps (~10 target steps): a probe with a full
    # 64-token catch-up fits, a winning streak cannot fund a long losing one.
    BUDGET_STEPS = 512
    # The model's realized rate: EMA weight per model step (one step's tokens are all-or-nothing, so
    # slower than the acceptance's EMA_WEIGHT: ~10 steps), and the drift back towards the predicted
    # rate per step it is passed over for its realized rate (~35 steps to forget half of the evidence).
    REALIZED_WEIGHT = 0.1
    REALIZED_FORGET = 0.02

    # The offer classes, weakest evidence first: a guess (``LookupOffer.guess``: a 1-token match),
    # then strong lookups by the tokens they had ready: 1-2 (a short match), 3 up to max_k - 1, and
    # a full offer of max_k (``None`` here). The suffix drafter offers a full max_k only after a
    # match at least that long: on the bench's repeated questions, the memory's 12-token matches
    # (right) then no longer share an estimate with 6-7-token copies out of the system prompt
    # (often wrong past their third token), which had held the repeats to k = 1.
    LOOKUP_CONFIDENCE = ("guess", 1, 3, None)
    # Where each class starts (per-position acceptance before it has seen an outcome): the pooled
    # first-position acceptance of the default's lookups over every bench workload (2 prompts each,
    # 64 tokens), measured alike with the Qwen2.5-Coder-1.5B int4 target (0.56, 0.82, 0.92) and the
    # SmolLM2-135M fp32 one (0.60, 0.81, 0.90): a property of the text and the match length, not of
    # the CPU. The old shared prior (0.6) cut the first 12-token offers of a repeated reply to 1-3
    # tokens; the bench's voice and repeat replies are ~14 tokens, so the start decides much of them.
    # Guesses: 51 of 133 right (0.38) where the Qwen int4 target's plain replies had no strong match,
    # pooled over the bench's workloads (0.19 on chat, 0.57 on code).
    LOOKUP_PRIORS = (0.4, 0.6, 0.8, 0.9)

    # The lookup share (``lookup_share``) carried from earlier replies counts as this many tokens of
    # evidence against the current reply's own: half a typical 64-token reply, so a reply unlike the
    # last ones outweighs them after ~32 tokens, and its first tokens are not judged on themselves alone.
    SHARE_PRIOR_TOKENS = 32

    def __init__(self, max_k: int, *, costs: CostModel, has_model: bool, start_k: int | None = None,
                 model_acceptance: list[float] | None = None, model_observed: int = 0,
                 lookup_acceptance: Sequence[Sequence[float]] | None = None, lookup_observed: Sequence[int] = (),
                 budget_s: float = 0.0, model_realized: Sequence[float] | None = None,
                 lookup_share: float | None = None) -> None:
        """``costs``: the drafter's one CostModel (the loop feeds it); the ``*_acceptance``,
        ``budget_s``, ``model_realized`` and ``lookup_share``: what the previous reply ended with (its
        :meth:`snapshot`; the lookup's, one entry per ``LOOKUP_CONFIDENCE`` class)."""
        if model_realized is not None and (len(model_realized) != 2 or
                                           not all(math.isfinite(x) and x > 0 for x in model_realized)):
            raise InvalidParameterError(f"model_realized needs (tokens, seconds) > 0; got {model_realized!r}")
        if lookup_share is not None and not 0.0 <= lookup_share <= 1.0:
            raise InvalidParameterError(f"lookup_share must be in [0, 1]; got {lookup_share!r}")
        self.carried_lookup_share = lookup_share
        self.committed = {"lookup": 0, "all": 0}  # decode tokens this reply's steps committed
        self.costs = costs
        # Lower bounds (tokens ready) of the strong classes, LOOKUP_CONFIDENCE[1:].
        self.lookup_bounds = tuple(max_k if low is None else low for low in self.LOOKUP_CONFIDENCE[1:])
        view = costs.lookup_view()
        carried = list(lookup_acceptance or ())
        observed = list(lookup_observed)
        self.lookups = tuple(AdaptiveK(max_k, costs=view, start_k=start_k,
                                       acceptance=list(carried[i]) if i < len(carried) and len(carried[i])
                                       else [prior] * max_k,
                                       observed=observed[i] if i < len(observed) else 0)
                             for i, prior in enumerate(self.LOOKUP_PRIORS))
        self.model = AdaptiveK(max_k, costs=costs, start_k=start_k, acceptance=model_acceptance,
                               observed=model_observed) if has_model else None
        self.budget_s = max(float(budget_s), 0.0)
        self.model_realized = None if model_realized is None else [float(x) for x in model_realized]
        self.plain_s = 0.0
        self.overhead_s = 0.0
        self.mode_s = {"speculative": 0.0, "plain": 0.0}
        self.steps = {"lookup": 0, "model": 0, "plain": 0, "guess": 0}  # how the steps were served

    def lookup_share(self) -> float:
        """The share of decode tokens strong lookups (guesses excluded: once the model runs, it takes
        their positions, ``model_beats``) commit: this reply's, shrunk towards the carried share by
        ``SHARE_PRIOR_TOKENS`` (0 before any evidence)."""
        lookup, total = self.committed["lookup"], self.committed["all"]
        if self.carried_lookup_share is not None:
            lookup += self.carried_lookup_share * self.SHARE_PRIOR_TOKENS
            total += self.SHARE_PRIOR_TOKENS
        return lookup / total if total else 0.0

    def budget_cap(self) -> float:
        t_plain = self.costs.target_cost(1)
        return float("inf") if t_plain is None else self.EXPLORE_SHARE * self.BUDGET_STEPS * t_plain

    def lookup_side(self, offered: int, match: int = 0) -> AdaptiveK:
        """The lookup controller for an offer of ``offered`` tokens continuing a ``match``-token
        match (0: not known): its LOOKUP_CONFIDENCE class.

        A class that has observed nothing yet starts from the nearest weaker class that has, where
        that one did better than this class's prior: a longer match is at least as good evidence as
        a shorter one, so what the short offers achieved is a floor for the long ones. Traced on the
        bench's hostile-random-chars (a copy whose every draft is right): with every class starting
        from its prior, the first 12-token offers were cut to 1-3 tokens although the 1-2 token
        offers before them had all been accepted.
        """
        if 0 < match < STRONG_MATCH:
            index = 0
        else:
            index = 1 + max(i for i, low in enumerate(self.lookup_bounds) if offered >= low or i == 0)
        side = self.lookups[index]
        if side.observed == 0:
            seen = next((other for other in reversed(self.lookups[:index]) if other.observed), None)
            if seen is not None and seen.expected_tokens(1) > side.expected_tokens(1):
                side.alpha = list(seen.alpha)
                side.observed = seen.observed
        return side

    def choose(self, limit: int, *, catchup_tokens: int = 0, expected_remaining: float | None = None,
               lookup_tokens: int = 0, lookup_match: int = 0) -> DraftPlan:
        if limit <= 0 or self.costs.target_cost(1) is None:
            return PLAIN  # first step: measure a plain step before judging speculation
        lookup: tuple[float, DraftPlan] | None = None  # (effective rate, plan)
        if lookup_tokens > 0:
            # A lookup is not gated: its draft is free and its k is the lookup's own AdaptiveK choice
            # (a rejected lookup costs only the extra verify rows, and its acceptance cuts k within steps).
            side = self.lookup_side(lookup_tokens, lookup_match)
            k = side.choose_k(min(limit, lookup_tokens), expected_remaining=expected_remaining)
            if k > 0:
                lookup = (side.effective_rate(k), DraftPlan(k, LOOKUP_SOURCE))
        if self.model is None or (lookup is not None and not self.model_beats(lookup[0], limit, catchup_tokens)):
            return lookup[1] if lookup is not None else PLAIN
        # A catch-up is repaid only by the tokens the model itself will serve: lookups take the positions
        # where they have an offer, so the rest of the reply left to the model is its non-lookup share.
        model_remaining = None if expected_remaining is None else expected_remaining * (1.0 - self.lookup_share())
        k = self.model.choose_k(limit, catchup_tokens=catchup_tokens, expected_remaining=model_remaining)
        # The draft model's probes, priors and catch-ups run only when the budget covers their loss.
        while k > 0 and self.costs.loss_if_rejected(k, catchup_tokens) > self.budget_s:
            k -= 1  # what the budget cannot cover if every draft is rejected
        # ... and only while what it realized beats what it would replace (undiscounted rates); a probe
        # (its prediction chose plain steps) is what measures it again, so a probe is not held back.
        replaced = lookup[0] * AdaptiveK.SPECULATION_MARGIN if lookup is not None else self.model.rate(0)
        if k > 0 and self.realized_rate() <= replaced and self.model.best_k(limit) > 0:
            self._forget_realized(k)
            k = 0
        if k > 0:
            return DraftPlan(k, MODEL_SOURCE)
        return lookup[1] if lookup is not None else PLAIN

    def realized_rate(self) -> float:
        """Tokens per second the draft model's steps committed, catch-ups included (inf: none yet)."""
        if self.model_realized is None:
            return math.inf
        tokens, seconds = self.model_realized
        return tokens / seconds

    def _predicted(self, k: int) -> tuple[float, float] | None:
        """(tokens, seconds) the cost model predicts for a model step drafting k."""
        seconds = self.costs.step_cost(k)
        return None if seconds is None else (self.model.expected_tokens(k), seconds)

    def _forget_realized(self, k: int) -> None:
        predicted = self._predicted(k)
        if predicted is not None and self.model_realized is not None:
            self.model_realized = [ema(old, new, self.REALIZED_FORGET) for old, new in zip(self.model_realized, predicted)]

    def model_beats(self, lookup_rate: float, limit: int, catchup_tokens: int) -> bool:
        """Whether the draft model's best k promises more tokens per second than ``lookup_rate``
        (a lookup's effective rate), with this step's catch-up charged to this step alone (pure)."""
        k = self.model.best_k(limit)
        cost = self.costs.step_cost(k)
        if k == 0 or cost is None:
            return False
        cost += self.costs.catchup_cost(catchup_tokens)
        return self.model.expected_tokens(k) / cost / AdaptiveK.SPECULATION_MARGIN > lookup_rate

    def observe(self, step: StepOutcome) -> None:
        """Charge the step to the budget, then teach the side that drafted it (plain steps: both)."""
        t_plain = self.costs.target_cost(1)
        if step.drafted == 0:
            plain, spent = step.verify_s, step.verify_s
            for side in (*self.lookups, self.model):
                if side is not None:
                    side.observe(step)  # plain time since the side's last probe
            self.steps["plain"] += 1
        else:
            # The step committed accepted + 1 tokens, which plain decoding makes in as many steps.
            plain = (step.accepted + 1) * (t_plain if t_plain is not None else step.verify_s)
            spent = step.draft_s + step.catchup_s + step.verify_s
            lookup = step.lookup or self.model is None
            # A pipelined carry offers no lookup count: what it drafted stands for it.
            side = self.lookup_side(step.offered or step.drafted, step.match) if lookup else self.model
            if not lookup:
                # The reply's first model step pays the deferred prompt prefill, a one-off already
                # weighed against the whole reply (AdaptiveK.catchup_pays): not a cost of its steps.
                first = self.steps["model"] == 0
                self._observe_realized(step.drafted, step.accepted + 1, spent - step.catchup_s if first else spent)
            side.observe(step)
            self.steps["lookup" if lookup else "model"] += 1
            self.steps["guess"] += int(lookup and 0 < step.match < STRONG_MATCH)
        committed = step.accepted + 1
        self.committed["all"] += committed
        # Positions a strong lookup took: a guess's (a 1-token match) would go to the model once it runs.
        strong_lookup = step.drafted and (step.lookup or self.model is None) and not 0 < step.match < STRONG_MATCH
        self.committed["lookup"] += committed if strong_lookup else 0
        self.plain_s += plain
        self.overhead_s += spent - plain
        self.budget_s = min(self.budget_s + self.EXPLORE_SHARE * plain - (spent - plain), self.budget_cap())
        self.mode_s["speculative" if step.drafted else "plain"] += spent

    def _observe_realized(self, drafted: int, tokens: int, seconds: float) -> None:
        """Fold one model step into the realized EMAs, which start from the prediction the step was
        chosen on (called before the model's side learns from the step)."""
        if self.model_realized is None:
            predicted = self._predicted(drafted)
            if predicted is None:
                return
            self.model_realized = list(predicted)
        self.model_realized = [ema(old, new, self.REALIZED_WEIGHT)
                               for old, new in zip(self.model_realized, (tokens, seconds))]

    def snapshot(self) -> ControllerSnapshot:
        model = self.model.snapshot() if self.model is not None else ControllerSnapshot()
        lookups = [side.snapshot() for side in self.lookups]
        return ControllerSnapshot(model.acceptance, model.observed,
                                  model.catchup_deferred + sum(s.catchup_deferred for s in lookups),
                                  tuple(self.mode_s.items()), tuple(s.acceptance for s in lookups),
                                  tuple(s.observed for s in lookups), self.budget_s, self.plain_s, self.overhead_s,
                                  self.steps["lookup"], self.steps["model"], self.steps["guess"],
                                  tuple(self.model_realized) if self.model_realized is not None else None,
                                  self.lookup_share() if self.committed["all"] or self.carried_lookup_share is not None
                                  else None)
