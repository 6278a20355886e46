"""The n-gram (prompt lookup) drafter: proposes the continuation of the most recent match.

Guards: longest n first, most recent occurrence wins, never matches the suffix
with itself, the index grows incrementally (no rescans) and survives the loop's
accept calls, and proposals are point masses (draft_probs None).
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from specedge.runtime.drafters import NGramDrafter


def arr(*xs):
    return np.array(xs, np.int64)


def test_proposes_continuation_of_most_recent_match():
    d = NGramDrafter(max_ngram=3, min_ngram=1)
    history = arr(1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3)
    d.begin(history)
    p = d.propose(history, 2)
    assert p.tokens.tolist() == [7, 7]  # the later "1 2 3" is followed by 7 7
    assert p.draft_probs is None


def test_longer_ngram_wins_over_more_recent_shorter_one():
    d = NGramDrafter(max_ngram=2, min_ngram=1)
    history = arr(5, 6, 8, 0, 6, 4, 5, 6)
    d.begin(history)
    # suffix "5 6" matched at the start (-> 8); "6" alone most recently -> 4
    assert d.propose(history, 1).tokens.tolist() == [8]


def test_no_match_returns_empty_and_suffix_never_matches_itself():
    d = NGramDrafter(max_ngram=3, min_ngram=2)
    history = arr(1, 2, 3, 4)
    d.begin(history)
    assert len(d.propose(history, 4).tokens) == 0


def test_index_is_incremental_across_steps():
    d = NGramDrafter(max_ngram=2, min_ngram=1)
    prompt = arr(10, 11, 12)
    d.begin(prompt)
    history = np.concatenate([prompt, arr(10)])
    assert d.propose(history, 2).tokens.tolist() == [11, 12]
    history = np.concatenate([history, arr(11, 40)])  # committed: 11 accepted, then a correction 40
    d.accept(history, 1)
    assert d._tokens == history.tolist()
    history = np.concatenate([history, arr(10, 11)])
    assert d.propose(history, 3).tokens.tolist() == [40, 10, 11]


def test_k_caps_the_proposal():
    d = NGramDrafter()
    history = arr(*range(20), 0, 1)
    d.begin(history)
    assert d.propose(history, 3).tokens.tolist() == [2, 3, 4]


def test_invalid_sizes():
    with pytest.raises(InvalidParameterError, match="min_ngram <= max_ngram"):
        NGramDrafter(max_ngram=1, min_ngram=2)
