"""The default policy's controller (``DefaultK``): never slower where speculation never pays.

Guards (torch-free; the equality oracles on exported bundles are tests/integration/test_default_policy.py):
- the exploration budget: with fake step timings (an injected clock: no sleeps, no real
  timing) and a draft model that is never accepted, the real loop's probes, priors and
  catch-ups cost at most ``DefaultK.EXPLORE_SHARE`` (2%) of plain decoding's time, in one
  long reply and over many short ones (the budget carried between them), and probes do
  happen; where the draft model pays (every draft accepted) it carries most of the reply;
- lookups are drafted whenever they exist, at no draft cost, and the model is not run then;
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from specedge.runtime import loop
from specedge.runtime.policies import PLAIN, DefaultK, DraftPlan, PolicySetup
from specedge.runtime.costs import CostModel
from specedge.runtime.drafting import ANY_SOURCE, LOOKUP_SOURCE, MODEL_SOURCE, NO_LOOKUP, LookupOffer
from specedge.runtime.sampling import SamplingConfig
from specedge.runtime.verify import Proposal

VOCAB = 50
STEP_S = 0.010  # a 1-token (2-row, exact) target step
VERIFY_SLOPE = 0.1  # each verified row past the second adds 10% of a step
DRAFT_S = 0.003  # one draft token: c = 0.3
CATCHUP_TOKEN_S = 0.001  # one token of a draft's catch-up feed
WINDOW = 64  # the draft reads at most this many unseen tokens at once (ModelDrafter's window)


class Clock:
    """The injected clock: time advances only when a fake forward or draft says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def verify_s(n: int) -> float:
    """A target forward on n tokens: 2 rows cost one step (exact steps pad to 2), then +10% a row."""
    return STEP_S * (1 + VERIFY_SLOPE * max(n - 2, 0))


class FakeCache:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.length = capacity, 0

    def rewind(self, n: int) -> None:
        self.length -= n


class FakeTarget:
    """The target's greedy next token after t is (t + 1) % VOCAB; a forward costs verify_s(n)."""

    vocab_size = VOCAB

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def forward(self, ids: np.ndarray, kv: FakeCache, num_logits: int) -> np.ndarray:
        self.clock.now += verify_s(len(ids)) if len(ids) <= 9 else STEP_S * len(ids) / 8  # prefill: batched
        kv.length += len(ids)
        logits = np.zeros((num_logits, VOCAB), np.float32)
        logits[np.arange(num_logits), (ids[-num_logits:] + 1) % VOCAB] = 1.0
        return logits


class FakeModelDrafter:
    """A draft model on the injected clock: it catches up on the history it has not read (at most
    WINDOW tokens), then drafts k tokens at DRAFT_S each; ``right`` drafts the target's tokens
    (all accepted), else a token the target never picks (none accepted). Never a lookup."""

    name = "auto"

    def __init__(self, clock: Clock, right: bool) -> None:
        self.clock, self.right = clock, right
        self.read = 0  # history tokens the draft's cache holds
        self.catchup_s, self.catchup_tokens = 0.0, 0

    def begin(self, prompt) -> None:
        self.read = 0

    def pending_tokens(self, history) -> int:
        return min(max(len(history) - self.read, 1), WINDOW)

    def lookup_offer(self, history, limit: int) -> LookupOffer:
        return NO_LOOKUP

    def propose(self, history, k: int, source: str = ANY_SOURCE) -> Proposal:
        feed = self.pending_tokens(history)
        self.catchup_tokens = feed if feed > 2 else 0
        self.catchup_s = feed * CATCHUP_TOKEN_S if feed > 2 else 0.0
        self.clock.now += feed * CATCHUP_TOKEN_S + k * DRAFT_S
        self.read = len(history) + k
        last = int(history[-1])
        step = 1 if self.right else 2
        return Proposal(np.array([(last + step * (i + 1)) % VOCAB for i in range(k)], np.int64), from_model=True)

    def accept(self, history, n_accepted: int) -> None:
        self.read = min(self.read, len(history) - 1)  # the rejected tail and the target's token: unread


def measured_costs() -> CostModel:
    """What Generator.warmup's tune measures on this fake machine (the loop then refines it)."""
    return CostModel({n: verify_s(n) for n in range(1, 10)}, DRAFT_S, CATCHUP_TOKEN_S)


