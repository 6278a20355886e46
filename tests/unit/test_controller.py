"""Adaptive draft length: the cost model picks k that maximises committed tokens per second.

Guards: with a synthetic acceptance and fake step timings (deterministic, no
models), k shrinks to 0 when acceptance collapses, grows back when it recovers
(through the periodic probe), tracks the verify cost curve, and k = 0 wins when
verifying costs more than speculation can return. A draft's one-off catch-up is paid
only when the expected rest of the reply repays it, probes that need one are spaced
so it stays a small share of the time, and the reply-length estimate follows the
replies on record.
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from specedge.runtime.policies import AdaptiveK, FixedK
from specedge.runtime.costs import CostModel, StepOutcome
from specedge.runtime.horizon import ReplyLengths


def fake_step(controller: AdaptiveK, acceptance: float, *, step_s: float = 0.010, verify_slope: float = 0.1,
              draft_token_s: float = 0.002, limit: int = 8) -> int:
    """One loop step with a drafter whose tokens are accepted while a deterministic
    counter says so: the first round(acceptance * k) tokens of each block are accepted."""
    k = controller.choose(limit).k
    accepted = min(k, int(round(acceptance * k)))
    verify_s = step_s * (1 + verify_slope * k)
    observe(controller, k, k, accepted, draft_token_s * k, verify_s)
    return k


def observe(controller: AdaptiveK, *step) -> None:
    """What the loop does after each step: feed the cost model, then the controller."""
    outcome = StepOutcome(*step)
    controller.costs.observe(outcome)
    controller.observe(outcome)


def run_steps(controller: AdaptiveK, acceptance: float, n: int, **kw) -> list[int]:
    return [fake_step(controller, acceptance, **kw) for _ in range(n)]


def test_first_step_is_plain_then_speculation_is_tried():
    c = AdaptiveK(8)
    assert c.choose(8).k == 0  # nothing measured yet
    observe(c, 0, 0, 0, 0.0, 0.010)
    assert c.choose(8).k > 0  # optimistic prior: speculation gets tried


def test_k_grows_when_everything_is_accepted():
    c = AdaptiveK(8)
    ks = run_steps(c, 1.0, 40)
    assert ks[-1] >= 6
    assert c.alpha[0] > 0.95


def test_k_collapses_to_zero_when_acceptance_collapses_and_recovers_with_probes():
    c = AdaptiveK(8, probe_every=8)
    good = run_steps(c, 1.0, 30)
    assert good[-1] >= 6
    bad = run_steps(c, 0.0, 40)
    assert bad[-10:].count(0) >= 8, bad  # speculation switched off
    assert any(k > 0 for k in bad[-10:]), "the controller must keep probing while off"
    recovered = run_steps(c, 1.0, 40)
    assert recovered[-1] >= 4, recovered  # back on once the probes see acceptance again


def test_expensive_verify_turns_speculation_off():
    # A verify costing 3x a step per extra token can never pay, even at 100% acceptance.
    c = AdaptiveK(8)
    ks = run_steps(c, 1.0, 40, verify_slope=3.0)
    assert ks[-10:].count(0) >= 8


def test_choice_matches_the_expected_rate_formula():
    profile = CostModel({1: 0.010, 2: 0.011, 3: 0.012, 5: 0.020}, draft_token_s=0.001)
    c = AdaptiveK(4, costs=profile)
    c.alpha = [0.9, 0.9, 0.9, 0.9]
    rates = {k: c.rate(k) for k in range(5)}
    # E(k) / (k * t_draft + t_target(k+1)); t_target(4) interpolated between 3 and 5.
    assert rates[0] == pytest.approx(1 / 0.010)
    assert rates[2] == pytest.approx((1 + 0.9 + 0.81) / (0.002 + 0.012))
    assert c.costs.target_cost(4) == pytest.approx(0.016)
    observe(c, 0, 0, 0, 0.0, 0.010)
    assert c.choose(4).k == max(rates, key=rates.get)


def test_limit_caps_k_and_fixed_k():
    c = AdaptiveK(8)
    observe(c, 0, 0, 0, 0.0, 0.010)
    assert c.choose(2).k <= 2
    assert FixedK(4).choose(8).k == 4
    assert FixedK(4).choose(3).k == 3


@pytest.mark.parametrize("kwargs, match", [({"max_k": -1}, "max_draft_tokens"), ({"max_k": 4, "beta": 0},
                                                                                  "beta")])
def test_invalid_controller_parameters(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        AdaptiveK(**kwargs)


def test_invalid_fixed_k():
    with pytest.raises(InvalidParameterError, match="draft_tokens must be >= 0"):
        FixedK(-1)


# --- the draft's one-off catch-up, weighed against the expected rest of the reply ----------------

def informed(alpha: float = 0.9) -> AdaptiveK:
    """A controller that knows its costs: 10 ms step, v(k+1) = 1 + 0.1k, 2 ms draft step,
    1 ms per catch-up token, and per-position acceptance ``alpha``."""
    profile = CostModel({n: 0.010 * (1 + 0.1 * (n - 1)) for n in range(1, 10)}, draft_token_s=0.002,
                          draft_catchup_token_s=0.001)
    c = AdaptiveK(8, costs=profile)
    c.alpha = [alpha] * 8
    c.observed = 8
    return c


def test_a_catchup_that_the_rest_of_the_reply_cannot_repay_keeps_steps_plain():
    c = informed()
    best = max(range(9), key=c.effective_rate)
    saving = 1 / c.rate(0) - 1 / c.effective_rate(best)  # seconds saved per token (after the margin)
    one_off = 100 * 0.001
    short, long = 0.5 * one_off / saving, 2 * one_off / saving
    assert c.choose(8, catchup_tokens=100, expected_remaining=short).k == 0
    assert c.catchup_deferred == 1
    assert c.choose(8, catchup_tokens=100, expected_remaining=long).k == best
    # The usual feed (the target's token + the last draft token) is no catch-up at all.
    assert c.choose(8, catchup_tokens=2, expected_remaining=0.1).k == best
    # Unknown horizon: the catch-up is not weighed (the old behaviour).
    assert c.choose(8, catchup_tokens=100, expected_remaining=None).k == best


def test_catchup_cost_is_learned_from_observed_catchups():
    c = CostModel()
    assert c.catchup_cost(50) == 0.0  # nothing known: no draft cost either
    c.observe(StepOutcome(2, 2, 1, 0.004, 0.012, catchup_s=0.030, catchup_tokens=60))
    assert c.draft_catchup_token_s == pytest.approx(0.0005)
    assert c.catchup_cost(50) == pytest.approx(0.025)
    assert c.catchup_cost(2) == 0.0
    c.observe(StepOutcome(2, 2, 1, 0.004, 0.012, catchup_s=0.060, catchup_tokens=60))  # EMA, beta 0.2
    assert c.draft_catchup_token_s == pytest.approx(0.8 * 0.0005 + 0.2 * 0.001)


def test_unmeasured_catchup_falls_back_to_a_share_of_the_draft_step():
    c = CostModel({1: 0.01}, draft_token_s=0.004)
    assert c.catchup_cost(10) == pytest.approx(10 * 0.004 * CostModel.PRIOR_CATCHUP_SHARE)


def test_probes_that_need_a_catchup_wait_until_it_is_a_small_share_of_plain_time():
    c = informed(alpha=0.0)  # speculation never pays: only probes draft
    c.probe_every = 4
    one_off = c.costs.catchup_cost(40)  # 40 ms
    ks = []
    for _ in range(200):
        k = c.choose(8, catchup_tokens=40, expected_remaining=1000).k
        ks.append(k)
        observe(c, k, k, 0, 0.002 * k, 0.010 * (1 + 0.1 * k))
    probes = [i for i, k in enumerate(ks) if k > 0]
    assert probes, "the controller must still probe"
    # Each probe follows at least one_off / PROBE_CATCHUP_SHARE seconds of plain steps (10 ms each).
    min_gap = one_off / AdaptiveK.PROBE_CATCHUP_SHARE / 0.010
    gaps = np.diff([-1] + probes)
    assert all(g - 1 >= min_gap for g in gaps), (gaps, min_gap)
    # Without a catch-up the probes come every probe_every plain steps.
    c2 = informed(alpha=0.0)
    c2.probe_every = 4
    ks2 = []
    for _ in range(40):
        k = c2.choose(8, catchup_tokens=1, expected_remaining=1000).k
        ks2.append(k)
        observe(c2, k, k, 0, 0.002 * k, 0.010 * (1 + 0.1 * k))
    assert sum(k > 0 for k in ks2) >= 7


def test_reply_lengths_estimate_the_rest_of_a_reply():
    r = ReplyLengths()
    assert r.expected_remaining(0, 100) == 1.0  # nothing known: what has run is expected again
    assert r.expected_remaining(12, 100) == 12.0
    assert r.expected_remaining(12, 5) == 5.0  # never past the budget
    for n in (10, 12, 50):
        r.record(n, finished=True)
    assert r.expected_remaining(0, 100) == pytest.approx((10 + 12 + 50) / 3)
    assert r.expected_remaining(11, 100) == pytest.approx(((12 - 11) + (50 - 11)) / 2)
    assert r.expected_remaining(60, 100) == 60.0  # outran every reply on record
    r.record(16, finished=False)  # cut at max_new_tokens: at least 16, counted as 32
    assert r.expected_remaining(20, 100) == pytest.approx(((32 - 20) + (50 - 20)) / 2)
    r.record(0, finished=True)  # an empty reply carries no information
    assert len(r) == 4
    for _ in range(ReplyLengths.KEEP):
        r.record(5, finished=True)
    assert len(r) == ReplyLengths.KEEP and r.expected_remaining(0, 100) == 5.0


def test_acceptance_carried_from_the_previous_reply_decides_the_first_catchup():
    """The first catch-up is judged on what drafting achieved last time, not on the prior."""
    profile = CostModel({n: 0.010 * (1 + 0.1 * (n - 1)) for n in range(1, 10)}, draft_token_s=0.002,
                          draft_catchup_token_s=0.001)
    fresh = AdaptiveK(8, costs=profile)
    assert fresh.choose(8, catchup_tokens=64, expected_remaining=200).k > 0  # the 0.6 prior pays for it
    poor = AdaptiveK(8, costs=profile, acceptance=[0.15] * 8, observed=8)
    assert poor.choose(8, catchup_tokens=64, expected_remaining=200).k == 0
    odd = AdaptiveK(4, acceptance=[1.5, -0.2, 0.5, 0.5, 0.5, 0.5], observed=9)
    assert odd.alpha == [1.0, 0.0, 0.5, 0.5] and odd.observed == 4  # clamped, cut to max_k


def test_forget_replies_clears_what_replies_taught_but_keeps_step_costs(reference):
    gen = reference(draft="self")  # the numpy reference engines (tests/reference_engine.py)
    gen.generate(input_ids=list(range(6, 26)), max_new_tokens=12, drafter="model")  # adaptive model drafting
    gen.generate(input_ids=list(range(6, 26)), max_new_tokens=12)  # the default policy (its budget, lookups)
    memory = gen.memory
    assert len(memory.reply_lengths) >= 1 and memory.learned_for("model", "adaptive").observed and memory.costs
    assert memory.learned_for("auto", "default") is not None and memory.replies.tokens > 0
    gen.forget_replies()
    assert len(memory.reply_lengths) == 0 and not memory.learned and memory.costs
    assert memory.learned_for("auto", "default") is None and memory.replies.tokens == 0


def test_a_marginal_predicted_gain_stays_plain():
    """Speculation predicted to win less than SPECULATION_MARGIN runs plain: the cost model's
    realised/predicted ratio was 0.88-0.96, so a predicted 1.05x is a loss in practice."""
    profile = CostModel({1: 0.010, 2: 0.0105}, draft_token_s=0.0)
    c = AdaptiveK(1, costs=profile)
    c.observed = 1
    c.alpha = [0.1]  # E(1) = 1.1 tokens for 1.05 steps: rate(1) = 1.048 x rate(0)
    assert 1.0 < c.rate(1) / c.rate(0) < AdaptiveK.SPECULATION_MARGIN
    assert c.choose(1).k == 0
    c.alpha = [0.3]  # 1.3 / 1.05 = 1.24 x: clear of the margin
    assert c.choose(1).k == 1


def test_the_latency_cap_reads_the_one_cost_model():
    """The loop's latency cap and the controller read the same learned costs: k drafts fit
    when k * draft + verify(k + 1) stays under the bound; nothing measured, no cap."""
    assert CostModel().latency_limit(1e-6, 8) == 8
    costs = CostModel({n: 0.010 * (1 + 0.1 * (n - 1)) for n in range(1, 10)}, draft_token_s=0.002)
    assert costs.latency_limit(None, 8) == 8
    # k=2: 2 * 2 ms + 12 ms = 16 ms fits a 17 ms bound; k=3: 6 ms + 13 ms = 19 ms does not.
    assert costs.latency_limit(0.017, 8) == 2
    assert costs.latency_limit(1.0, 5) == 5
    controller = AdaptiveK(8, costs=costs)
    observe(controller, 2, 2, 2, 0.040, 0.050)  # the loop feeds one model; the cap sees it at once
    assert costs.draft_token_s == pytest.approx(0.8 * 0.002 + 0.2 * 0.020)
    assert costs.latency_limit(0.017, 8) < 2


def test_a_position_rejected_once_is_tried_again_after_shorter_drafts_keep_being_accepted():
    """One early rejection at position 2 must not pin k at 1 while every 1-token draft is accepted:
    the next position's estimate drifts back towards the last one's, k grows, and a new rejection
    there brings it down again."""
    costs = CostModel({1: 1.0, 2: 1.04, 3: 1.24, 4: 1.47, 5: 1.76}, 0.0, 0.0)  # a free draft (a lookup)
    c = AdaptiveK(4, costs=costs, acceptance=[1.0, 0.0, 0.0, 0.0], observed=4)
    assert c.choose(4).k == 1
    ks = []
    for _ in range(30):
        k = c.choose(4).k
        ks.append(k)
        c.observe(StepOutcome(k, k, k, 0.0, costs.target_cost(k + 1), lookup=True))  # all accepted
    assert ks[:3] == [1, 1, 1] and ks[-1] == 4 and ks == sorted(ks), ks
    for _ in range(3):
        c.observe(StepOutcome(4, 4, 1, 0.0, costs.target_cost(5), lookup=True))  # rejected at position 2
    assert c.choose(4).k < 4
    assert 0.0 < c.alpha[1] < 1.0
