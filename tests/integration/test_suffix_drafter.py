"""The suffix drafter: speed from this reply and earlier ones, never different tokens.

Guards:
- proposals: the longest earlier-seen suffix's most frequent continuation, point masses,
  at most k tokens, nothing below the minimum match (a 1-token match offered as a guess only
  where allowed), the default drafter drafting from the source it is given, the local trie only ever holding
  committed history, and the longer match (then the higher expected_accepted) of local vs reply memory winning;
- greedy output equals plain decoding in exact mode for k in {1, 2, 4, 8}, adaptive k and pipelined mode;
- cross-reply memory: a repeated prompt is drafted from the earlier reply (more accepted)
  with identical output; forget_replies() and reply_memory=False turn that off; the memory's
  size is reported;
- sampling: the committed tokens keep plain decoding's distribution (chi-square);
- the registry names it for the CLI, the server and the bench with no other edits.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PROMPT_IDS
from distribution import assert_same_distribution, token_counts
from exactness import assert_agrees, exact_holds
from specedge.errors import InvalidParameterError
from specedge.runtime.drafters import DRAFTER_CHOICES, DRAFTERS, AutoDrafter, SuffixDrafter
from specedge.runtime.drafting import ANY_SOURCE, LOOKUP_SOURCE, MODEL_SOURCE, NO_LOOKUP, LookupOffer
from specedge.runtime.verify import Proposal
from specedge.runtime.generator import Generator
from specedge.runtime.suffix import ReplyMemory, SuffixTrie
from specedge.runtime.suffix_drafter import REPLY_CUE_TOKENS

N_TOKENS = 40


def arr(*xs):
    return np.array(xs, np.int64)


def trie_of(tokens) -> SuffixTrie:
    trie = SuffixTrie(SuffixDrafter().depth)
    trie.insert(np.asarray(tokens).tolist())
    return trie


# --------------------------------------------------------------------------- proposals


def test_proposes_the_continuation_of_the_longest_match_as_point_masses():
    d = SuffixDrafter()
    history = arr(1, 2, 3, 4, 5, 9, 9, 2, 3, 7, 1, 2, 3)
    d.begin(history)
    p = d.propose(history, 2)
    assert p.tokens.tolist() == [4, 5]  # "1 2 3" (3 tokens) beats the shorter "2 3" -> 7
    assert p.draft_probs is None and d.last_source == "local"


def test_k_caps_the_draft_and_a_long_match_drafts_a_long_copy():
    d = SuffixDrafter()
    history = arr(*range(100, 140), *range(100, 130))  # a 30-token repeat: the copy goes on
    d.begin(history)
    assert d.propose(history, 8).tokens.tolist() == list(range(130, 138))
    assert d.propose(history, 3).tokens.tolist() == [130, 131, 132]
    assert len(d.propose(history, 0).tokens) == 0


def test_a_one_token_match_and_the_suffix_itself_propose_nothing():
    d = SuffixDrafter()
    history = arr(1, 2, 3, 9, 4, 3)  # "3" repeats alone (below min_match); "4 3" never did
    d.begin(history)
    assert len(d.propose(history, 4).tokens) == 0 and d.last_source == "none"


def test_a_one_token_match_is_offered_as_a_guess_only_where_allowed():
    history = arr(1, 2, 3, 9, 4, 3)  # "3" was followed by 9 once: a 1-token match
    strict, guessing = SuffixDrafter(), SuffixDrafter(min_match=1)
    strict.begin(history)
    guessing.begin(history)
    assert strict.lookup_offer(history, 4) == NO_LOOKUP
    offer = guessing.lookup_offer(history, 4)
    assert offer == LookupOffer(1, 1) and offer.guess
    assert guessing.propose(history, 4).tokens.tolist() == [9]  # one token: a guess is never extended
    long = arr(5, 6, 7, 8, 5, 6)
    guessing.begin(long)
    assert guessing.lookup_offer(long, 4) == LookupOffer(2, 2) and not guessing.lookup_offer(long, 4).guess


class FakeModel:
    """A draft model that always proposes 42s (the AutoDrafter's model side)."""

    catchup_s, catchup_tokens = 0.0, 0

    def begin(self, prompt):
        pass

    def propose(self, history, k, source=ANY_SOURCE):
        return Proposal(np.full(k, 42, np.int64), from_model=True)

    def accept(self, history, n_accepted):
        pass

    def pending_tokens(self, history):
        return 1


def test_the_default_drafter_drafts_from_the_source_it_is_given():
    auto = AutoDrafter(SuffixDrafter(min_match=1), FakeModel())
    strong = arr(5, 6, 7, 8, 5, 6)  # "5 6" -> 7 8: a strong lookup
    auto.begin(strong)
    assert auto.propose(strong, 2).tokens.tolist() == [7, 8] and auto.last_source == "lookup"  # its own order
    assert auto.propose(strong, 2, MODEL_SOURCE).tokens.tolist() == [42, 42] and auto.last_source == "model"
    guess = arr(1, 2, 3, 9, 4, 3)  # only a guess (9)
    auto.begin(guess)
    assert auto.propose(guess, 2).tokens.tolist() == [42, 42]  # its own order: a guess never beats the model
    assert auto.propose(guess, 2, LOOKUP_SOURCE).tokens.tolist() == [9] and auto.last_source == "lookup"
    alone = AutoDrafter(SuffixDrafter(min_match=1), None)
    alone.begin(guess)
    assert alone.propose(guess, 2).tokens.tolist() == [9]  # no model: the guess is all there is


def test_local_trie_holds_only_committed_history():
    d = SuffixDrafter()
    prompt = arr(10, 11, 12, 13)
    d.begin(prompt)
    # A pipelined look-ahead proposes on guessed tokens: they must not enter the trie.
    assert d.propose(np.concatenate([prompt, arr(10, 11)]), 2).tokens.tolist() == [12, 13]
    assert d.local.dump() == trie_of(prompt).dump()
    committed = np.concatenate([prompt, arr(10, 40)])
    d.accept(committed, 0)
    assert d.local.dump() == trie_of(committed).dump()  # appended == rebuilt
    d.accept(arr(5, 6), 0)  # history shrank: a new conversation without begin rebuilds
    assert d.local.dump() == trie_of(arr(5, 6)).dump()


def test_the_source_with_the_longer_match_wins():
    replies = ReplyMemory(24, 100)
    replies.add([3, 4, 5, 6, 7, 8, 9, 10])  # an earlier reply, verbatim
    d = SuffixDrafter(replies)
    # Locally "5 6" was followed by 7 11 12 13 (a longer chain than the memory's match allows)...
    history = arr(5, 6, 7, 11, 12, 13, 1, 3, 4, 5, 6, 7)
    d.begin(history)
    # ...but the memory matches "3 4 5 6 7" (5 tokens) where the local trie matches "5 6 7" (3).
    assert d.best(history, 8)[1].match_length > d.chain(d.local, history[-d.max_match:].tolist(), 8).match_length
    assert d.propose(history, 3).tokens.tolist() == [8, 9, 10]
    assert d.last_source == "replies"


def test_on_equal_matches_the_source_with_more_expected_accepted_tokens_wins():
    replies = ReplyMemory(24, 100)
    replies.add([7, 8, 50, 51, 52, 53])  # an earlier reply continued "7 8" for 4 tokens
    d = SuffixDrafter(replies)
    history = arr(1, 7, 8, 60, 2, 7, 8)  # locally "7 8" -> 60 -> 2: a 2-token chain
    d.begin(history)
    assert d.propose(history, 2).tokens.tolist() == [60, 2]  # 2 expected tokens each: local wins ties
    assert d.last_source == "local"
    history = arr(7, 8, 60, 7, 8, 61, 7, 8)  # locally "7 8" -> 60 or 61: 0.5 + 0.5 expected tokens
    d.begin(history)
    assert d.propose(history, 4).tokens.tolist() == [50, 51]  # 2 expected from the memory win
    assert d.last_source == "replies"
    assert len(SuffixDrafter(None).propose(arr(9, 9, 7, 8), 4).tokens) == 0  # no memory, nothing local


def test_bad_settings_are_refused():
    with pytest.raises(InvalidParameterError, match="suffix drafter needs"):
        SuffixDrafter(min_prob=1.0)
    with pytest.raises(InvalidParameterError, match="suffix drafter needs"):
        SuffixDrafter(depth=4, min_match=4)


# --------------------------------------------------------------------------- greedy equality


@pytest.fixture(scope="module")
def looping(arch_bundle):
    """The tiny gpt2 target loops on a few tokens: suffix lookup finds long matches. A private
    Generator: its reply memory is this module's alone."""
    return Generator.from_bundle(arch_bundle("gpt2"), threads=1)


@pytest.fixture(scope="module")
def plain(looping):
    return looping.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False,
                            exact=exact_holds(looping)).token_ids


