"""Invariant: speculative sampling commits tokens distributed exactly as the warped target.

Whatever the draft proposes (close to the target, far from it, with zeros where the
target has mass, or a deterministic point mass), the first committed token of a
step is distributed as p_target; given the first was an accepted draft token, the
next one is distributed as the target's next row; the bonus token after a fully
accepted block is distributed as the target's last row. Checked with chi-square
tests over 20k draws at significance 0.001, and a deliberately wrong rule is shown
to fail the same test (the test has power). Also: the all-zero-residual fallback,
the acceptance rate sum(min(p_target, p_draft)), the logit warps (temperature,
top-k, top-p), the greedy verifier's contract, and an end-to-end run of a tiny
model whose sampled (1st, 2nd) token pairs follow transformers' softmaxes.
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime.sampling import SamplingConfig, sample, warp
from specedge.runtime.verify import Proposal, Verdict, verify, verify_greedy, verify_sampling

N_DRAWS = 20_000
ALPHA = 1e-3  # a correct sampler fails one of these tests with probability ~1e-3 each; seeds are fixed anyway
T1 = SamplingConfig(temperature=1.0)

# Upper 0.001 quantiles of the chi-square distribution, chi2.ppf(0.999, dof) for dof = 1..40
# (from scipy.stats), used when scipy is not installed.
CHI2_CRITICAL_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264,
                     32.909, 34.528, 36.123, 37.697, 39.252, 40.790, 42.312, 43.820, 45.315, 46.797, 48.268,
                     49.728, 51.179, 52.620, 54.052, 55.476, 56.892, 58.301, 59.703, 61.098, 62.487, 63.870,
                     65.247, 66.619, 67.985, 69.346, 70.703, 72.055, 73.402]

P_TARGET = np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P_CLOSE = np.array([0.28, 0.27, 0.18, 0.16, 0.08, 0.03])
P_FAR = np.array([0.02, 0.03, 0.05, 0.10, 0.30, 0.50])
P_DRAFT_ZEROS = np.array([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])  # no mass on the target's two likeliest tokens
P_TARGET_ZEROS = np.array([0.0, 0.45, 0.0, 0.35, 0.2, 0.0])  # the target excludes tokens the draft likes


def chi_square(counts: np.ndarray, p_expected: np.ndarray, *, min_expected: float = 5.0) -> tuple[float, float]:
    """(statistic, critical value or p-value comparison) for observed ``counts`` against ``p_expected``.

    Cells the expected distribution excludes must be empty (asserted). Cells whose expected
    count is below ``min_expected`` are pooled into one, as the chi-square approximation needs.
    Returns (p_value, statistic); with scipy missing, p_value is 1.0 or 0.0 by comparison with
    the hard-coded 0.001 critical value.
    """
    counts = np.asarray(counts, np.float64)
    p_expected = np.asarray(p_expected, np.float64)
    assert counts[p_expected == 0].sum() == 0, "a token with zero target probability was committed"
    n = counts.sum()
    expected = p_expected * n
    keep = expected >= min_expected
    obs = list(counts[keep])
    exp = list(expected[keep])
    pooled = (~keep) & (p_expected > 0)
    if pooled.any():
        obs.append(counts[pooled].sum())
        exp.append(expected[pooled].sum())
    obs, exp = np.array(obs), np.array(exp)
    dof = len(obs) - 1
    assert dof >= 1
    stat = float(((obs - exp) ** 2 / exp).sum())
    try:
        from scipy.stats import chi2
    except ImportError:
        return (1.0 if stat < CHI2_CRITICAL_999[dof - 1] else 0.0), stat
    return float(chi2.sf(stat, dof)), stat


def assert_distributed_as(tokens, p_expected, what: str) -> None:
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=len(p_expected))
    assert len(counts) == len(p_expected), f"{what}: token ids outside the vocabulary"
    p_value, stat = chi_square(counts, p_expected)
    assert p_value > ALPHA, (f"{what}: chi-square {stat:.1f} (p = {p_value:.2g}); observed "
                             f"{np.round(counts / counts.sum(), 3)}, expected {np.round(p_expected, 3)}")


def _logits(*rows: np.ndarray) -> np.ndarray:
    """float64 logits whose softmax at temperature 1 is exactly each row (log 0 -> -inf)."""
    with np.errstate(divide="ignore"):
        return np.log(np.stack(rows))


def _run(p_target_rows: list[np.ndarray], p_draft_rows: list[np.ndarray] | None, *, point_tokens=None,
         n: int = N_DRAWS, seed: int = 0, rule=verify_sampling):
    """Draw ``n`` verdicts: draft tokens sampled from p_draft_rows (or fixed point_tokens)."""
    draft_rng = np.random.default_rng(seed)
    rng = np.random.default_rng(seed + 1)
    logits = _logits(*p_target_rows)
    k = len(p_target_rows) - 1
    verdicts = []
    for _ in range(n):
        if p_draft_rows is None:
            proposal = Proposal(np.array(point_tokens, np.int64), None)
        else:
            tokens = [int(draft_rng.choice(len(row), p=row)) for row in p_draft_rows]
            proposal = Proposal(np.array(tokens, np.int64), np.stack(p_draft_rows))
        verdict = rule(proposal, logits, T1, rng)
        assert 1 <= len(verdict.tokens) <= k + 1 and verdict.n_accepted == len(verdict.tokens) - 1
        assert list(verdict.tokens[:verdict.n_accepted]) == list(proposal.tokens[:verdict.n_accepted])
        verdicts.append(verdict)
    return verdicts


# --------------------------------------------------------------------------- first committed token


@pytest.mark.parametrize("p_target, p_draft", [
    (P_TARGET, P_CLOSE),
    (P_TARGET, P_FAR),
    (P_TARGET, P_DRAFT_ZEROS),
    (P_TARGET_ZEROS, P_FAR),
    (P_TARGET, P_TARGET),  # identical: everything is accepted
], ids=["close", "far", "draft-zeros", "target-zeros", "identical"])
def test_first_committed_token_is_distributed_as_p_target(p_target, p_draft):
    verdicts = _run([p_target, P_TARGET], [p_draft])
    assert_distributed_as([v.tokens[0] for v in verdicts], p_target, "first committed token")
    # Leviathan et al. Thm 3.5: P(accept) = sum_x min(p_target(x), p_draft(x)).
    alpha = np.minimum(p_target, p_draft).sum()
    rate = np.mean([v.n_accepted for v in verdicts])
    assert abs(rate - alpha) < 4.5 * np.sqrt(alpha * (1 - alpha) / N_DRAWS + 1e-12)


@pytest.mark.parametrize("token", [0, 4, 2])
def test_point_mass_proposals_keep_p_target(token):
    """A deterministic drafter (n-gram lookup, draft_probs None) counts as a point mass."""
    p_target = P_TARGET_ZEROS
    verdicts = _run([p_target, P_TARGET], None, point_tokens=[token])
    assert_distributed_as([v.tokens[0] for v in verdicts], p_target, f"first token after point mass on {token}")
    rate = np.mean([v.n_accepted for v in verdicts])
    assert abs(rate - p_target[token]) < 4.5 * np.sqrt(p_target[token] * (1 - p_target[token]) / N_DRAWS) + 1e-12


def test_later_positions_and_bonus_token_follow_their_target_rows():
    """k = 2. Given d1 accepted, token 2 ~ row 1; given both accepted, the bonus ~ row 2."""
    row0, row1, row2 = P_TARGET, P_TARGET_ZEROS, np.array([0.1, 0.1, 0.1, 0.1, 0.1, 0.5])
    verdicts = _run([row0, row1, row2], [P_CLOSE, np.array([0.05, 0.4, 0.05, 0.3, 0.15, 0.05])])
    assert_distributed_as([v.tokens[0] for v in verdicts], row0, "position 1")
    second = [v.tokens[1] for v in verdicts if v.n_accepted >= 1]
    assert len(second) > N_DRAWS // 2
    assert_distributed_as(second, row1, "position 2 given position 1 accepted")
    bonus = [v.tokens[2] for v in verdicts if v.n_accepted == 2]
    assert len(bonus) > 2000
    assert_distributed_as(bonus, row2, "bonus token after a fully accepted block")


def test_bonus_token_with_point_mass_drafts():
    row1 = np.array([0.05, 0.05, 0.6, 0.1, 0.1, 0.1])
    verdicts = _run([P_TARGET, row1], None, point_tokens=[1])
    bonus = [v.tokens[1] for v in verdicts if v.n_accepted == 1]
    assert abs(len(bonus) / N_DRAWS - P_TARGET[1]) < 0.02
    assert_distributed_as(bonus, row1, "bonus token")


def test_a_wrong_correction_rule_fails_the_same_test():
    """Power check: resampling from p_target (instead of the residual) after a rejection is biased."""
    def naive(proposal, logits, config, rng):
        p_target = warp(logits, config)
        token = int(proposal.tokens[0])
        ratio = p_target[0, token] / proposal.draft_probs[0, token]
        if rng.random() < min(1.0, ratio):
            return Verdict([token, sample(p_target[1], rng)], 1)
        return Verdict([sample(p_target[0], rng)], 0)

    verdicts = _run([P_TARGET, P_TARGET], [P_FAR], rule=naive, n=5000)
    counts = np.bincount([v.tokens[0] for v in verdicts], minlength=6)
    p_value, _ = chi_square(counts, P_TARGET)
    assert p_value < ALPHA


# --------------------------------------------------------------------------- residual fallback


class _ForcedRejection:
    """An rng whose acceptance draws are the largest double below 1, forcing rejections
    whenever the ratio is below 1; the sampling draws are real."""

    def __init__(self, seed: int) -> None:
        self.real = np.random.default_rng(seed)
        self.calls = 0

    def random(self):
        self.calls += 1
        return 1.0 - 2.0 ** -53 if self.calls % 2 == 1 else self.real.random()


def test_all_zero_residual_falls_back_to_p_target():
    """p_draft equals p_target up to rounding: a rejection leaves max(p_target - p_draft, 0) == 0
    everywhere, and the correction must then be drawn from p_target itself (no NaN, no crash)."""
    token = 2
    p_draft = P_TARGET.copy()
    p_draft[token] *= 1 + 1e-13  # ratio p_target/p_draft = 1 - 1e-13 < the forced draw
    assert np.maximum(P_TARGET - p_draft, 0).sum() == 0
    rng = _ForcedRejection(0)
    logits = _logits(P_TARGET, P_TARGET)
    proposal = Proposal(np.array([token]), p_draft[None])
    tokens = []
    for _ in range(N_DRAWS):
        verdict = verify_sampling(proposal, logits, T1, rng)
        assert verdict.n_accepted == 0 and len(verdict.tokens) == 1
        tokens.append(verdict.tokens[0])
    assert_distributed_as(tokens, P_TARGET, "fallback correction")


def test_identical_draft_is_always_accepted():
    verdicts = _run([P_TARGET, P_TARGET], [P_TARGET], n=2000)
    assert all(v.n_accepted == 1 for v in verdicts)


def test_verify_sampling_with_top_k_commits_from_the_warped_target():
    config = SamplingConfig(temperature=0.7, top_k=3)
    target_logits = np.array([[2.0, 1.5, 0.3, 1.0, -1.0, 0.0], [0.0] * 6])
    draft_logits = np.array([0.0, 0.2, 1.5, 1.4, 0.1, 2.0])
    p_target = warp(target_logits, config)[0]
    p_draft = warp(draft_logits, config)
    assert np.count_nonzero(p_target) == 3 and np.count_nonzero(p_draft) == 3
    draft_rng, rng = np.random.default_rng(3), np.random.default_rng(4)
    tokens = []
    for _ in range(N_DRAWS):
        d = sample(p_draft, draft_rng)
        tokens.append(verify(Proposal(np.array([d]), p_draft[None]), target_logits, config, rng).tokens[0])
    assert_distributed_as(tokens, p_target, "top-k warped target")


# --------------------------------------------------------------------------- warps


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_temperature_warp_is_softmax_of_scaled_logits():
    logits = np.array([[1.0, 2.0, -0.5, 0.0], [3.0, -1.0, 0.5, 0.5]], np.float32)
    for t in (0.25, 1.0, 2.0):
        probs = warp(logits, SamplingConfig(temperature=t))
        assert probs.dtype == np.float64
        np.testing.assert_allclose(probs, _softmax(logits.astype(np.float64) / t), rtol=1e-12)
        np.testing.assert_allclose(probs.sum(-1), 1.0)


def test_greedy_warp_is_a_point_mass_with_ties_to_the_lowest_id():
    probs = warp(np.array([[0.0, 3.0, 3.0, 1.0]]), SamplingConfig())
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_the_k_likeliest_tokens_in_proportion(k):
    logits = np.array([0.1, 2.0, -1.0, 1.5, 0.7, -3.0])
    probs = warp(logits, SamplingConfig(temperature=1.0, top_k=k))
    kept = np.argsort(-logits)[:k]
    assert set(np.nonzero(probs)[0]) == set(kept)
    np.testing.assert_allclose(probs.sum(), 1.0)
    np.testing.assert_allclose(probs[kept], _softmax(logits[kept]), rtol=1e-12)
    # top_k >= vocab and top_k = 0 are "no limit"
    for off in (0, 6, 100):
        np.testing.assert_allclose(warp(logits, SamplingConfig(temperature=1.0, top_k=off)), _softmax(logits))


@pytest.mark.parametrize("top_p, n_kept", [
    (0.05, 1),  # the top token alone already reaches top_p
    (0.5, 1),  # mass before the 2nd token is 0.5, not below 0.5: excluded
    (0.7, 2),  # 0.5 < 0.7, then 0.8 reaches it
    (0.9, 3),
    (0.97, 4),
    (1.0, 4),
])
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, n_kept):
    p = np.array([0.15, 0.5, 0.05, 0.3])  # ids not in probability order
    by_rank = [1, 3, 0, 2]
    probs = warp(np.log(p), SamplingConfig(temperature=1.0, top_p=top_p))
    kept = sorted(by_rank[:n_kept])
    assert np.nonzero(probs)[0].tolist() == kept
    np.testing.assert_allclose(probs.sum(), 1.0)
    np.testing.assert_allclose(probs[kept], p[kept] / p[kept].sum(), rtol=1e-9)


def test_top_k_then_top_p_and_minus_inf_logits():
    logits = np.array([np.log(0.4), np.log(0.3), np.log(0.2), np.log(0.1), -np.inf])
    probs = warp(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.75))
    # top-3 renormalises to 4/9, 3/9, 2/9; top-p 0.75 then keeps ids 0 and 1 (4/9 < 0.75 <= 7/9)
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7, 0, 0, 0], rtol=1e-9)
    assert warp(logits, T1)[4] == 0.0


def test_sample_draws_from_the_distribution():
    rng = np.random.default_rng(0)
    assert_distributed_as([sample(P_TARGET_ZEROS, rng) for _ in range(N_DRAWS)], P_TARGET_ZEROS, "sample()")


# --------------------------------------------------------------------------- greedy contract


def test_greedy_verifier_accepts_up_to_the_first_mismatch_then_the_target_token():
    target_ids = [3, 1, 4, 1, 5]
    logits = np.full((5, 8), -1.0)
    logits[np.arange(5), target_ids] = 2.0
    for draft, accepted in (([3, 1, 4, 1], 4), ([3, 1, 0, 1], 2), ([7, 1, 4, 1], 0), ([3, 1, 4], 3)):
        verdict = verify_greedy(np.array(draft), logits[:len(draft) + 1])
        assert verdict.n_accepted == accepted
        assert verdict.tokens == target_ids[:accepted + 1]
    empty = verify_greedy(np.zeros(0, np.int64), logits[:1])
    assert empty.tokens == [3] and empty.n_accepted == 0


# --------------------------------------------------------------------------- end to end


E2E_VOCAB = 24
E2E_SEEDS = 1500
E2E_PROMPT = [6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tiny_vocab_pair(tiny_model, export):
    """A 24-token llama target and a noisy copy as its draft (accepts often, not always)."""
    target = tiny_model("llama", seed=11, vocab_size=E2E_VOCAB)
    draft = tiny_model("llama", seed=12, vocab_size=E2E_VOCAB, perturb=(target, 0.5))
    return target, export(target, draft=draft)


def test_sampled_token_pairs_follow_the_target_softmax(tiny_vocab_pair, load_generator):
    """1500 seeds, temperature 1, k = 1: token 1 comes from the prefill, token 2 from the first
    speculative step (an accepted draft token or a correction). The joint frequencies of
    (token 1, token 2) must match softmax(target) at both contexts, computed by transformers."""
    import torch

    from tiny_models import load_hf

    folder, bundle = tiny_vocab_pair
    gen = load_generator(bundle)
    eos = set(gen.eos_token_ids)
    model = load_hf(folder)
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([E2E_PROMPT])).logits[0, -1].double(), -1).numpy()
        batch = torch.tensor([E2E_PROMPT + [t] for t in range(E2E_VOCAB)])
        p2 = torch.softmax(model(batch).logits[:, -1].double(), -1).numpy()  # [t1, t2]
    assert p1.max() < 0.6 and (p2.max(-1) < 0.9).all(), "softmaxes too peaked for a meaningful test"

    # Cells: (t1, t2) for t1 not EOS, and (EOS, end) since generation stops at EOS.
    expected = p1[:, None] * p2
    terminal = np.zeros(E2E_VOCAB)
    for t in eos:
        terminal[t] = p1[t]
        expected[t] = 0.0
    counts = np.zeros_like(expected)
    ends = np.zeros(E2E_VOCAB)
    accepted = rejected = 0
    for seed in range(E2E_SEEDS):
        result = gen.generate(input_ids=E2E_PROMPT, max_new_tokens=3, temperature=1.0, seed=seed,
                              draft_tokens=1)
        tokens = result.token_ids
        if tokens[0] in eos:
            ends[tokens[0]] += 1
            continue
        assert result.stats.drafted == 1  # the second token really came from a speculative step
        accepted += result.stats.accepted
        rejected += 1 - result.stats.accepted
        counts[tokens[0], tokens[1]] += 1
    assert accepted > 100 and rejected > 100, (accepted, rejected)  # both verifier branches ran
    p_value, stat = chi_square(np.concatenate([counts.ravel(), ends]),
                               np.concatenate([expected.ravel(), terminal]))
    assert p_value > ALPHA, f"joint (token 1, token 2) chi-square {stat:.1f}, p = {p_value:.2g}"


def test_sampling_is_reproducible_with_a_seed(tiny_vocab_pair, load_generator):
    gen = load_generator(tiny_vocab_pair[1])
    a = gen.generate(input_ids=E2E_PROMPT, max_new_tokens=12, temperature=0.9, seed=123, draft_tokens=3)
    b = gen.generate(input_ids=E2E_PROMPT, max_new_tokens=12, temperature=0.9, seed=123, draft_tokens=3,
                     reply_memory=False)  # the default drafts from earlier replies too: a seed holds for the same memory
    gen.forget_replies()
    a = gen.generate(input_ids=E2E_PROMPT, max_new_tokens=12, temperature=0.9, seed=123, draft_tokens=3,
                     reply_memory=False)
    assert a.token_ids == b.token_ids
