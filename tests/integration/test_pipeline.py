"""Verify-while-draft (pipelined) speculation keeps output identical.

Guards: greedy output in "pipelined" and "auto" modes equals plain greedy (exact mode) for every
k, with a draft that disagrees often; self-speculation accepts everything; a drafter
whose every block is rejected still yields the baseline; the discarded early drafts
never leak into the target's cache (its committed K/V equal a plain run's) or the
draft's (its cached tokens are a prefix of the history); and sampling in pipelined
mode has the same token distribution as plain sampling (chi-square homogeneity).
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.export.bundle import ExportConfig, export_bundle
from specedge.runtime import loop
from specedge.runtime.policies import FixedK
from specedge.runtime.drafters import ModelDrafter
from specedge.runtime.drafting import ANY_SOURCE, NO_LOOKUP
from specedge.runtime.generator import Generator
from specedge.runtime.sampling import SamplingConfig
from specedge.runtime.verify import Proposal

from distribution import assert_same_distribution, token_counts
from tiny_models import build_model

PROMPT = [7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    target = build_model(root / "target", "llama", seed=11)
    draft = build_model(root / "draft", "llama", seed=12, perturb=(target, 0.6))
    return target, draft, root


@pytest.fixture(scope="module")
def gen(folders):
    target, draft, root = folders
    out = root / "bundle"
    export_bundle(ExportConfig(target=str(target), draft=str(draft), out=out, max_context=256, quiet=True))
    return Generator.from_bundle(out)


@pytest.fixture(scope="module")
def self_gen(folders):
    target, _, root = folders
    out = root / "self"
    export_bundle(ExportConfig(target=str(target), draft=str(target), out=out, max_context=256, quiet=True))
    return Generator.from_bundle(out)


@pytest.fixture(scope="module")
def baseline(gen):
    return gen.generate(input_ids=PROMPT, max_new_tokens=60, speculation=False, exact=True).token_ids


@pytest.mark.parametrize("mode", ["pipelined", "auto"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_pipelined_greedy_equals_plain(gen, baseline, mode, k):
    # The draft model, not the default: the default drafts this module's repeated prompt from its
    # reply memory after the first run, and this test is about a draft that gets corrected.
    r = gen.generate(input_ids=PROMPT, max_new_tokens=60, draft_tokens=k, mode=mode, drafter="model", exact=True)
    assert r.token_ids == baseline
    assert r.stats.accepted <= r.stats.drafted
    if mode == "pipelined":
        assert r.stats.pipelined_steps > 0
        assert r.stats.drafted > r.stats.accepted, "the perturbed draft must be corrected sometimes"


def test_pipelined_self_speculation_accepts_everything(self_gen):
    plain = self_gen.generate(input_ids=PROMPT, max_new_tokens=50, speculation=False, exact=True).token_ids
    r = self_gen.generate(input_ids=PROMPT, max_new_tokens=50, draft_tokens=4, mode="pipelined", exact=True)
    assert r.token_ids == plain
    assert r.stats.acceptance == 1.0
    assert r.stats.pipelined_steps > 0


def test_pipelined_adaptive_equals_plain(gen, baseline):
    assert gen.generate(input_ids=PROMPT, max_new_tokens=60, mode="pipelined", exact=True).token_ids == baseline


class AlwaysWrong:
    """Knows the baseline and proposes a wrong first token every block."""

    name = "always-wrong"
    catchup_s = 0.0  # the Drafter contract's catch-up accounting: it reads nothing
    catchup_tokens = 0

    def __init__(self, baseline, prompt_len, vocab):
        self.baseline, self.prompt_len, self.vocab = baseline, prompt_len, vocab

    def begin(self, prompt):
        pass

    def propose(self, history, k, source=ANY_SOURCE):
        pos = len(history) - self.prompt_len
        true_next = self.baseline[pos] if pos < len(self.baseline) else 0
        wrong = [(true_next + 1 + i) % self.vocab for i in range(k)]
        return Proposal(np.array(wrong, np.int64))

    def accept(self, history, n_accepted):
        assert n_accepted == 0

    def pending_tokens(self, history):
        return 0

    def lookup_offer(self, history, limit):
        return NO_LOOKUP


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
def test_every_block_rejected_still_equals_plain(gen, baseline, mode):
    drafter = AlwaysWrong(baseline, len(PROMPT), gen.manifest.target.vocab_size)
    result = loop.LoopResult()
    for _ in loop.run(gen.target, gen.target_kv, np.array(PROMPT), max_new_tokens=60,
                      eos_token_ids=gen.eos_token_ids, sampling=SamplingConfig(), rng=np.random.default_rng(0),
                      drafter=drafter, controller=FixedK(3), result=result, mode=mode):
        pass
    assert result.tokens == baseline
    assert result.stats.accepted == 0 and result.stats.drafted > 0


def test_discarded_drafts_do_not_leak_into_caches(gen, baseline):
    gen.generate(input_ids=PROMPT, max_new_tokens=60, speculation=False, exact=True)
    committed = gen.target_kv.length
    plain_keys = [committed_rows(gen.target_kv, k, committed).copy() for k in gen.target_kv.keys]
    r = gen.generate(input_ids=PROMPT, max_new_tokens=60, draft_tokens=4, mode="pipelined", exact=True)
    assert r.token_ids == baseline
    assert gen.target_kv.length <= committed + 4
    for plain, spec in zip(plain_keys, gen.target_kv.keys):
        # Batched and unbatched float sums differ in the last bits only.
        np.testing.assert_allclose(committed_rows(gen.target_kv, spec, committed), plain, atol=1e-5)

    drafter = ModelDrafter(gen.draft, SamplingConfig(), cache=gen.draft_kv)
    result = loop.LoopResult()
    for _ in loop.run(gen.target, gen.target_kv, np.array(PROMPT), max_new_tokens=60,
                      eos_token_ids=gen.eos_token_ids, sampling=SamplingConfig(), rng=np.random.default_rng(0),
                      drafter=drafter, controller=FixedK(4), result=result, mode="pipelined"):
        pass
    history = PROMPT + result.tokens
    assert drafter.cache.length == len(drafter.cached)
    # Whatever the draft cache still holds beyond the history is an unverified early draft;
    # everything up to the history's length must be committed tokens.
    assert drafter.cached[:len(history)] == history[:len(drafter.cached)]


def committed_rows(kv, buf, n):
    """The first n cached positions of one layer's buffer, whatever the cache layout."""
    return buf[:n] if kv.layout == "position-major" else buf[0, :, :n]


