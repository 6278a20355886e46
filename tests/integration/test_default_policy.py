"""The default policy (drafter ``auto`` + controller ``DefaultK``) on exported tiny bundles: same tokens.

Guards: in exact mode, greedy output equals plain decoding at every k and mode, with and without a draft
model, with and without cross-reply memory (which changes speed, never tokens), and when the
source changes every step (draft model, lookup, guess, plain: each catches up on the others); sampling
keeps the target's distribution (chi-square); the bundle default is ``auto``, lookup-only on
a bundle without a draft model. The budget itself: tests/unit/test_default_budget.py.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from conftest import PROMPT_IDS
from distribution import assert_same_distribution, token_counts
from exactness import assert_agrees, exact_holds
from specedge.runtime import auto_drafter, loop
from specedge.runtime.policies import PLAIN, DraftPlan, Snapshot
from specedge.runtime.drafters import DRAFTERS, AutoDrafter, uses_draft_model
from specedge.runtime.drafting import LOOKUP_SOURCE, MODEL_SOURCE, DraftModel, LookupOffer
from specedge.runtime.generator import Generator
from specedge.runtime.options import GenerationConfig
from specedge.runtime.sampling import SamplingConfig

N_TOKENS = 40


@pytest.fixture(scope="module")
def drafted(self_spec_bundle):
    """Target + draft (the same weights: the model pays); a private Generator and its plain output."""
    gen = Generator.from_bundle(self_spec_bundle, threads=1)
    return gen, gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=True).token_ids


@pytest.mark.parametrize("options", [
    {"draft_tokens": 1}, {"draft_tokens": 2}, {"draft_tokens": 4}, {"draft_tokens": 8},
    {},  # the default: DefaultK
    {"mode": "pipelined"}, {"mode": "auto"},
    {"draft_tokens": 4, "mode": "pipelined"}, {"draft_tokens": 4, "mode": "auto"},
    {"reply_memory": False},
])
def test_greedy_equals_plain_decoding_with_a_draft_model(options, drafted):
    gen, plain = drafted
    for _ in range(3):  # later calls draft from earlier replies too, and carry the budget
        result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, exact=True, **options)
        assert result.token_ids == plain
        stats = result.stats
        assert stats.drafter == "auto" and stats.accepted <= stats.drafted
    if options.get("draft_tokens"):
        assert stats.accepted > 0 and max(int(k) for k in stats.k_chosen) <= options["draft_tokens"]


@pytest.fixture(scope="module")
def lookup_only(arch_bundle):
    """The tiny gpt2 target (no draft model) loops on a few tokens: lookups find long matches."""
    gen = Generator.from_bundle(arch_bundle("gpt2"), threads=1)
    exact = exact_holds(gen)  # its standard-attention graph is not row-invariant on every CPU
    return gen, exact, gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False,
                                    exact=exact).token_ids


@pytest.mark.parametrize("options", [
    {"draft_tokens": 1}, {"draft_tokens": 4}, {"draft_tokens": 8}, {}, {"mode": "pipelined"},
    {"draft_tokens": 4, "mode": "auto"}, {"reply_memory": False},
])
def test_without_a_draft_model_the_default_is_the_lookup_and_equals_plain(options, lookup_only):
    gen, exact, plain = lookup_only
    assert gen.manifest.speculation.drafter == "auto" and gen.draft is None
    for _ in range(2):
        result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, exact=exact, **options)
        assert_agrees(gen, PROMPT_IDS, plain, result.token_ids, exact=exact)
        assert result.stats.drafter == "auto"
        assert result.stats.catchup_tokens == 0  # no model ever ran
    assert result.stats.accepted > 0  # the looping reply was drafted from


def test_cross_reply_memory_changes_speed_never_tokens(llama_bundle):
    gen = Generator.from_bundle(llama_bundle, threads=1)
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=True).token_ids
    first = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, draft_tokens=4, exact=True)
    second = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, draft_tokens=4, exact=True)
    off = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, draft_tokens=4, reply_memory=False, exact=True)
    assert first.token_ids == second.token_ids == off.token_ids == plain
    assert second.stats.accepted > first.stats.accepted  # drafted from the first reply
    assert off.stats.accepted == first.stats.accepted  # without memory: as the first call


class CyclingSources:
    """A controller that changes the default drafter's source every step, in a fixed cycle: the draft
    model, the lookup (a guess where that is all it has, the model where it has nothing), a plain
    step. So every source drafts right after every other one."""

    name = "cycling"

    def __init__(self) -> None:
        self.turn = 0
        self.served: collections.Counter[str] = collections.Counter()

    def choose(self, limit, *, catchup_tokens=0, expected_remaining=None, lookup_tokens=0, lookup_match=0):
        self.turn += 1
        phase = self.turn % 3
        if phase == 1 and lookup_tokens:
            plan = DraftPlan(min(lookup_tokens, limit), LOOKUP_SOURCE)
            self.served["guess" if LookupOffer(lookup_tokens, lookup_match).guess else "lookup"] += 1
        elif phase != 2 and limit > 0:
            plan = DraftPlan(min(3, limit), MODEL_SOURCE)
            self.served["model"] += 1
        else:
            plan = PLAIN
        return plan

    def observe(self, step) -> None:
        pass

    def snapshot(self) -> Snapshot:
        return Snapshot()


def test_switching_sources_every_step_equals_plain_decoding(sampling_pair):
    """The perturbed draft (corrections happen) and the 16-token vocabulary's lookups and guesses take
    turns: the draft model catches up on tokens that lookups and plain steps committed, and the
    output is still plain decoding's."""
    gen = sampling_pair
    prompt = [3, 5, 3, 5, 3, 5, 7]
    plain = gen.generate(input_ids=prompt, max_new_tokens=40, speculation=False, exact=True).token_ids
    draft = DraftModel(gen.draft, gen.draft.new_cache(), gen.draft_head_ids, gen.manifest.target.vocab_size)
    drafter = auto_drafter.build(GenerationConfig(), draft, None)
    controller = CyclingSources()
    result = loop.LoopResult()
    for _ in loop.run(gen.target, gen.target.new_cache(), np.array(prompt, np.int64), max_new_tokens=40,
                      eos_token_ids=gen.eos_token_ids, sampling=SamplingConfig(), rng=np.random.default_rng(0),
                      drafter=drafter, controller=controller, result=result):
        pass
    assert result.tokens == plain
    assert min(controller.served[source] for source in ("model", "lookup", "guess")) > 0, controller.served
    assert 0 < result.stats.accepted < result.stats.drafted  # corrections happened