def decode(monkeypatch, tokens: int, drafter=None, controller=None, costs=None,
           result: loop.LoopResult | None = None) -> float:
    """Decode ``tokens`` through the real loop on the injected clock; returns the decode seconds
    (after the first token) and checks the output is plain decoding's. ``result``: filled in."""
    clock = Clock()
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    if drafter is not None:
        drafter.clock = clock
    prompt = np.arange(40, dtype=np.int64) % VOCAB
    result = result if result is not None else loop.LoopResult()
    blocks = loop.run(FakeTarget(clock), FakeCache(4096), prompt, max_new_tokens=tokens, eos_token_ids=(),
                      sampling=SamplingConfig(), rng=np.random.default_rng(0), drafter=drafter,
                      controller=controller, result=result, costs=costs)
    first = next(blocks)
    start = clock.now
    for _ in blocks:
        pass
    assert first == result.tokens[:1] and result.tokens == [(40 + i) % VOCAB for i in range(tokens)]  # the target's
    return clock.now - start


def test_probes_and_catchups_cost_at_most_two_percent_where_the_draft_never_pays(monkeypatch):
    tokens = 3000
    plain = decode(monkeypatch, tokens)
    assert plain == pytest.approx((tokens - 1) * STEP_S)
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=True)
    spent = decode(monkeypatch, tokens, FakeModelDrafter(Clock(), right=False), controller, costs)
    assert controller.steps["model"] >= 5  # it did explore (the bound is not met by never trying)
    assert spent - plain <= DefaultK.EXPLORE_SHARE * plain
    # The controller's own account is the real one (the fake costs are what the model predicts).
    assert controller.overhead_s == pytest.approx(spent - plain, rel=1e-6, abs=1e-9)


def test_the_budget_holds_over_many_short_replies_with_what_each_reply_carries(monkeypatch):
    """Voice-like traffic: 60 replies of 24 tokens, each controller started from the last one's
    snapshot (as Generator does through SpeculationMemory); the bound holds over the whole run."""
    costs = measured_costs()
    plain_total = spent_total = 0.0
    learned = None
    model_steps = 0
    for _ in range(60):
        plain_total += decode(monkeypatch, 24)
        controller = DefaultK(8, costs=costs, has_model=True, budget_s=learned.budget_s if learned else 0.0,
                              model_acceptance=list(learned.acceptance) if learned else None,
                              model_observed=learned.observed if learned else 0)
        spent_total += decode(monkeypatch, 24, FakeModelDrafter(Clock(), right=False), controller, costs)
        learned = controller.snapshot()
        model_steps += learned.model_steps
    assert model_steps >= 2  # 2% of 1440 plain steps buys a couple of probes with a 40-token catch-up
    assert spent_total - plain_total <= DefaultK.EXPLORE_SHARE * plain_total


def test_a_draft_model_that_pays_carries_the_reply(monkeypatch):
    tokens = 1500
    plain = decode(monkeypatch, tokens)
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=True)
    spent = decode(monkeypatch, tokens, FakeModelDrafter(Clock(), right=True), controller, costs)
    snap = controller.snapshot()
    assert snap.model_steps > 0 and snap.lookup_steps == 0
    assert snap.acceptance[0] > 0.95
    # Once found to pay, the model serves nearly every step: plain steps are the cold start only.
    assert controller.steps["plain"] < 0.25 * tokens
    assert spent < 0.6 * plain


def test_each_step_sources_seconds_and_tokens_add_up_to_the_decode(monkeypatch):
    """GenerationStats.source_*: a never-accepted draft model's steps (probes, catch-ups included)
    and the plain steps between them, each with its time and the tokens it committed."""
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=True, budget_s=0.5)
    result = loop.LoopResult()
    spent = decode(monkeypatch, 300, FakeModelDrafter(Clock(), right=False), controller, costs, result=result)
    stats = result.stats
    assert set(stats.source_tokens) == {"model", "plain"}
    assert sum(stats.source_tokens.values()) == 299  # every token after the prefill's
    assert sum(stats.source_s.values()) == pytest.approx(spent)
    assert stats.source_tokens["model"] == controller.steps["model"]  # nothing accepted: one token a step
    assert stats.source_s["plain"] / stats.source_tokens["plain"] == pytest.approx(STEP_S)
    assert stats.source_s["model"] / stats.source_tokens["model"] > STEP_S + DRAFT_S  # it lost time