def test_pipelined_sampling_matches_plain_sampling_distribution(sampling_pair):
    g = sampling_pair
    prompt = [6, 7, 8]
    plain = token_counts(g, prompt, 500, 16, speculation=False)
    pipelined = token_counts(g, prompt, 500, 16, draft_tokens=2, mode="pipelined")
    assert_same_distribution(plain, pipelined)


def test_max_latency_caps_the_draft_length_without_changing_output(gen, baseline):
    free = gen.generate(input_ids=PROMPT, max_new_tokens=60, draft_tokens=8, exact=True)
    loose = gen.generate(input_ids=PROMPT, max_new_tokens=60, draft_tokens=8, max_latency_s=60.0, exact=True)
    tight = gen.generate(input_ids=PROMPT, max_new_tokens=60, draft_tokens=8, max_latency_s=1e-6, exact=True)
    assert free.token_ids == loose.token_ids == tight.token_ids == baseline
    assert loose.stats.k_chosen == free.stats.k_chosen  # a bound no block reaches changes nothing
    # After the first measured step a microsecond bound leaves no room to draft at all.
    assert tight.stats.k_chosen.get(0, 0) >= tight.stats.steps - 1


def test_max_latency_must_be_positive():
    from specedge.errors import InvalidParameterError
    from specedge.runtime.generator import GenerationConfig

    with pytest.raises(InvalidParameterError, match=r"max_latency_s must be a number in \(0, 60\] or None; got 0"):
        GenerationConfig(max_latency_s=0)