@pytest.mark.parametrize("options", [
    {"draft_tokens": 1}, {"draft_tokens": 2}, {"draft_tokens": 4}, {"draft_tokens": 8},
    {},  # adaptive k
    {"draft_tokens": 4, "mode": "pipelined"},
    {"draft_tokens": 4, "reply_memory": False},
])
def test_greedy_equals_plain_decoding(options, looping, plain):
    for _ in range(2):  # the second call drafts from the first's reply too
        # The tiny gpt2's standard-attention graph is not row-invariant on every CPU: exact where it is.
        exact = exact_holds(looping)
        result = looping.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="suffix", exact=exact,
                                  **options)
        assert_agrees(looping, PROMPT_IDS, plain, result.token_ids, exact=exact)
        stats = result.stats
        assert stats.drafter == "suffix" and stats.accepted <= stats.drafted
        assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))
    if options.get("draft_tokens"):
        assert stats.accepted > 0  # a looping reply really was drafted from
        assert max(int(k) for k in stats.k_chosen) <= options["draft_tokens"]


def test_greedy_equals_plain_on_a_target_that_does_not_loop(llama_bundle):
    gen = Generator.from_bundle(llama_bundle, threads=1)
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=True).token_ids
    for k in (1, 2, 4, 8):
        assert gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="suffix",
                            draft_tokens=k, exact=True).token_ids == plain


