"""Adaptive draft length: the cost model picks k that maximises committed tokens per second.

Guards: with a synthetic acceptance and fake step timings (deterministic, no
models), k shrinks to 0 when acceptance collapses, grows back when it recovers
(through the periodic probe), tracks the verify cost curve, and k = 0 wins when
verifying costs more than speculation can return.
"""

from __future__ import annotations

import pytest

from specedge.errors import InvalidParameterError
from specedge.runtime.controller import AdaptiveK, CostProfile, FixedK


def fake_step(controller: AdaptiveK, acceptance: float, *, step_s: float = 0.010, verify_slope: float = 0.1,
              draft_token_s: float = 0.002, limit: int = 8) -> int:
    """One loop step with a drafter whose tokens are accepted while a deterministic
    counter says so: the first round(acceptance * k) tokens of each block are accepted."""
    k = controller.choose(limit)
    accepted = min(k, int(round(acceptance * k)))
    verify_s = step_s * (1 + verify_slope * k)
    controller.observe(k, k, accepted, draft_token_s * k, verify_s)
    return k


def run_steps(controller: AdaptiveK, acceptance: float, n: int, **kw) -> list[int]:
    return [fake_step(controller, acceptance, **kw) for _ in range(n)]


def test_first_step_is_plain_then_speculation_is_tried():
    c = AdaptiveK(8)
    assert c.choose(8) == 0  # nothing measured yet
    c.observe(0, 0, 0, 0.0, 0.010)
    assert c.choose(8) > 0  # optimistic prior: speculation gets tried


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
    profile = CostProfile({1: 0.010, 2: 0.011, 3: 0.012, 5: 0.020}, draft_token_s=0.001)
    c = AdaptiveK(4, profile=profile)
    c.alpha = [0.9, 0.9, 0.9, 0.9]
    rates = {k: c.rate(k) for k in range(5)}
    # E(k) / (k * t_draft + t_target(k+1)); t_target(4) interpolated between 3 and 5.
    assert rates[0] == pytest.approx(1 / 0.010)
    assert rates[2] == pytest.approx((1 + 0.9 + 0.81) / (0.002 + 0.012))
    assert c.target_cost(4) == pytest.approx(0.016)
    c.observe(0, 0, 0, 0.0, 0.010)
    assert c.choose(4) == max(rates, key=rates.get)


def test_limit_caps_k_and_fixed_k():
    c = AdaptiveK(8)
    c.observe(0, 0, 0, 0.0, 0.010)
    assert c.choose(2) <= 2
    assert FixedK(4).choose(8) == 4
    assert FixedK(4).choose(3) == 3


@pytest.mark.parametrize("kwargs, match", [({"max_k": -1}, "max_draft_tokens"), ({"max_k": 4, "beta": 0},
                                                                                  "beta")])
def test_invalid_controller_parameters(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        AdaptiveK(**kwargs)


def test_invalid_fixed_k():
    with pytest.raises(InvalidParameterError, match="draft_tokens must be >= 0"):
        FixedK(-1)
