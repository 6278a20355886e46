"""Invariant: the suffix trie holds exactly the counted substrings of what was inserted, however it got there.

- Appending a sequence token by token, in any chunking, gives the same trie as inserting it
  whole, and both equal a brute-force count of every substring of up to ``depth`` tokens.
- Removing a sequence gives the trie of the others (eviction); freed nodes are reused.
- The reply memory never holds more than its token budget and evicts the oldest replies first.
- ``longest_match`` finds the longest suffix of the context that was followed by a token
  before (checked against brute force); ``best_chain`` follows the most frequent continuation.

Pure Python: no model, no onnxruntime.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime.suffix import ReplyMemory, SuffixTrie, best_chain

tokens = st.lists(st.integers(0, 5), max_size=40)  # a small alphabet makes repeats, hence sharing


def brute_force(sequences, depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter = Counter()
    for seq in sequences:
        for begin in range(len(seq)):
            for end in range(begin + 1, min(len(seq), begin + depth) + 1):
                counts[tuple(seq[begin:end])] += 1
    return dict(counts)


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(tokens, max_size=4), depth=st.integers(2, 6), cuts=st.lists(st.integers(1, 7), max_size=10))
def test_incremental_appends_equal_a_rebuild_and_brute_force(seqs, depth, cuts):
    whole, chunked = SuffixTrie(depth), SuffixTrie(depth)
    for seq in seqs:
        whole.insert(seq)
        appender, at = chunked.start(), 0
        for cut in cuts or [len(seq)]:
            appender.extend(seq[at:at + cut])
            at += cut
        appender.extend(seq[at:])
    assert whole.dump() == chunked.dump() == brute_force(seqs, depth)
    assert whole.nodes == len(whole.dump()) + 1


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(tokens, min_size=1, max_size=5), depth=st.integers(2, 6), data=st.data())
def test_removing_a_sequence_leaves_the_trie_of_the_others(seqs, depth, data):
    trie = SuffixTrie(depth)
    for seq in seqs:
        trie.insert(seq)
    gone = data.draw(st.integers(0, len(seqs) - 1))
    trie.remove(seqs[gone])
    rest = seqs[:gone] + seqs[gone + 1:]
    assert trie.dump() == brute_force(rest, depth)
    assert trie.nodes == len(trie.dump()) + 1
    slots = len(trie._count)
    trie.insert(seqs[gone])  # re-inserting reuses the freed slots before growing
    assert trie.dump() == brute_force(rest + [seqs[gone]], depth)
    assert len(trie._count) == slots


def test_remove_of_something_never_inserted_is_refused():
    trie = SuffixTrie(4)
    trie.insert([1, 2, 3])
    with pytest.raises(ValueError, match="not inserted"):
        trie.remove([7])


@settings(max_examples=100, deadline=None)
@given(replies=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=12), max_size=12),
       budget=st.integers(1, 30))
def test_reply_memory_stays_within_budget_and_evicts_oldest_first(replies, budget):
    memory = ReplyMemory(depth=5, max_tokens=budget)
    for reply in replies:
        memory.add(reply)
        assert memory.tokens <= budget
    kept = [tuple(r)[-budget:] for r in replies]
    # What remains is a suffix of the replies (oldest evicted first), as a rebuild would hold it.
    held = list(memory._replies)
    assert held == kept[len(kept) - len(held):]
    assert memory.trie.dump() == brute_force(held, 5)
    memory.clear()
    assert memory.tokens == 0 and memory.trie.nodes == 1


@settings(max_examples=200, deadline=None)
@given(memory=st.lists(tokens, max_size=3), context=tokens, depth=st.integers(2, 6))
def test_longest_match_is_the_longest_suffix_that_had_a_continuation(memory, context, depth):
    trie = SuffixTrie(depth)
    for seq in memory:
        trie.insert(seq)
    match = trie.longest_match(context)
    followed = {tuple(s[b:e]) for s in memory for b in range(len(s)) for e in range(b + 1, len(s))}
    best = max((m for m in range(0, min(len(context), depth - 1) + 1)
                if m == 0 or tuple(context[len(context) - m:]) in followed), default=0)
    assert match.length == best


def test_best_chain_follows_the_most_frequent_continuation():
    trie = SuffixTrie(8)
    for reply in ([5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 1, 2]):
        trie.insert(reply)
    chain = best_chain(trie, [3, 5, 6, 7], 8, min_prob=0.0, length_factor=4.0)
    assert chain.tokens == (8, 9) and chain.match_length == 3
    assert chain.probs == pytest.approx((2 / 3, 1.0))
    assert chain.expected_accepted == pytest.approx(2 / 3 + 2 / 3)
    # A confidence floor stops the chain where the cumulative probability would fall below it.
    assert best_chain(trie, [5, 6, 7], 8, min_prob=0.7, length_factor=4.0).tokens == ()
    # A short match drafts a short chain: length_factor x match length.
    assert best_chain(trie, [7], 8, min_prob=0.0, length_factor=1.0).tokens == (8,)
    assert best_chain(trie, [4, 4], 8, min_prob=0.0, length_factor=4.0).tokens == ()


def test_nbytes_grows_with_content():
    trie = SuffixTrie(16)
    empty = trie.nbytes()
    trie.insert(list(range(200)))
    assert trie.nbytes() > empty


def test_a_reply_remembered_after_its_cue_is_drafted_from_its_first_token():
    from specedge.runtime.suffix_drafter import SuffixDrafter

    question = [40, 41, 42, 43, 44, 45, 46, 47]  # the prompt's tail: the question and the assistant header
    reply = [70, 71, 72, 73, 74, 75]
    with_cue, bare = ReplyMemory(24, 100), ReplyMemory(24, 100)
    with_cue.add(reply, cue=question)
    bare.add(reply)
    assert with_cue.tokens == len(question) + len(reply)  # the cue counts towards the bound
    asked_again = [1, 2, *question]  # the same question, later: nothing of the reply is out yet
    drafter = SuffixDrafter(with_cue)
    drafter.begin(asked_again)
    assert drafter.propose(asked_again, 6).tokens.tolist() == reply
    drafter = SuffixDrafter(bare)
    drafter.begin(asked_again)
    assert len(drafter.propose(asked_again, 6).tokens) == 0
    # The bound keeps the newest tokens: a cue never pushes a reply's own tokens out.
    small = ReplyMemory(24, 8)
    small.add(reply, cue=question)
    assert small.tokens == 8 and small.replies == 1
    small.add([], cue=question)  # an empty reply is not remembered for its cue alone
    assert small.tokens == 8 and small.replies == 1
