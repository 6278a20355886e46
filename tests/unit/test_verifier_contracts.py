"""Hardening: the verifier and the logit warp keep their contracts on any input.

What this module tries, with hypothesis (no model, numpy only):

- ``verify_greedy`` on random proposals (k = 0..8 random token ids) and random target
  logits ``[k+1, V]`` (V = 2..50; float32 values of any magnitude, exact ties drawn from
  a small value set): it returns 1..k+1 tokens and, with ``n`` accepted,
  ``tokens[:n] == draft[:n]``, ``draft[i] == argmax(logits[i])`` for i < n,
  ``tokens[n] == argmax(logits[n])`` (ties to the lowest id, as np.argmax), and
  ``draft[n] != argmax(logits[n])`` when n < k;
- ``verify_sampling`` with random draft distributions (random Dirichlet-like rows with
  zeros, or None for a deterministic drafter) under random temperature / top-k / top-p:
  it never raises, returns 1..k+1 tokens, accepts a prefix of the draft, and every
  committed token has p_target > 0 under the warped target distribution;
- ``warp`` on random logits with -inf entries (at least one finite) and random
  temperature (1e-300 .. 1e6), top_k and top_p: every row is a distribution
  (finite, non-negative, sums to 1 within 1e-9), -inf logits get probability 0, a most
  likely token is always kept, and ``sample`` never draws a zero-probability id.
"""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specedge.runtime.sampling import SamplingConfig, sample, warp
from specedge.runtime.verify import Proposal, verify, verify_greedy, verify_sampling

SETTINGS = settings(max_examples=300, deadline=None, database=None)

# A handful of repeated values makes exact ties common; the wide range covers float32's magnitudes.
TIE_VALUES = [-1.0, 0.0, 0.5, 1.0, 3.0]
F32_MAX = float(np.finfo(np.float32).max)
float32s = st.floats(-F32_MAX, F32_MAX, width=32, allow_nan=False, allow_infinity=False)
logit_values = st.one_of(st.sampled_from(TIE_VALUES), float32s, st.floats(-30, 30, width=32))


@st.composite
def greedy_case(draw):
    k = draw(st.integers(0, 8))
    vocab = draw(st.integers(2, 50))
    logits = draw(hnp.arrays(np.float32, (k + 1, vocab), elements=logit_values))
    # Draft tokens: random, or the target's own argmax for a random prefix (so long accepts happen).
    argmax = np.argmax(logits, axis=-1)
    agree = draw(st.integers(0, k))
    draft = [int(argmax[i]) if i < agree else draw(st.integers(0, vocab - 1)) for i in range(k)]
    return np.array(draft, np.int64), logits


@SETTINGS
@given(greedy_case())
def test_verify_greedy_accepts_exactly_the_argmax_prefix(case):
    draft, logits = case
    k = len(draft)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the near-tie gap of +-3e38 logits overflows to inf
        verdict = verify_greedy(draft, logits)
    tokens, n = verdict.tokens, verdict.n_accepted
    argmax = np.argmax(logits, axis=-1)
    assert 1 <= len(tokens) <= k + 1
    assert len(tokens) == n + 1 and 0 <= n <= k
    assert tokens[:n] == [int(t) for t in draft[:n]]
    assert all(int(draft[i]) == int(argmax[i]) for i in range(n))
    assert tokens[n] == int(argmax[n])
    if n < k:
        assert int(draft[n]) != int(argmax[n])
    assert 0 <= verdict.near_ties <= n + 1
    # verify() dispatches greedy configs to the same rule.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert verify(Proposal(draft), logits, SamplingConfig(), None).tokens == tokens


temperatures = st.one_of(st.floats(1e-3, 10.0), st.floats(1e-300, 1e-3), st.floats(10.0, 1e6),
                         st.sampled_from([1e-300, 1e-12, 1.0]))