def test_lookup_steps_are_recorded_as_lookups(monkeypatch):
    """Past token 49 the fake target's text repeats the prompt (0, 1, 2, ...): the suffix drafter's
    copies are lookup steps, each committing several tokens for about one step's time."""
    from specedge.runtime.suffix_drafter import SuffixDrafter

    costs = measured_costs().lookup_view()
    result = loop.LoopResult()
    decode(monkeypatch, 120, SuffixDrafter(), DefaultK(8, costs=costs, has_model=False), costs, result=result)
    stats = result.stats
    assert set(stats.source_tokens) <= {"lookup", "plain"} and stats.source_tokens["lookup"] > 60
    assert stats.source_s["lookup"] / stats.source_tokens["lookup"] < STEP_S / 2


def test_rejected_model_drafts_do_not_switch_off_the_composites_lookups(monkeypatch):
    """The composite (n-gram lookup + draft model) learns each source's acceptance apart. Traced on
    `specedge demo` under a single shared estimate: three rejected model drafts at the start of the
    reply, then plain steps through a reply the lookup copies from the prompt (0.79x plain). Here
    the model is never right and, past token 49, the n-gram lookup always is: under one shared
    estimate (AdaptiveK) this 60-token reply ran 54 plain steps after 5 model steps, and no lookup."""
    from specedge.runtime.composite_drafter import CompositeDrafter
    from specedge.runtime.ngram_drafter import NGramDrafter

    tokens = 60
    plain = decode(monkeypatch, tokens)
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=True, budget_s=0.5)  # enough to try the model early
    result = loop.LoopResult()
    drafter = CompositeDrafter(NGramDrafter(3, 2), FakeModelDrafter(Clock(), right=False))
    spent = decode(monkeypatch, tokens, drafter, controller, costs, result=result)
    stats = result.stats
    assert stats.source_tokens["model"] >= 1  # the model was tried, and every draft of it rejected
    assert stats.source_tokens["lookup"] > 0.6 * tokens  # the lookup still carried the repeats
    assert spent < 0.5 * plain


def test_the_adaptive_composite_runs_under_the_per_source_controller(reference):
    """Every drafter with a lookup and a model (``DrafterSpec.per_source``) gets DefaultK when adaptive."""
    from specedge.runtime.drafters import DRAFTERS
    from specedge.runtime.options import GenerationConfig

    gen = reference()
    assert {name for name, spec in DRAFTERS.items() if spec.per_source} == {"auto", "composite"}
    for name in ("auto", "composite"):
        assert isinstance(gen._drafter_and_controller(GenerationConfig(drafter=name, adaptive=True))[1], DefaultK)
    assert not isinstance(gen._drafter_and_controller(GenerationConfig(drafter="ngram", adaptive=True))[1], DefaultK)


def test_a_step_counts_as_the_source_that_drafted_it_not_the_one_offered(monkeypatch):
    """Under a controller that does not choose sources (fixed k), the auto drafter drafts a guess
    with its model (runtime/auto_drafter.py): such a step is a model step, in the stats and in what the
    cost model learns (its draft time is the model's), though a lookup had been offered."""
    from specedge.runtime.auto_drafter import AutoDrafter
    from specedge.runtime.policies import FixedK
    from specedge.runtime.suffix_drafter import SuffixDrafter

    class Recording(FixedK):
        def __init__(self, k: int) -> None:
            super().__init__(k)
            self.outcomes: list[loop.StepOutcome] = []

        def observe(self, step: loop.StepOutcome) -> None:
            self.outcomes.append(step)

    model = FakeModelDrafter(Clock(), right=False)
    controller = Recording(2)
    result = loop.LoopResult()
    # Prompt 0..39 then the target's 40..49 and 0, 1, 2...: after "49 0" only "0" matches (a guess).
    decode(monkeypatch, 30, AutoDrafter(SuffixDrafter(min_match=1), model), controller, measured_costs(),
           result=result)
    guessed = [s for s in controller.outcomes if s.drafted and 0 < s.match < 2]
    assert not guessed  # a guess the model drafted instead is not a lookup step
    model_steps = [s for s in controller.outcomes if s.drafted and not s.lookup]
    lookup_steps = [s for s in controller.outcomes if s.drafted and s.lookup]
    assert model_steps and lookup_steps
    assert all(s.accepted == 0 for s in model_steps) and all(s.accepted == s.drafted for s in lookup_steps)
    assert result.stats.source_tokens["model"] == len(model_steps)  # wrong drafts: one token a step
    assert result.stats.source_tokens["lookup"] == sum(s.accepted + 1 for s in lookup_steps)


