"""Invariant: the sampling verifier commits tokens distributed exactly as the target's (Leviathan et
al. 2023, Thm 1), whatever the draft distribution; greedy verification accepts the argmax prefix.

The verifier is a pure function, so these run it directly on fixed logits, many thousand seeded
times, and test the committed token's histogram against p_target with a chi-square goodness-of-fit
test at p = 0.001 (fixed seeds: the outcome is the same on every run).
"""

from __future__ import annotations

import numpy as np
import pytest

from distribution import CHI2_CRITICAL_P001
from specedge.runtime.sampling import SamplingConfig, warp
from specedge.runtime.verify import Proposal, verify, verify_greedy

VOCAB = 8
DRAWS = 4000  # expected counts >= 100 in every bin of the distributions below; ~0.2 s per case
SAMPLING = SamplingConfig(temperature=1.0)


def _goodness_of_fit(tokens: list[int], p: np.ndarray) -> tuple[float, int]:
    observed = np.bincount(tokens, minlength=len(p)).astype(float)
    expected = p * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the target gives probability 0 was committed"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.7, 1.2], np.float32)
DRAFTS = {
    "close": np.array([1.8, 1.6, 0.9, 0.4, 0.1, -0.4, 0.6, 1.0]),
    "far": np.array([-1.0, 0.0, 2.5, 0.0, 1.5, 2.0, -2.0, 0.0]),
    "one-hot": None,  # a deterministic drafter (n-gram, suffix): point masses
    "equal": LOGITS.astype(float),  # p_draft == p_target: always accepted, the residual is never drawn
}


@pytest.mark.parametrize("draft", list(DRAFTS), ids=list(DRAFTS))
def test_the_first_committed_token_is_distributed_as_p_target(draft):
    p_target = warp(LOGITS[None, :], SAMPLING)[0]
    logits = np.stack([LOGITS, LOGITS])  # [k + 1, V] for k = 1
    rng = np.random.default_rng(1234)
    committed, rejected = [], 0
    if DRAFTS[draft] is None:
        p_draft = None
        proposal_of = lambda: Proposal(np.array([int(rng.integers(VOCAB))], np.int64))  # noqa: E731
    else:
        p_draft = warp(DRAFTS[draft][None, :], SAMPLING)[0]
        proposal_of = lambda: Proposal(np.array([int(rng.choice(VOCAB, p=p_draft))], np.int64),  # noqa: E731
                                       p_draft[None, :])
    for _ in range(DRAWS):
        verdict = verify(proposal_of(), logits, SAMPLING, rng)
        assert 1 <= len(verdict.tokens) <= 2 and verdict.n_accepted in (0, 1)
        rejected += verdict.n_accepted == 0
        committed.append(verdict.tokens[0])
    stat, dof = _goodness_of_fit(committed, p_target)
    assert stat < CHI2_CRITICAL_P001[dof - 1], (stat, dof)
    if draft == "equal":
        assert rejected == 0
    else:
        assert rejected > 100  # the residual distribution was really exercised (~5% of draws for "close")


def test_a_bonus_token_after_a_fully_accepted_block_is_distributed_as_p_target():
    """k = 2 with the draft proposing the target's own distribution: every block is accepted and
    the third token comes from the target's last row."""
    last = np.array([0.0, 3.0, 1.0, 1.0, -1.0, 0.0, 2.0, 0.5], np.float32)
    logits = np.stack([LOGITS, LOGITS, last])
    p_rows = warp(logits[:2], SAMPLING)
    rng = np.random.default_rng(99)
    bonus = []
    for _ in range(DRAWS):
        tokens = np.array([rng.choice(VOCAB, p=p_rows[0]), rng.choice(VOCAB, p=p_rows[1])], np.int64)
        verdict = verify(Proposal(tokens, p_rows), logits, SAMPLING, rng)
        assert verdict.n_accepted == 2
        bonus.append(verdict.tokens[2])
    stat, dof = _goodness_of_fit(bonus, warp(last[None, :], SAMPLING)[0])
    assert stat < CHI2_CRITICAL_P001[dof - 1], (stat, dof)


@pytest.mark.parametrize("draft, accepted", [([3, 1, 4], 3), ([3, 1, 0], 2), ([0, 1, 4], 0), ([], 0)])
def test_greedy_accepts_the_argmax_prefix_then_the_targets_token(draft, accepted):
    argmax = [3, 1, 4, 6]
    logits = np.full((len(draft) + 1, VOCAB), -1.0, np.float32)
    for row in range(len(draft) + 1):
        logits[row, argmax[row]] = 1.0
    verdict = verify_greedy(np.array(draft, np.int64), logits)
    assert verdict.n_accepted == accepted
    assert verdict.tokens == draft[:accepted] + [argmax[accepted]]
