"""`specedge bench bound`'s oracle: the cheapest schedule of the real drafts, and what feeds it.

Guards: the shortest path equals a brute-force search over every schedule (random small cases);
a source never commits more than it drafted right nor drafts more than it offered; more sources or
cheaper verifies never raise the cost; the per-position counts are what the drafts would be.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.bench.bound import (StepPrices, best_schedule, bounds_of, lookup_counts, model_correct,
                                  right_runs)
from specedge.errors import InvalidParameterError
from specedge.runtime.suffix import ReplyMemory
from specedge.runtime.suffix_drafter import SuffixDrafter

PRICES = StepPrices((1.0, 1.0, 1.3, 1.5, 1.8), c=0.25)


def brute_force(lookup_right, lookup_offered, model_right, prices, sources):
    """The least cost over every schedule, by exhaustive recursion (small cases only)."""
    length = len(lookup_right)

    @functools.lru_cache(maxsize=None)
    def cost(i):
        if i >= length:
            return 0.0
        best = 1.0 + cost(i + 1)
        for j in range(1, prices.max_k + 1):
            if "lookup" in sources and j <= lookup_offered[i]:
                best = min(best, prices.v[j] + cost(i + min(j, lookup_right[i]) + 1))
            if "model" in sources and model_right is not None:
                best = min(best, j * prices.c + prices.v[j] + cost(i + min(j, model_right[i]) + 1))
        return best

    return cost(1) if length > 1 else 0.0


def test_right_runs_count_consecutive_hits_from_each_position():
    assert right_runs([True, True, False, True, True, True, False]) == [2, 1, 0, 3, 2, 1, 0]
    assert right_runs([]) == []


def test_nothing_right_means_plain_steps_and_no_gain():
    schedule = best_schedule([0] * 10, [4] * 10, [0] * 10, PRICES)
    assert schedule.cost == pytest.approx(9.0)  # 9 decode tokens, the first came from the prefill
    assert schedule.bound == pytest.approx(1.0)
    assert schedule.steps["plain"] == 9 and schedule.committed["plain"] == 9


def test_a_perfect_lookup_drafts_its_longest_k_every_step():
    length = 21  # 20 decode tokens: 4 steps of 4 drafts + 1 = 5 tokens each
    schedule = best_schedule([50] * length, [4] * length, None, PRICES, sources=("plain", "lookup"))
    assert schedule.steps["lookup"] == 4 and schedule.committed["lookup"] == 20
    assert schedule.cost == pytest.approx(4 * 1.8)
    assert schedule.bound == pytest.approx(20 / 7.2)


def test_a_lookup_cannot_draft_more_than_it_offered():
    # Right for 50 tokens, but only ever offers one: 2 tokens per 1.0-priced step.
    schedule = best_schedule([50] * 11, [1] * 11, None, PRICES, sources=("plain", "lookup"))
    assert schedule.cost == pytest.approx(5.0)
    assert schedule.committed["lookup"] == 10


def test_the_model_pays_its_draft_tokens():
    # The model is right everywhere; 4 drafts cost 4 c + v(4) = 2.8 for 5 tokens.
    schedule = best_schedule([0] * 21, [0] * 21, [50] * 21, PRICES, sources=("plain", "model"))
    assert schedule.cost == pytest.approx(4 * 2.8)
    assert schedule.steps["model"] == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(0, 5)), min_size=1, max_size=12))
def test_the_shortest_path_equals_brute_force_and_more_sources_never_cost_more(rows):
    lookup_right = [r for r, _, _ in rows]
    offered = [o for _, o, _ in rows]
    model_right = [m for _, _, m in rows]
    for sources in (("plain", "lookup"), ("plain", "model"), ("plain", "lookup", "model")):
        schedule = best_schedule(lookup_right, offered, model_right, PRICES, sources=sources)
        assert schedule.cost == pytest.approx(brute_force(lookup_right, offered, model_right, PRICES, sources))
        assert sum(schedule.committed.values()) == schedule.tokens == len(rows) - 1
    bounds = bounds_of(lookup_right, offered, model_right, PRICES)
    assert bounds["both"].cost <= min(bounds["lookup"].cost, bounds["model"].cost) + 1e-9
    assert bounds["both_free_verify"].cost <= bounds["both"].cost + 1e-9
    assert all(b.bound >= 1.0 - 1e-9 for b in bounds.values())


def test_prices_and_counts_are_validated():
    with pytest.raises(InvalidParameterError, match="v\\[0\\] = 1"):
        StepPrices((1.2, 1.3))
    with pytest.raises(InvalidParameterError, match="at least k = 1"):
        StepPrices((1.0,))
    with pytest.raises(InvalidParameterError, match="one entry per reply token"):
        best_schedule([0, 0], [0], None, PRICES)


def test_lookup_counts_are_what_the_lookup_would_draft_at_each_position():
    memory = ReplyMemory(24, 4096)
    memory.add([7, 8, 9, 10, 11, 12])  # an earlier reply
    prompt = [1, 2, 3, 4, 5, 6]
    reply = [7, 8, 9, 10, 99, 5, 6]
    right, offered = lookup_counts(SuffixDrafter(memory, min_match=1), prompt, reply, 4)
    # Each position asked afresh, on the committed history before it.
    for i in range(len(reply)):
        drafter = SuffixDrafter(memory, min_match=1)
        history = np.asarray(prompt + reply[:i], np.int64)
        drafter.begin(history)
        tokens = drafter.propose(history, min(4, len(reply) - i)).tokens.tolist()
        assert offered[i] == len(tokens)
        hits = 0
        while hits < len(tokens) and tokens[hits] == reply[i + hits]:
            hits += 1
        assert right[i] == hits
    # After 7 (a 1-token match): a 1-token guess, 8. After 7 8: a 2-token copy, 9 10. After 7 8 9: three
    # tokens, 10 11 12, of which 99 leaves one right.
    assert right[1:4] == [1, 2, 1] and offered[1:4] == [1, 2, 3]
    assert right[4] == 0  # 99 was never seen


class _ArgmaxEngine:
    """Logits whose argmax at each position is ``table[token at that position]`` (a bigram oracle)."""

    def __init__(self, table: dict[int, int], vocab: int) -> None:
        self.table, self.vocab = table, vocab
        self.calls = 0

    def new_cache(self):
        return object()

    def forward(self, ids, cache, num_logits=1):
        self.calls += 1
        logits = np.zeros((len(ids), self.vocab), np.float32)
        for row, token in enumerate(ids.tolist()):
            logits[row, self.table.get(token, 0)] = 1.0
        return logits[-num_logits:]


def test_model_correct_is_one_teacher_forced_forward_and_maps_a_truncated_head():
    engine = _ArgmaxEngine({5: 1, 6: 2, 7: 0}, vocab=3)
    head_ids = np.asarray([40, 41, 42])  # head index -> token id
    # prompt ends with 5 -> predicts head 1 = 41 (right); 41 -> head 0 = 40 (reply says 42: wrong)
    correct = model_correct(engine, head_ids, [9, 5], [41, 42, 40])
    assert engine.calls == 1
    assert correct == [True, False, True]  # 42 is not in the table -> head 0 = 40, right


def test_the_drafts_prompt_prefill_is_paid_once_and_only_where_it_pays():
    length = 21
    model_right = [50] * length  # right everywhere: 4 model steps of 2.8 for 20 tokens
    free = bounds_of([0] * length, [0] * length, model_right, PRICES)
    paid = bounds_of([0] * length, [0] * length, model_right, PRICES, model_prefill=3.0)
    assert paid["model"].cost == pytest.approx(free["model"].cost + 3.0) and paid["model"].steps["model"] == 4
    # A prefill dearer than all it saves: the oracle leaves the model out.
    unpaid = bounds_of([0] * length, [0] * length, model_right, PRICES, model_prefill=20.0)
    assert unpaid["model"].cost == pytest.approx(20.0) and unpaid["model"].steps["model"] == 0
    assert unpaid["both"].cost == pytest.approx(unpaid["lookup"].cost)


def test_draft_context_bridges_a_long_prompt_as_the_drafter_does():
    from specedge.bench.bound import draft_context
    from specedge.runtime.model_drafter import ModelDrafter

    prompt = list(range(100))
    assert draft_context(prompt, None) == prompt
    assert draft_context(prompt[:10], 64) == prompt[:10]
    bridged = draft_context(prompt, 64)
    sink = ModelDrafter.SINK_TOKENS
    assert len(bridged) == 64 and bridged[:sink] == prompt[:sink] and bridged[sink:] == prompt[-(64 - sink):]