def test_a_lookup_is_drafted_whenever_it_exists_and_the_model_is_not_run():
    costs = measured_costs()
    # A model already tried in this deployment (its first step is lent: see the test below).
    controller = DefaultK(8, costs=costs, has_model=True, model_acceptance=[0.6] * 8, model_observed=1)
    # A 1-token lookup costs nothing on an exact 2-row step: no budget is needed to try it.
    assert controller.choose(8, catchup_tokens=64, lookup_tokens=1).k == 1
    assert controller.choose(8, catchup_tokens=64, lookup_tokens=0).k == 0  # the model: budget 0, no probe
    rich = DefaultK(8, costs=costs, has_model=True, budget_s=1.0, lookup_acceptance=[[0.95] * 8] * 4,
                    lookup_observed=[8] * 4)
    assert rich.choose(8, lookup_tokens=5).k == 5  # never past what the lookup has
    assert rich.choose(3, lookup_tokens=5).k == 3  # nor past the limit


def test_a_lookup_that_is_never_accepted_is_cut_to_what_costs_nothing():
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=False, lookup_acceptance=[[0.0] * 8] * 4,
                          lookup_observed=[8] * 4)
    assert controller.choose(8, lookup_tokens=6).k <= 1  # longer verifies cost rows it never repays


def test_lookup_acceptance_is_learned_per_offer_length():
    """Long offers (deep matches) that are always right and short ones that never are: each class
    learns its own acceptance, so a long offer is drafted whole while a short one is cut."""
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=False)
    for _ in range(30):
        for offered, accepted in ((8, 8), (2, 0)):
            k = controller.choose(8, lookup_tokens=offered).k
            controller.observe(loop.StepOutcome(k, k, min(k, accepted), 0.0, verify_s(k + 1), lookup=True,
                                                offered=offered))
    assert controller.choose(8, lookup_tokens=8).k == 8
    assert controller.choose(8, lookup_tokens=2).k <= 1
    snap = controller.snapshot()
    assert len(snap.lookup_acceptance) == len(DefaultK.LOOKUP_CONFIDENCE)
    # Carried into the next reply's controller, the classes keep what they learned.
    carried = DefaultK(8, costs=costs, has_model=False, lookup_acceptance=snap.lookup_acceptance,
                       lookup_observed=snap.lookup_observed)
    assert carried.choose(8, lookup_tokens=8).k == 8 and carried.choose(8, lookup_tokens=2).k <= 1


def test_loss_if_rejected_is_the_cost_models():
    costs = measured_costs()
    assert costs.loss_if_rejected(0) == 0.0
    assert costs.loss_if_rejected(3, lookup=True) == pytest.approx(verify_s(4) - verify_s(1))
    assert costs.loss_if_rejected(3, 40) == pytest.approx(40 * CATCHUP_TOKEN_S + 3 * DRAFT_S + verify_s(4) - STEP_S)
    assert costs.loss_if_rejected(3, 2) == pytest.approx(3 * DRAFT_S + verify_s(4) - STEP_S)  # the usual feed
    assert CostModel().loss_if_rejected(1) is None  # nothing measured: nothing to judge
    view = costs.lookup_view()
    costs.observe(loop.StepOutcome(1, 1, 1, 0.0, 0.5, lookup=True))
    assert view.target_s[2] == costs.target_s[2] and view.step_cost(4) == costs.target_cost(5)
    assert costs.draft_token_s == DRAFT_S  # a lookup step says nothing about the draft model's c