def test_sampled_tokens_keep_the_plain_distribution(sampling_pair):
    """Lookups (the 16-token vocabulary repeats itself) and the perturbed draft model both propose;
    the committed tokens' histograms must match plain sampling's."""
    prompt = [3, 5, 3, 5, 3, 5, 7]
    sampling_pair.forget_replies()
    try:
        plain = token_counts(sampling_pair, prompt, 500, 16, speculation=False)
        auto = token_counts(sampling_pair, prompt, 500, 16, drafter="auto", draft_tokens=2, adaptive=False)
        stats = sampling_pair.generate(input_ids=prompt, max_new_tokens=8, temperature=1.0, seed=0, drafter="auto",
                                       draft_tokens=2, adaptive=False).stats
        assert stats.drafted > 0
        assert_same_distribution(plain, auto)
    finally:
        sampling_pair.forget_replies()


def test_the_registry_and_the_bundle_default():
    from specedge.bench.configs import parse_config_name
    from specedge.bundle.manifest import SpeculationDefaults
    from specedge.runtime.options import OPTIONS

    spec = DRAFTERS["auto"]
    assert SpeculationDefaults().drafter == "auto" and not spec.needs_draft_model and spec.optional_draft_model
    assert uses_draft_model("auto", True) and not uses_draft_model("auto", False)
    assert not uses_draft_model("suffix", True) and uses_draft_model("model", True)
    assert "auto = the default" in OPTIONS["drafter"].help
    assert parse_config_name("auto-adaptive").drafter == "auto"
    assert AutoDrafter.name == "auto"


def test_the_next_reply_starts_from_what_the_default_learned(drafted):
    """What DefaultK carries across replies (through the Generator's SpeculationMemory), the lookup
    share included, reaches the next reply's controller; forget_replies drops it."""
    gen, plain = drafted
    gen.forget_replies()
    assert gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, exact=True).token_ids == plain
    learned = gen.memory.learned_for("auto", "default")
    assert learned.lookup_share is not None and 0.0 <= learned.lookup_share <= 1.0
    assert learned.budget_s is not None
    controller = gen._drafter_and_controller(GenerationConfig())[1]
    assert controller.carried_lookup_share == learned.lookup_share
    assert controller.lookup_share() == pytest.approx(learned.lookup_share)
    assert controller.budget_s == pytest.approx(max(learned.budget_s, 0.0))  # an overdraft is not carried
    gen.forget_replies()
    assert gen._drafter_and_controller(GenerationConfig())[1].carried_lookup_share is None