# --------------------------------------------------------------------------- cross-reply memory


def test_a_repeated_prompt_is_drafted_from_the_earlier_reply(llama_bundle):
    gen = Generator.from_bundle(llama_bundle, threads=1)
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=True)
    assert plain.stats.reply_memory_tokens == 0  # plain decoding records nothing
    kw = dict(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="suffix", draft_tokens=4, exact=True)
    first = gen.generate(**kw)
    # The reply, after its prompt's last REPLY_CUE_TOKENS (the cue a repeated question matches).
    assert first.stats.reply_memory_tokens == N_TOKENS + min(REPLY_CUE_TOKENS, len(PROMPT_IDS))
    assert first.stats.reply_memory_bytes > 0
    second = gen.generate(**kw)
    assert first.token_ids == second.token_ids == plain.token_ids  # speed only
    assert second.stats.accepted > first.stats.accepted + N_TOKENS // 2
    assert second.stats.steps < first.stats.steps

    gen.forget_replies()
    forgotten = gen.generate(**kw)
    assert forgotten.token_ids == plain.token_ids
    assert (forgotten.stats.drafted, forgotten.stats.accepted) == (first.stats.drafted, first.stats.accepted)

    gen.forget_replies()
    off = [gen.generate(**kw, reply_memory=False) for _ in range(2)]
    assert off[0].token_ids == off[1].token_ids == plain.token_ids
    assert (off[1].stats.drafted, off[1].stats.accepted) == (first.stats.drafted, first.stats.accepted)
    assert off[1].stats.reply_memory_tokens == 0  # reply_memory=False neither reads nor records


# --------------------------------------------------------------------------- sampling


def test_sampled_tokens_keep_the_plain_distribution(sampling_pair):
    """A 16-token vocabulary repeats itself often, so the local trie and the reply memory
    (fed by every one of the 500 runs) both propose; the committed tokens' histograms
    at positions 1..3 must match plain sampling's."""
    prompt = [3, 5, 3, 5, 3, 5, 7]
    sampling_pair.forget_replies()
    try:
        plain = token_counts(sampling_pair, prompt, 500, 16, speculation=False)
        suffix = token_counts(sampling_pair, prompt, 500, 16, drafter="suffix", draft_tokens=2, adaptive=False)
        drafted = sampling_pair.generate(input_ids=prompt, max_new_tokens=8, temperature=1.0, seed=0,
                                         drafter="suffix", draft_tokens=2, adaptive=False).stats.drafted
        assert drafted > 0  # the suffix drafter really proposed
        assert_same_distribution(plain, suffix)
    finally:
        sampling_pair.forget_replies()


# --------------------------------------------------------------------------- the registry


def test_the_registry_names_it_everywhere():
    from specedge.bench.configs import parse_config_name
    from specedge.runtime.options import OPTIONS, GenerationConfig
    from specedge.server.protocol import SPECEDGE_FIELDS

    assert "suffix" in DRAFTER_CHOICES and not DRAFTERS["suffix"].needs_draft_model
    assert DRAFTERS["suffix"].reads_replies
    assert GenerationConfig(drafter="suffix", reply_memory=False).drafter == "suffix"
    assert OPTIONS["reply_memory"].cli == ("--no-reply-memory",) and "reply_memory" in SPECEDGE_FIELDS
    assert parse_config_name("suffix-k4").drafter == "suffix"
    adaptive = parse_config_name("suffix-adaptive")
    assert adaptive.drafter == "suffix" and adaptive.draft_tokens is None