def test_an_unobserved_offer_class_starts_from_a_shorter_class_that_was_accepted():
    """Short offers that were all accepted lift a longer class's first offers above its prior; a
    longer class's estimates never flow down to shorter offers, nor replace one it has learned."""
    assert len(DefaultK.LOOKUP_PRIORS) == len(DefaultK.LOOKUP_CONFIDENCE)
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=False)
    prior = controller.lookup_side(8).expected_tokens(8)
    for _ in range(12):
        k = controller.choose(8, lookup_tokens=2).k
        controller.observe(loop.StepOutcome(k, k, k, 0.0, verify_s(k + 1), lookup=True, offered=2))
    assert controller.lookup_side(8).expected_tokens(8) > prior
    assert controller.lookup_side(8).observed == controller.lookup_side(2).observed
    # A class that learned its own estimate keeps it.
    learned = DefaultK(8, costs=costs, has_model=False, lookup_acceptance=[[1.0] * 8, [1.0] * 8, [0.0] * 8, [0.0] * 8],
                       lookup_observed=[8, 8, 8, 8])
    assert learned.choose(8, lookup_tokens=8).k <= 1
    # A shorter class that did worse than the longer class's prior leaves it at its prior.
    worse = DefaultK(8, costs=costs, has_model=False, lookup_acceptance=[[], [0.3] * 8], lookup_observed=[0, 8])
    assert worse.lookup_side(8).observed == 0 and worse.lookup_side(8).alpha[0] == DefaultK.LOOKUP_PRIORS[-1]
    # Nothing flows down: a long class that is always right leaves the short class at its prior.
    down = DefaultK(8, costs=costs, has_model=False, lookup_acceptance=[[], [], [], [1.0] * 8],
                    lookup_observed=[0, 0, 0, 8])
    assert down.lookup_side(2).observed == 0 and down.lookup_side(2).alpha[0] == DefaultK.LOOKUP_PRIORS[1]


def test_longer_offers_start_from_higher_priors():
    """Before any outcome, a full offer is trusted more than a 1-2 token one (LOOKUP_PRIORS)."""
    controller = DefaultK(8, costs=measured_costs(), has_model=False)
    assert controller.choose(8, lookup_tokens=8).k > controller.choose(8, lookup_tokens=2).k


def test_a_guess_is_learned_apart_from_strong_lookups():
    """Guesses (1-token matches) that are never right are cut to plain steps, while 2-token offers
    after strong matches, always right, keep being drafted: the classes do not share an estimate."""
    costs = measured_costs()
    controller = DefaultK(8, costs=costs, has_model=False)
    assert controller.choose(8, lookup_tokens=1, lookup_match=1) == DraftPlan(1, LOOKUP_SOURCE)  # its prior pays
    for _ in range(30):
        for offered, match, accepted in ((1, 1, 0), (2, 2, 2)):
            plan = controller.choose(8, lookup_tokens=offered, lookup_match=match)
            controller.observe(loop.StepOutcome(plan.k, plan.k, min(plan.k, accepted), 0.0, verify_s(plan.k + 1),
                                                lookup=plan.k > 0, offered=offered if plan.k else 0, match=match))
    assert controller.choose(8, lookup_tokens=1, lookup_match=1) == PLAIN
    assert controller.choose(8, lookup_tokens=2, lookup_match=2) == DraftPlan(2, LOOKUP_SOURCE)
    assert controller.lookup_side(1, 1) is not controller.lookup_side(1, 2)
    assert controller.lookup_side(1, 0) is controller.lookup_side(1, 2)  # match not known: a strong lookup


def test_the_model_is_chosen_over_a_lookup_only_when_it_promises_more():
    """A draft model right 19 times in 20 beats a guess that is right 1 time in 10, but not a full
    lookup that is always right (its draft is free); a catch-up it would pay first counts against it."""
    costs = measured_costs()
    learned = dict(model_acceptance=[0.95] * 8, model_observed=8, budget_s=1.0,
                   lookup_acceptance=[[0.1] * 8, [0.6] * 8, [0.8] * 8, [1.0] * 8], lookup_observed=[8] * 4)
    controller = DefaultK(8, costs=costs, has_model=True, **learned)
    plan = controller.choose(8, catchup_tokens=2, lookup_tokens=1, lookup_match=1)
    assert plan.source == MODEL_SOURCE and plan.k > 1
    assert controller.choose(8, catchup_tokens=2, lookup_tokens=8, lookup_match=12) == DraftPlan(8, LOOKUP_SOURCE)
    # The same model behind a 64-token catch-up: this step's catch-up is charged to it.
    assert not controller.model_beats(controller.lookup_side(2, 2).effective_rate(1), 8, 64)
    assert controller.model_beats(controller.lookup_side(2, 2).effective_rate(1), 8, 2)
    # Without a draft model, a guess runs where it beats a plain step by the speculation margin: on
    # this fake machine's free second row, right 1 time in 10 it does not (1.1 < 1.1), 1 in 2 it does.
    for right, plan in ((0.1, PLAIN), (0.5, DraftPlan(1, LOOKUP_SOURCE))):
        alone = DefaultK(8, costs=costs, has_model=False, lookup_acceptance=[[right] * 8], lookup_observed=[8])
        assert alone.choose(8, lookup_tokens=1, lookup_match=1) == plan


