"""Invariant: speculative greedy output is token-identical to plain decoding, for every drafter in
the registry, every draft length and every loop mode; sampled output keeps the target's distribution.

On the numpy reference engines (tests/reference_engine.py), so it runs in the edge install:
- every DRAFTERS entry x k in {1, 2, 4, 8} x sequential / pipelined, plus adaptive k (sequential
  and auto), p_min, a draft window and the bare (exact=False) target, equals the reference's own greedy decoding and ``speculation=False``;
- self-speculation (draft == target) accepts every draft token, for k in {2, 4, 8, 16};
- a draft that differs from the target is corrected and still equals plain decoding;
- accepted <= drafted, and the per-position counts add up;
- a vocabulary-truncated draft head proposes only head tokens and changes nothing;
- sampled tokens (model drafter, n-gram and suffix point masses) pass a chi-square homogeneity
  test against plain sampling.
"""

from __future__ import annotations

import numpy as np
import pytest

from distribution import assert_same_distribution, token_counts
from reference_engine import (PROMPT_IDS, ReferenceConfig, ReferenceEngine, reference_bundle, draft_weights,
                              plain_greedy, target_weights)
from specedge.runtime.drafters import DRAFTERS
from specedge.runtime.generator import Generator

NEW_TOKENS = 64
# Target seed 0 continues PROMPT_IDS with 38 distinct tokens (prompt lookup rarely fires);
# seed 2 falls into loops after a few tokens (prompt lookup and the suffix trie draft long copies).
TARGET_SEEDS = (0, 2)


@pytest.fixture(scope="module")
def oracle() -> dict[int, list[int]]:
    """target seed -> the reference engine's own greedy continuation of PROMPT_IDS (no runtime code)."""
    return {seed: plain_greedy(ReferenceEngine(target_weights(seed=seed)), PROMPT_IDS, NEW_TOKENS)
            for seed in TARGET_SEEDS}


@pytest.fixture(scope="module")
def generators(tmp_path_factory) -> dict[int, Generator]:
    """target seed -> a Generator with the perturbed draft (shared: greedy runs leave no state that
    changes tokens; the tests below check output, never timing)."""
    from reference_engine import reference_generator

    root = tmp_path_factory.mktemp("reference")
    return {seed: reference_generator(root / str(seed), target_seed=seed) for seed in TARGET_SEEDS}


def _check_stats(stats) -> None:
    assert 0 <= stats.accepted <= stats.drafted
    assert sum(stats.accepted_per_position) == stats.accepted
    assert sum(stats.drafted_per_position) == stats.drafted
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))


@pytest.mark.parametrize("seed", TARGET_SEEDS)
def test_plain_decoding_equals_the_reference_oracle(generators, oracle, seed):
    gen = generators[seed]
    for exact in (True, False):
        out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=NEW_TOKENS, speculation=False, exact=exact)
        assert out.token_ids == oracle[seed] and out.finish_reason == "length"
        assert out.stats.drafted == 0


# Each drafter on the target where it drafts most: the draft model on the varied one, prompt lookup
# and the suffix trie on the looping one, the composite (lookup, else the model) on the looping one.
# A drafter added to the registry is tested on seed 0 without an entry here (its oracle then checks
# equality only; an entry also checks that it drafted).
DRAFTER_SEEDS = {"model": 0, "composite": 2, "ngram": 2, "suffix": 2}


def _drafter_seeds():
    return [(name, DRAFTER_SEEDS.get(name, 0)) for name in sorted(DRAFTERS)]


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("drafter, seed", _drafter_seeds())
def test_greedy_speculation_equals_plain_for_every_drafter(generators, oracle, drafter, seed, k, mode):
    out = generators[seed].generate(input_ids=PROMPT_IDS, max_new_tokens=NEW_TOKENS, drafter=drafter,
                                    draft_tokens=k, adaptive=False, mode=mode)
    assert out.token_ids == oracle[seed]
    assert out.stats.drafter == drafter
    _check_stats(out.stats)
    assert out.stats.drafted > 0 or drafter not in DRAFTER_SEEDS


@pytest.mark.parametrize("drafter, seed", _drafter_seeds())
@pytest.mark.parametrize("options", [{}, {"exact": False}, {"mode": "auto"}, {"p_min": 0.2}, {"draft_window": 8}],
                         ids=["adaptive", "bare-target", "adaptive-auto", "p-min", "window"])
