"""Invariant: the numpy reference engine keeps the Engine contract the runtime relies on, exactly.

- K/V of the new tokens land in the loop-owned position-major cache at ``kv.length ..``, and
  ``kv.length`` advances by n; logits are float32 ``[min(num_logits, n), vocab]``;
- a row of an n-row forward is bit-identical (logits and K/V) to 1-row forwards at the same
  positions, so speculative greedy output can be compared with plain decoding token for token;
- rewinding and rewriting a slot gives the bits a fresh cache gets;
- overflow and bad ids are typed errors raised before anything is written;
- the seeds the unit tests share give long greedy continuations, and the perturbed draft agrees
  with the target often but not always (so oracles meet both accepted and corrected blocks).
"""

from __future__ import annotations

import numpy as np
import pytest

from reference_engine import (PROMPT_IDS, ReferenceConfig, ReferenceEngine, ReferenceWeights, draft_weights,
                              plain_greedy, target_weights)
from specedge.engines.base import Engine, KVCache
from specedge.errors import ContextOverflowError, InvalidParameterError
from tiny_models import EOS_ID


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(target_weights())


def test_it_is_an_engine_with_a_position_major_cache(engine):
    typed: Engine = engine  # the Protocol's members, checked statically
    assert (typed.vocab_size, typed.max_context) == (96, 256)
    kv = typed.new_cache()
    c = engine.config
    assert isinstance(kv, KVCache) and kv.layout == "position-major" and kv.length == 0
    assert kv.keys[0].shape == (c.max_context, c.n_kv_heads, c.head_dim) and kv.keys[0].dtype == np.float32
    assert len(kv.keys) == len(kv.values) == c.n_layers


@pytest.mark.parametrize("n, num_logits, rows", [(1, 1, 1), (5, 1, 1), (5, 3, 3), (5, 9, 5), (5, 0, 1)])
def test_forward_writes_kv_advances_length_and_returns_the_last_rows(engine, n, num_logits, rows):
    kv = engine.new_cache()
    engine.forward(np.array([7, 8], np.int64), kv)
    before = [k.copy() for k in kv.keys]
    logits = engine.forward(np.arange(10, 10 + n, dtype=np.int64), kv, num_logits)
    assert logits.dtype == np.float32 and logits.shape == (rows, engine.vocab_size)
    assert kv.length == 2 + n
    for layer, k in enumerate(kv.keys):
        assert np.array_equal(k[:2], before[layer][:2])  # the prefix is untouched
        assert np.abs(k[2:2 + n]).sum() > 0  # the new positions were written
        assert not k[2 + n:].any()  # and nothing past them


def test_a_row_of_a_multi_row_forward_equals_one_row_forwards_bit_for_bit(engine):
    ids = np.array(PROMPT_IDS[:12], np.int64)
    batched, single = engine.new_cache(), engine.new_cache()
    engine.forward(ids[:4], batched)
    engine.forward(ids[:4], single)
    rows = engine.forward(ids[4:], batched, num_logits=8)
    one_by_one = np.concatenate([engine.forward(ids[i:i + 1], single) for i in range(4, 12)])
    assert np.array_equal(rows, one_by_one)
    for layer in range(engine.config.n_layers):
        assert np.array_equal(batched.keys[layer][:12], single.keys[layer][:12])
        assert np.array_equal(batched.values[layer][:12], single.values[layer][:12])


def test_a_rewound_slot_is_rewritten_with_the_bits_a_fresh_cache_gets(engine):
    kv, fresh = engine.new_cache(), engine.new_cache()
    engine.forward(np.array([9, 10, 11, 12], np.int64), kv)
    kv.rewind(2)  # drop 11, 12 (rejected draft tokens)
    again = engine.forward(np.array([30, 31], np.int64), kv, 2)
    assert np.array_equal(again, engine.forward(np.array([9, 10, 30, 31], np.int64), fresh, 2))
    assert np.array_equal(kv.keys[1][:4], fresh.keys[1][:4])