def test_the_model_runs_only_while_its_realized_rate_beats_what_it_replaces():
    """A model predicted right 19 times in 20 whose steps really committed 1 token in 3 steps' time
    (catch-ups after lookup streaks) is passed over for a plain step and for a guess; while passed
    over, its estimate drifts back to the prediction, so it runs again; a probe is never held back;
    what it realized is carried to the next reply."""
    costs = measured_costs()
    learned = dict(model_acceptance=[0.95] * 8, model_observed=8, budget_s=1.0)
    assert DefaultK(8, costs=costs, has_model=True, **learned).choose(8).source == MODEL_SOURCE
    slow = DefaultK(8, costs=costs, has_model=True, model_realized=(1.0, 3 * STEP_S), **learned)
    assert slow.realized_rate() == pytest.approx(1 / (3 * STEP_S))
    assert slow.choose(8) == PLAIN
    guess = dict(lookup_tokens=1, lookup_match=1)
    assert slow.choose(8, **guess) == DraftPlan(1, LOOKUP_SOURCE)
    passes = 0
    while slow.choose(8) == PLAIN:
        passes += 1
        assert passes < 200
    assert slow.realized_rate() > 1 / STEP_S and passes > 10  # forgotten slowly, not at once
    # A probe (the prediction itself chose plain steps) runs whatever was realized.
    probe = DefaultK(8, costs=costs, has_model=True, model_acceptance=[0.0] * 8, model_observed=8, budget_s=1.0,
                     model_realized=(1.0, 3 * STEP_S))
    plans = [probe.choose(8) for _ in range(probe.model.probe_every)]
    assert plans[-1].source == MODEL_SOURCE and all(p == PLAIN for p in plans[:-1])
    # Model steps are folded in (from the prediction, EMA): fast steps lift a slow estimate; carried on.
    fast = DefaultK(8, costs=costs, has_model=True, model_realized=(1.0, 3 * STEP_S), **learned)
    before = fast.realized_rate()
    fast.steps["model"] = 1  # not the reply's first model step: its catch-up counts
    fast.observe(loop.StepOutcome(4, 4, 4, 4 * DRAFT_S, verify_s(5)))
    assert fast.realized_rate() > before
    assert DefaultK(8, costs=costs, has_model=True, model_realized=fast.snapshot().model_realized,
                    **learned).realized_rate() == pytest.approx(fast.realized_rate())
    with pytest.raises(InvalidParameterError, match="model_realized"):
        DefaultK(8, costs=costs, has_model=True, model_realized=(1.0, 0.0))


def test_a_replys_first_model_step_does_not_count_its_prompt_catchup():
    """The deferred prompt prefill of a reply's first model step was weighed against the whole reply:
    it is left out of the realized rate; a later step's catch-up (after a lookup streak) is not."""
    costs = measured_costs()
    outcome = loop.StepOutcome(4, 4, 4, 4 * DRAFT_S, verify_s(5), catchup_s=0.04, catchup_tokens=40)
    first = DefaultK(8, costs=costs, has_model=True)
    first.observe(outcome)
    later = DefaultK(8, costs=costs, has_model=True)
    later.steps["model"] = 3
    later.observe(outcome)
    assert first.model_realized[1] == pytest.approx(later.model_realized[1] - DefaultK.REALIZED_WEIGHT * 0.04)


def test_a_draft_plan_is_checked():
    with pytest.raises(ValueError, match="source"):
        DraftPlan(1, "elsewhere")
    with pytest.raises(ValueError, match="k >= 0"):
        DraftPlan(-1)


def test_a_catchup_is_weighed_against_the_tokens_the_model_would_serve_not_the_whole_reply():
    """Where lookups commit most of a reply (tool-call JSON), the draft model's one-off catch-up is
    repaid only by the rest: a catch-up that 40 model tokens would repay is not paid for 10."""
    def controller(**carried):
        return DefaultK(8, costs=measured_costs(), has_model=True, budget_s=0.5,
                        model_acceptance=[0.9] * 8, model_observed=8, **carried)

    alone = controller()
    assert alone.choose(8, catchup_tokens=64, expected_remaining=40).source == MODEL_SOURCE
    shared = controller(lookup_share=0.75)
    assert shared.choose(8, catchup_tokens=64, expected_remaining=40) == PLAIN
    assert shared.snapshot().catchup_deferred == 1
    assert shared.choose(8, catchup_tokens=2, expected_remaining=40).source == MODEL_SOURCE  # no catch-up due