def test_adaptive_and_other_options_equal_plain(generators, oracle, drafter, seed, options):
    """Adaptive k (which may run plain steps), the sequential/pipelined choice per step, the bare
    target's 1-row plain steps, p_min's early stop and a draft window that bridges history."""
    out = generators[seed].generate(input_ids=PROMPT_IDS, max_new_tokens=NEW_TOKENS, drafter=drafter,
                                    adaptive=True, **options)
    assert out.token_ids == oracle[seed]
    _check_stats(out.stats)


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_self_speculation_accepts_every_draft_token(reference, oracle, k):
    gen = reference(draft="self")
    for mode in ("sequential", "pipelined"):
        out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=NEW_TOKENS, drafter="model", draft_tokens=k,
                           adaptive=False, mode=mode)
        assert out.token_ids == oracle[0]
        assert out.stats.drafted > 0 and out.stats.accepted == out.stats.drafted
        # Every step commits k + 1 tokens but the last (cut by max_new_tokens): ceil(63 / (k + 1)) steps.
        assert out.stats.steps == -(-(NEW_TOKENS - 1) // (k + 1))


def test_a_differing_draft_is_corrected_and_still_equals_plain(generators, oracle):
    out = generators[0].generate(input_ids=PROMPT_IDS, max_new_tokens=NEW_TOKENS, drafter="model", draft_tokens=4,
                                 adaptive=False)
    assert out.token_ids == oracle[0]
    assert 0 < out.stats.accepted < out.stats.drafted  # some blocks accepted, some corrected
    assert out.stats.steps < NEW_TOKENS - 1  # and speculation still saved target steps


def test_a_draft_from_another_seed_is_mostly_rejected_and_changes_nothing(reference, oracle):
    gen = reference(draft=target_weights(seed=7))
    out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=NEW_TOKENS, drafter="model", draft_tokens=4,
                       adaptive=False)
    assert out.token_ids == oracle[0]
    assert out.stats.accepted < out.stats.drafted / 2


def test_a_truncated_draft_head_proposes_inside_it_and_changes_nothing(tmp_path, oracle):
    weights = target_weights()
    head = np.array(sorted(set(range(0, 96, 2)) | set(oracle[0][:32])), np.int64)  # half the vocabulary
    gen = Generator(reference_bundle(tmp_path, ReferenceEngine(weights),
                                     ReferenceEngine(draft_weights(weights), head_ids=head)))
    out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=NEW_TOKENS, drafter="model", draft_tokens=4,
                       adaptive=False)
    assert out.token_ids == oracle[0] and out.stats.accepted > 0
    sampled = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=16, drafter="model", draft_tokens=4, adaptive=False,
                           temperature=1.0, seed=3)
    assert len(sampled.token_ids) == 16 and sampled.stats.drafted > 0


# ----------------------------------------------------------------------------- sampling
SMALL = ReferenceConfig(vocab_size=16, max_context=64)  # 16 bins: the chi-square tests see every token
SAMPLING_RUNS = 300  # 3 positions x 300 samples over 16 tokens: most bins hold >= 10 counts; ~1.5 s each


@pytest.fixture(scope="module")
def sampling_gen(tmp_path_factory) -> Generator:
    from reference_engine import reference_generator

    # Noise 0.5: the draft disagrees often, so rejections and residual draws are exercised.
    return reference_generator(tmp_path_factory.mktemp("sampling"), config=SMALL, target_seed=3,
                               draft=draft_weights(target_weights(SMALL, 3), noise=0.5))


@pytest.fixture(scope="module")
def plain_counts(sampling_gen) -> np.ndarray:
    return token_counts(sampling_gen, [6, 7, 8, 9], SAMPLING_RUNS, SMALL.vocab_size, speculation=False)


@pytest.mark.parametrize("options", [{"drafter": "model", "draft_tokens": 2},
                                     {"drafter": "ngram", "draft_tokens": 2, "min_ngram": 1},
                                     {"drafter": "suffix", "draft_tokens": 2, "reply_memory": False}],
                         ids=["model", "ngram", "suffix"])
def test_sampled_tokens_keep_the_plain_distribution(sampling_gen, plain_counts, options):
    counts = token_counts(sampling_gen, [6, 7, 8, 9], SAMPLING_RUNS, SMALL.vocab_size, adaptive=False, **options)
    drafted = sampling_gen.generate(input_ids=[6, 7, 8, 9], max_new_tokens=8, temperature=1.0, seed=0,
                                    adaptive=False, **options)
    assert drafted.stats.drafted > 0 or options["drafter"] != "model"
    assert_same_distribution(plain_counts, counts)