def test_overflow_and_bad_input_are_typed_and_write_nothing(engine):
    small = ReferenceEngine(engine.weights, max_context=8)
    kv = small.new_cache()
    small.forward(np.arange(6, 12, dtype=np.int64), kv)
    with pytest.raises(ContextOverflowError, match="6 cached \\+ 3 new positions exceed max_context 8"):
        small.forward(np.array([6, 7, 8], np.int64), kv)
    with pytest.raises(InvalidParameterError, match="at least one token"):
        small.forward(np.zeros(0, np.int64), kv)
    with pytest.raises(InvalidParameterError, match=r"token ids must lie in \[0, 96\)"):
        small.forward(np.array([96], np.int64), kv)
    assert kv.length == 6


def test_a_truncated_head_scores_its_subset(engine):
    head = np.arange(0, engine.vocab_size, 2, dtype=np.int64)
    truncated = ReferenceEngine(engine.weights, head_ids=head)
    full = engine.forward(np.array(PROMPT_IDS, np.int64), engine.new_cache(), 3)
    part = truncated.forward(np.array(PROMPT_IDS, np.int64), truncated.new_cache(), 3)
    assert part.shape == (3, len(head)) and np.array_equal(part, full[:, head])


def test_bad_shapes_are_refused():
    with pytest.raises(InvalidParameterError, match="multiple of n_kv_heads"):
        ReferenceConfig(n_heads=4, n_kv_heads=3)


def test_weights_come_from_the_seed():
    a, b = ReferenceWeights.random(seed=3), ReferenceWeights.random(seed=3)
    assert np.array_equal(a.lm_head, b.lm_head) and np.array_equal(a.layers[1]["wq"], b.layers[1]["wq"])
    assert not np.array_equal(a.embed, ReferenceWeights.random(seed=4).embed)


def test_the_shared_seeds_give_long_varied_continuations_and_a_draft_that_disagrees_sometimes():
    target = ReferenceEngine(target_weights())
    out = plain_greedy(target, PROMPT_IDS, 64)
    assert len(out) == 64 and EOS_ID not in out  # long sequences for the oracles
    assert len(set(out)) > 20  # not a short loop: prompt lookup cannot copy all of it
    draft = ReferenceEngine(draft_weights(target.weights))
    history = PROMPT_IDS + out
    guesses = np.argmax(draft.forward(np.array(history[:-1], np.int64), draft.new_cache(), len(out)), axis=-1)
    agreement = float(np.mean(guesses == np.array(out)))
    assert 0.3 < agreement < 0.9, agreement  # accepted blocks and corrections both occur


def test_a_cancelled_exact_step_leaves_the_cache_length_where_it_was(engine):
    """Exact mode's 1-token step rewinds a row to recompute it in a 2-row forward; a forward stopped by a
    cancel (engines/base.py ForwardCancelled) must leave ``kv.length`` as the call found it, and the next
    step then gives the bits an uncancelled run gives."""
    from specedge.engines.invariant import BatchInvariantEngine
    from specedge.errors import ForwardCancelled

    class CancelledOnce:
        def __init__(self, inner):
            self.inner, self.armed = inner, False
            self.vocab_size, self.max_context = inner.vocab_size, inner.max_context

        def new_cache(self):
            return self.inner.new_cache()

        def forward(self, ids, kv, num_logits=1):
            if self.armed:
                self.armed = False
                raise ForwardCancelled("cancelled inside the forward (test)")
            return self.inner.forward(ids, kv, num_logits)

    flaky, clean = BatchInvariantEngine(CancelledOnce(engine)), BatchInvariantEngine(engine)
    kv, kv_clean = flaky.new_cache(), clean.new_cache()
    prompt = np.asarray(PROMPT_IDS, np.int64)
    flaky.forward(prompt, kv)
    clean.forward(prompt, kv_clean)
    flaky.inner.armed = True
    with pytest.raises(ForwardCancelled):
        flaky.forward(np.array([5], np.int64), kv)
    assert kv.length == len(prompt)
    assert np.array_equal(flaky.forward(np.array([5], np.int64), kv), clean.forward(np.array([5], np.int64), kv_clean))
    assert kv.length == kv_clean.length == len(prompt) + 1