def test_the_lookup_share_is_learned_per_token_and_carried_as_a_prior():
    from specedge.runtime.costs import StepOutcome

    fresh = DefaultK(8, costs=measured_costs(), has_model=True)
    assert fresh.lookup_share() == 0.0 and fresh.snapshot().lookup_share is None  # no evidence yet
    for _ in range(3):
        fresh.observe(StepOutcome(4, 4, 3, 0.0, verify_s(5), lookup=True, offered=4, match=4))  # 4 tokens each
    fresh.observe(StepOutcome(0, 0, 0, 0.0, STEP_S))  # plain: 1 token
    fresh.observe(StepOutcome(2, 2, 2, 2 * DRAFT_S, verify_s(3)))  # the model: 3 tokens
    fresh.observe(StepOutcome(1, 1, 1, 0.0, verify_s(2), lookup=True, offered=1, match=1))  # a guess: 2 tokens
    assert fresh.lookup_share() == pytest.approx(12 / 18)  # a guess's position is the model's once it runs
    carried = fresh.snapshot().lookup_share
    nxt = DefaultK(8, costs=measured_costs(), has_model=True, lookup_share=carried)
    assert nxt.lookup_share() == pytest.approx(carried)  # before this reply's first step: the carried share
    for _ in range(DefaultK.SHARE_PRIOR_TOKENS):
        nxt.observe(StepOutcome(0, 0, 0, 0.0, STEP_S))  # a reply without lookups outweighs it in time
    assert nxt.lookup_share() == pytest.approx(carried / 2)
    with pytest.raises(InvalidParameterError, match="lookup_share"):
        DefaultK(8, costs=measured_costs(), has_model=True, lookup_share=1.5)


def test_the_first_model_step_of_a_deployment_is_lent_and_its_prompt_prefill_not_charged():
    """A fresh deployment (the model never observed, budget 0) runs the model's first step where the
    rest of the reply repays its catch-up, instead of waiting ~4 replies for the budget to cover the
    draft's prompt prefill; the budget is charged that step's drafts and rows but not the prefill,
    and the lend happens once: after it the budget gates every model step as before."""
    costs = measured_costs()
    fresh = DefaultK(8, costs=costs, has_model=True)
    plan = fresh.choose(8, catchup_tokens=64, expected_remaining=500)
    assert plan.source == MODEL_SOURCE and plan.k > 0
    assert fresh.choose(8, catchup_tokens=64, expected_remaining=5) == PLAIN  # the rest cannot repay it
    plan = fresh.choose(8, catchup_tokens=64, expected_remaining=500)
    catchup_s = costs.catchup_cost(64)
    rejected = loop.StepOutcome(plan.k, plan.k, 0, plan.k * DRAFT_S, verify_s(plan.k + 1),
                                catchup_s=catchup_s, catchup_tokens=64)
    fresh.observe(rejected)
    loss = plan.k * DRAFT_S + verify_s(plan.k + 1) - STEP_S  # what the step lost beside its prefill
    assert fresh.budget_s == pytest.approx(DefaultK.EXPLORE_SHARE * STEP_S - loss)
    assert fresh.overhead_s == pytest.approx(loss + catchup_s)  # the real account keeps the prefill
    # The reply's next steps with the draft warm (no catch-up) are lent too, though the budget is spent ...
    warm = fresh.choose(8, catchup_tokens=1, expected_remaining=500)
    assert fresh.budget_s < 0 and warm.source == MODEL_SOURCE and warm.k > 0
    # ... but not a new prefill after plain steps, nor a warm step in the next reply: the budget gates them.
    assert fresh.choose(8, catchup_tokens=64, expected_remaining=500) == PLAIN
    nxt = DefaultK.from_snapshot(PolicySetup(8, 8, 8, costs, True), fresh.snapshot())
    assert nxt.choose(8, catchup_tokens=1, expected_remaining=500) == PLAIN
    # Switched off, the first step is gated like every other (the rule before the lend).
    class Unlent(DefaultK):
        LEND_FIRST_STEP = False
    assert Unlent(8, costs=costs, has_model=True).choose(8, catchup_tokens=64, expected_remaining=500) == PLAIN

