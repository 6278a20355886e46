"""DefaultK: the default policy. Per step the source (lookup, guess, draft model, plain) with the
most expected tokens per second; the draft model's possible losses paid from an exploration budget.

Why each rule and constant has its value, with the traces behind them: docs/design/policy.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ...errors import InvalidParameterError
from ..costs import CostModel, StepOutcome, ema
from ..drafting import LOOKUP_SOURCE, MODEL_SOURCE, STRONG_MATCH
from .adaptive import AdaptiveK, AdaptiveSnapshot
from .base import PLAIN, DraftPlan, PolicySetup, Snapshot


@dataclass(frozen=True)
class DefaultSnapshot(Snapshot):
    """What a DefaultK carries to the next reply, and its own account of this one."""

    acceptance: tuple[float, ...] = ()  # the draft model's per-position acceptance (empty: none learned)
    observed: int = 0  # ... positions 0..observed-1 have had at least one outcome
    # The lookup's, one entry per LOOKUP_CONFIDENCE class.
    lookup_acceptance: tuple[tuple[float, ...], ...] = ()
    lookup_observed: tuple[int, ...] = ()
    budget_s: float = 0.0  # the exploration budget left
    plain_s: float = 0.0  # what plain decoding would have spent on this reply's steps
    overhead_s: float = 0.0  # net seconds speculation spent beyond that (negative: it saved time)
    lookup_steps: int = 0  # steps served with a lookup (guesses included)
    model_steps: int = 0  # ... and with the draft model
    guess_steps: int = 0  # ... and with a guess (a lookup continuing a 1-token match)
    model_realized: tuple[float, float] | None = None  # the draft model's realized (tokens, seconds) per step, EMAs
    lookup_share: float | None = None  # the share of decode tokens strong lookups committed (None: no evidence)

    def counters(self) -> dict[str, float]:
        return {"lookup_steps": self.lookup_steps, "guess_steps": self.guess_steps, "model_steps": self.model_steps,
                "explore_plain_s": self.plain_s, "explore_overhead_s": self.overhead_s}


class DefaultK:
    """The default policy: per step, the source with the most expected tokens per second (a
    lookup, the draft model, or a plain step); exploring the draft model is paid from a budget.

    Per step, with ``lookup_tokens``/``lookup_match`` what the drafter's lookup has ready
    (runtime/auto_drafter.py), as llama.cpp keeps, among its drafters, the one with the most
    expected accepted tokens per cost:

    1. the lookup (SuffixDecoding, Oliaro et al., arXiv 2411.04975: it runs no model, so its draft
       costs microseconds): its k is chosen by an :class:`AdaptiveK` that sees the lookup's own
       per-position acceptance and the CostModel's target costs with a free draft
       (``CostModel.lookup_view``). Acceptance is learned apart for each class of offer
       (``LOOKUP_CONFIDENCE``), since a long match is right far more often than a short one;
    2. the draft model: an :class:`AdaptiveK` over its acceptance and the CostModel's measured c,
       v(k) and catch-up chooses k, 0 when no k beats a plain step. Where a lookup was drafted too,
       the model runs instead only when its expected rate, this step's catch-up included, beats the
       lookup's. A catch-up is a one-off that only the tokens the model itself will serve repay: the
       expected rest of the reply is scaled by the share strong lookups do *not* commit
       (:meth:`lookup_share`, carried across replies);
    3. otherwise a plain step.

    What the model really delivers: the model is chosen only while its *realized* rate (committed
    tokens over the seconds of its steps, catch-ups included but for the reply's first deferred
    prompt prefill; ``REALIZED_WEIGHT`` EMAs started from the prediction and carried across replies)
    beats the rate of what it would replace (the lookup's, or a plain step's). While passed over, it
    drifts back towards the prediction (``REALIZED_FORGET`` a step), so it is tried again now and
    then; probes are exempt, as they are how such a model gets measured again.

    Exploration budget: every draft-model step runs only when the budget covers what it would lose
    if all its drafts were rejected (``CostModel.loss_if_rejected``); otherwise its k shrinks until
    it fits, down to 0. The budget earns ``EXPLORE_SHARE`` of the plain-decoding time of every step
    and is charged each speculative step's realised net cost (a step that saved time credits it),
    so where speculation never pays the model costs at most ``EXPLORE_SHARE`` of plain time. Lookups
    are not gated. The budget is capped at ``EXPLORE_SHARE`` of ``BUDGET_STEPS`` plain steps.

    Why each rule, with the traces and benchmark numbers behind them: docs/design/policy.md.
    """

    name = "default"

    # Where speculation never pays, probes, priors and catch-ups cost at most 2% of plain time
    # (the bound): below the run-to-run noise of a shared CPU box (5-10%), yet enough to
    # re-probe a draft model every ~100 plain steps at a probe costing ~2 target steps.
    EXPLORE_SHARE = 0.02
    # The budget holds at most 2% of 512 plain steps (~10 target steps): a probe with a full
    # 64-token catch-up fits, a winning streak cannot fund a long losing one.
    BUDGET_STEPS = 512
    # The draft model's first step in a deployment (its acceptance never observed) is lent by the
    # budget, and so are the steps of that reply that follow it with the draft warm (no catch-up):
    # their net cost is charged, but for the first step's prompt prefill, so the budget may go below
    # zero and is paid back. A fresh Generator's budget could pay the draft's prompt prefill only
    # after ~4 replies, so the draft model never ran on the bench's chat turns, which it runs at
    # 1.19x alone. The steps still run only where the rest of the reply repays the catch-up
    # (``catchup_pays``) and the model's estimates choose k > 0; where the model loses, the loss is
    # one draft window's catch-up and the few steps its acceptance takes to fall, once per
    # deployment (docs/design/policy.md#the-first-model-step).
    LEND_FIRST_STEP = True
    # The model's realized rate: EMA weight per model step (one step's tokens are all-or-nothing, so
    # slower than the acceptance's EMA_WEIGHT: ~10 steps), and the drift back towards the predicted
    # rate per step it is passed over for its realized rate (~35 steps to forget half of the evidence).
    REALIZED_WEIGHT = 0.1
    REALIZED_FORGET = 0.02

    # The offer classes, weakest evidence first: a guess (``LookupOffer.guess``: a 1-token match),
    # then strong lookups by the tokens they had ready: 1-2 (a short match), 3 up to max_k - 1, and
    # a full offer of max_k (``None`` here). The suffix drafter offers a full max_k only after a
    # match at least that long, so long matches do not share an estimate with short copies
    # (docs/design/policy.md#lookup-classes).
    LOOKUP_CONFIDENCE = ("guess", 1, 3, None)
    # Where each class starts (per-position acceptance before it has seen an outcome): the pooled
    # first-position acceptance measured per class over the bench's workloads, a property of the
    # text and the match length rather than of the CPU (docs/design/policy.md#lookup-priors).
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
        self.lending = False  # the model step chosen last is the deployment's first, lent (LEND_FIRST_STEP)
        self.lent_reply = False  # this reply ran that step

    @classmethod
    def from_snapshot(cls, setup: PolicySetup, learned: DefaultSnapshot | None) -> "DefaultK":
        """The next reply's controller: the call's k bounds and costs, all the last reply carried."""
        learned = learned if learned is not None else DefaultSnapshot()
        return cls(setup.max_draft_tokens, costs=setup.costs, has_model=setup.has_model, start_k=setup.start_k,
                   model_acceptance=list(learned.acceptance) or None, model_observed=learned.observed,
                   lookup_acceptance=learned.lookup_acceptance, lookup_observed=learned.lookup_observed,
                   budget_s=learned.budget_s, model_realized=learned.model_realized,
                   lookup_share=learned.lookup_share)

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
        a shorter one, so what the short offers achieved is a floor for the long ones
        (docs/design/policy.md#lookup-classes).
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
        # The draft model's probes, priors and catch-ups run only when the budget covers their loss,
        # but for its first step in a deployment, which the budget lends, and the steps of that reply
        # that follow it while the draft stays warm (no catch-up): LEND_FIRST_STEP.
        lent = self.LEND_FIRST_STEP and (self.model.observed == 0 or
                                         (self.lent_reply and catchup_tokens <= self.costs.USUAL_FEED))
        while k > 0 and not lent and self.costs.loss_if_rejected(k, catchup_tokens) > self.budget_s:
            k -= 1  # what the budget cannot cover if every draft is rejected
        # ... and only while what it realized beats what it would replace (undiscounted rates); a probe
        # (its prediction chose plain steps) is what measures it again, so a probe is not held back.
        replaced = lookup[0] * AdaptiveK.SPECULATION_MARGIN if lookup is not None else self.model.rate(0)
        if k > 0 and self.realized_rate() <= replaced and self.model.best_k(limit) > 0:
            self._forget_realized(k)
            k = 0
        if k > 0:
            self.lending = lent and self.model.observed == 0
            self.lent_reply = self.lent_reply or self.lending
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
        lent_s = 0.0  # seconds of this step the budget is not charged (a lent step's catch-up)
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
            if not lookup and self.lending:
                # The lent step's catch-up (the draft's prompt prefill) is the deployment's one-off
                # investment, not a loss the budget repays: its drafts and rows are charged.
                lent_s = step.catchup_s
                self.lending = False
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
        self.budget_s = min(self.budget_s + self.EXPLORE_SHARE * plain - (spent - lent_s - plain), self.budget_cap())
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

    def snapshot(self) -> DefaultSnapshot:
        model = self.model.snapshot() if self.model is not None else AdaptiveSnapshot()
        lookups = [side.snapshot() for side in self.lookups]
        return DefaultSnapshot(
            catchup_deferred=model.catchup_deferred + sum(s.catchup_deferred for s in lookups),
            mode_s=tuple(self.mode_s.items()), acceptance=model.acceptance, observed=model.observed,
            lookup_acceptance=tuple(s.acceptance for s in lookups), lookup_observed=tuple(s.observed for s in lookups),
            budget_s=self.budget_s, plain_s=self.plain_s, overhead_s=self.overhead_s,
            lookup_steps=self.steps["lookup"], model_steps=self.steps["model"], guess_steps=self.steps["guess"],
            model_realized=tuple(self.model_realized) if self.model_realized is not None else None,
            lookup_share=self.lookup_share() if self.committed["all"] or self.carried_lookup_share is not None
            else None)