@st.composite
def sampling_config(draw, vocab: int):
    return SamplingConfig(temperature=draw(temperatures),
                          top_k=draw(st.integers(0, vocab + 2)),
                          top_p=draw(st.one_of(st.just(1.0), st.floats(1e-6, 1.0))),
                          seed=draw(st.integers(0, 2 ** 32)))


@st.composite
def draft_row(draw, vocab: int):
    """A random distribution over the vocab with some exact zeros (at least one entry positive)."""
    weights = np.array(draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-12, 1.0)), min_size=vocab,
                                     max_size=vocab)), np.float64)
    if weights.sum() == 0:
        weights[draw(st.integers(0, vocab - 1))] = 1.0
    return weights / weights.sum()


@st.composite
def sampling_case(draw):
    k = draw(st.integers(0, 8))
    vocab = draw(st.integers(2, 50))
    logits = draw(hnp.arrays(np.float32, (k + 1, vocab), elements=st.one_of(st.sampled_from(TIE_VALUES),
                                                                               st.floats(-50, 50, width=32))))
    config = draw(sampling_config(vocab))
    deterministic = draw(st.booleans())
    rows = None if deterministic else np.stack([draw(draft_row(vocab)) for _ in range(k)]) if k else \
        np.zeros((0, vocab))
    # Draft tokens: drawn from the draft row when there is one (what a model drafter does), else random.
    tokens = []
    for i in range(k):
        if rows is not None and draw(st.booleans()):
            tokens.append(int(np.random.default_rng(draw(st.integers(0, 1000))).choice(vocab, p=rows[i])))
        else:
            tokens.append(draw(st.integers(0, vocab - 1)))
    return Proposal(np.array(tokens, np.int64), rows), logits, config


@SETTINGS
@given(sampling_case())
def test_verify_sampling_commits_only_tokens_the_target_can_produce(case):
    proposal, logits, config = case
    k = len(proposal.tokens)
    rng = np.random.default_rng(config.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no NaN / overflow inside the rule
        p_target = warp(logits, config)
        verdict = verify_sampling(proposal, logits, config, rng)
    tokens, n = verdict.tokens, verdict.n_accepted
    assert 1 <= len(tokens) <= k + 1 and len(tokens) == n + 1
    assert tokens[:n] == [int(t) for t in proposal.tokens[:n]]
    for i, token in enumerate(tokens):
        assert 0 <= token < logits.shape[1]
        assert p_target[i, token] > 0, (i, token, p_target[i])


@st.composite
def warp_case(draw):
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 50))
    logits = draw(hnp.arrays(np.float64, (rows, vocab), elements=st.one_of(
        st.sampled_from(TIE_VALUES + [-np.inf]), st.floats(-3e38, 3e38), st.floats(-1e6, 1e6))))
    for r in range(rows):  # at least one finite logit per row
        if not np.isfinite(logits[r]).any():
            logits[r, draw(st.integers(0, vocab - 1))] = draw(st.floats(-1e6, 1e6))
    greedy = draw(st.integers(0, 9)) == 0
    config = SamplingConfig(temperature=0.0) if greedy else draw(sampling_config(vocab))
    return logits, config


@SETTINGS
@given(warp_case())
def test_warp_returns_distributions(case):
    logits, config = case
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        probs = warp(logits, config)
    assert probs.shape == logits.shape and probs.dtype == np.float64
    assert np.isfinite(probs).all()
    assert (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=1e-9)
    assert (probs[np.isneginf(logits)] == 0).all()
    # top-p may drop the argmax when its probability ties with a kept token (logits 0 and 7e-30 give
    # exactly equal softmax values): the kept set is then still a highest-probability set.
    plain = warp(logits, SamplingConfig(temperature=config.temperature)) if not config.greedy else probs
    for row, full in zip(probs, plain):
        assert full[row > 0].max() == full.max()
    rng = np.random.default_rng(0)
    for row in probs:  # sample() never returns a zero-probability id
        assert row[sample(row, rng)] > 0
