"""Invariants of the slot pool's choice (runtime/slots.py), on plain lists and numpy caches:

- slots follow conversations: a prompt that continues a slot (or branches inside its latest turn)
  takes it; a prompt that shares only a system prompt takes a free slot, else the least recently
  used one, so interleaved callers each keep their slot and reuse their whole previous turn;
- a prefix another slot holds is copied into the slot a new conversation takes (K/V bytes and
  tokens, the draft's as far as its tokens agree), and the other slot keeps its own;
- isolation: a slot written under one cache salt is never reused, not even its prefix, under
  another, and taking it forgets its tokens past what the new salt may reuse (the draft's too);
  only a published prefix (an operator's prompt cache) is reusable by every salt.
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.engines.base import KVCache
from specedge.errors import InvalidParameterError
from specedge.runtime.slots import CONTINUATION_SLACK, CacheSlot, SlotPool

SYSTEM = list(range(1000, 1055))  # a 55-token system prompt every caller shares


def _pool(max_slots: int) -> SlotPool:
    return SlotPool(lambda: CacheSlot(KVCache(1, 1, 2, 4096), KVCache(1, 1, 2, 4096)), max_slots=max_slots)


def _call(pool: SlotPool, prompt: list[int], reply: list[int], salt: str | None = None) -> tuple[CacheSlot, int]:
    """What the Generator does around a call: acquire, then keep prompt + reply in the slot's cache."""
    slot, reused = pool.acquire(prompt, True, salt=salt)
    slot.target_kv.length = reused + (len(prompt) - reused) + len(reply)  # the loop's prefill and decode
    slot.draft_prefix.set(prompt + reply)
    slot.draft_kv.length = len(prompt) + len(reply)
    slot.keep(prompt + reply, True)
    return slot, reused


@pytest.mark.parametrize("callers", [1, 3, 8])
def test_interleaved_callers_each_keep_their_slot_and_reuse_their_whole_previous_turn(callers):
    pool = _pool(callers)
    history = {c: list(SYSTEM) for c in range(callers)}
    slots = {}
    for turn in range(4):
        for c in range(callers):  # round robin: every caller's turn is followed by the others'
            prompt = history[c] + [2000 + 100 * c + turn] * 5  # the user's new turn
            slot, reused = _call(pool, prompt, [3000 + 100 * c + turn] * 12)
            if turn == 0:
                # A free slot, not another caller's; the system prompt another caller's slot holds is
                # copied into it, not computed again.
                assert slot not in slots.values() and reused == (len(SYSTEM) if c else 0)
                slots[c] = slot
            else:
                assert slot is slots[c] and reused == len(history[c])  # the whole previous turn
            history[c] = prompt + [3000 + 100 * c + turn] * 12
    assert len(pool.slots) == callers


def test_a_continuation_within_the_slack_and_a_branch_of_the_latest_turn_follow_their_slot():
    pool = _pool(4)
    first = SYSTEM + [1] * 6
    slot, _ = _call(pool, first, [2] * 20)
    # The client sends the reply back with its last tokens re-encoded: still this conversation.
    second = first + [2] * (20 - CONTINUATION_SLACK) + [3] * 6
    assert _call(pool, second, [4] * 20) == (slot, len(second) - 6)
    # Turn 3 edited before it ends (an interim transcript revised): a branch of the latest turn.
    held = len(slot.tokens)
    edited = second + [4] * 20 + [5] * 30
    slot_again, reused = _call(pool, edited, [6] * 3)
    assert slot_again is slot and reused == held
    # A branch inside the latest turn (it keeps all the turn found held, and more): still this slot.
    branch = second + [4] * 20 + [5] * 10 + [7] * 20
    assert _call(pool, branch, [8]) == (slot, held + 10)
    # A prompt that keeps less than the latest turn found held is another conversation: a free slot.
    assert _call(pool, second + [9] * 30, [8])[0] is not slot


def test_a_full_pool_evicts_the_least_recently_used_slot_and_keeps_its_shared_prefix():
    pool = _pool(2)
    a, _ = _call(pool, SYSTEM + [1] * 5, [2] * 20)
    b, _ = _call(pool, SYSTEM + [3] * 5, [4] * 20)
    c, reused = _call(pool, SYSTEM + [5] * 5, [6] * 20)
    assert c is a and reused == len(SYSTEM)  # a was least recently used; b's conversation is intact
    assert _call(pool, SYSTEM + [3] * 5 + [4] * 20 + [9], [1])[1] == len(SYSTEM) + 25


@pytest.mark.parametrize("victim_salt,attacker_salt", [("victim", "attacker"), ("victim", None), (None, "attacker")])
def test_another_salt_reuses_nothing_of_a_slot_and_cannot_read_it_back(victim_salt, attacker_salt):
    pool = _pool(1)  # one slot: the attacker's call must take the victim's
    secret = SYSTEM + [4, 7, 1, 9]
    for guess in (4, 5):  # the attacker guesses between the victim's turns
        victim, _ = _call(pool, secret + [1] * 5, [2] * 8, salt=victim_salt)
        slot, reused = _call(pool, SYSTEM + [guess, 0, 0], [3], salt=attacker_salt)
        assert slot is victim and reused == 0
    assert slot.salt == attacker_salt and slot.tokens == SYSTEM + [5, 0, 0, 3]
    # The victim's next turn, under its salt, reuses nothing of the attacker's either.
    assert _call(pool, secret + [1] * 5 + [2] * 8 + [6], [1], salt=victim_salt)[1] == 0


def test_taking_a_slot_under_another_salt_forgets_it_at_once():
    pool = _pool(1)
    slot, _ = _call(pool, SYSTEM + [1] * 5, [2] * 8, salt="a")
    taken, reused = pool.acquire(SYSTEM + [9], True, salt="b")
    assert taken is slot and reused == 0 and slot.tokens == [] and slot.draft_prefix.tokens == []


def test_the_same_salt_shares_a_prefix_when_it_takes_the_slot():
    pool = _pool(1)
    _call(pool, SYSTEM + [4, 7, 1, 9, 1], [2] * 8, salt="s")
    assert _call(pool, SYSTEM + [4, 7, 5, 0], [3], salt="s")[1] == len(SYSTEM) + 2


def test_a_published_prefix_is_reusable_by_every_salt_and_nothing_past_it():
    pool = _pool(2)
    slot, _ = _call(pool, SYSTEM, [])
    slot.publish()
    taken, reused = _call(pool, SYSTEM + [1] * 5, [2] * 8, salt="a")
    assert taken is slot and reused == len(SYSTEM) and slot.shared == len(SYSTEM)
    assert _call(pool, SYSTEM + [1] * 5 + [2] * 8 + [3], [4], salt="a") == (slot, len(SYSTEM) + 13)
    # Another salt sharing a's first words never reads past the published prefix: a's slot is a's
    # conversation (a free slot is taken, and the published prefix copied into it).
    other, reused = _call(pool, SYSTEM + [1] * 5, [5], salt="b")
    assert other is not slot and reused == len(SYSTEM) and other.salt == "b"
    assert slot.reusable(SYSTEM + [1] * 5 + [2] * 8, True, "c") == len(SYSTEM)


def _filled(slot: CacheSlot, tokens: list[int], draft_tokens: list[int], salt: str | None = None) -> None:
    """Give a slot held tokens whose K/V rows are recognisable: row p of every buffer holds tokens[p]."""
    for kv, held in ((slot.target_kv, tokens), (slot.draft_kv, draft_tokens)):
        for buf in kv.keys + kv.values:
            kv.committed(buf, len(held))[...] = np.asarray(held, np.float32).reshape(
                (-1, 1, 1) if kv.layout == "position-major" else (1, 1, -1, 1))
        kv.length = len(held)
    slot.draft_prefix.set(draft_tokens)
    slot.keep(tokens, True)
    slot.salt = salt


@pytest.mark.parametrize("layout", ["position-major", "head-major"])
def test_a_new_conversation_gets_a_copy_of_the_prefix_another_slot_holds(layout):
    pool = SlotPool(lambda: CacheSlot(KVCache(2, 1, 2, 512, layout=layout), KVCache(1, 1, 2, 512, layout=layout)),
                    max_slots=2)
    donor = pool.slots[0]
    history = SYSTEM + [1] * 10 + [2] * 20
    _filled(donor, history, SYSTEM + [1] * 10 + [7] * 5)  # the draft diverged inside the first turn
    before = [buf.copy() for buf in donor.target_kv.keys + donor.target_kv.values]
    prompt = SYSTEM + [1] * 10 + [3] * 4  # branches before the donor's latest turn: not its conversation
    slot, reused = pool.acquire(prompt, True)
    assert slot is not donor and reused == len(SYSTEM) + 10
    assert slot.tokens == prompt[:reused] and slot.target_kv.length == reused
    assert slot.draft_prefix.tokens == prompt[:reused] and slot.draft_kv.length == reused
    for kv in (slot.target_kv, slot.draft_kv):
        for buf in kv.keys + kv.values:
            assert kv.committed(buf).ravel()[::2].tolist() == prompt[:reused]
    assert donor.tokens == history and all(
        np.array_equal(a, b) for a, b in zip(before, donor.target_kv.keys + donor.target_kv.values))
    # The draft copies only what its own tokens share with the prompt.
    slot.drop()
    _, reused = pool.acquire(SYSTEM + [1] * 10 + [2] * 3 + [9], True)
    assert reused == len(SYSTEM) + 13 and slot.draft_prefix.tokens == SYSTEM + [1] * 10
    assert slot.draft_kv.length == len(SYSTEM) + 10


def test_nothing_is_copied_across_salts_nor_between_exact_and_fast_caches():
    pool = _pool(3)
    donor = pool.slots[0]
    _filled(donor, SYSTEM + [1] * 10, SYSTEM + [1] * 10, salt="victim")
    taken, reused = pool.acquire(SYSTEM + [4], True, salt="attacker")
    assert taken is not donor and reused == 0 and taken.tokens == [] and taken.target_kv.length == 0
    assert pool.acquire(SYSTEM + [4], False, salt="victim")[1] == 0  # a fast call: the exact cache is no prefix


def test_a_kv_prefix_is_copied_only_between_caches_of_one_shape():
    cache = KVCache(2, 1, 2, 64)
    cache.length = 10
    with pytest.raises(InvalidParameterError, match="different models or layouts"):
        KVCache(2, 2, 2, 64).copy_prefix(cache, 5)
    with pytest.raises(InvalidParameterError, match="different models or layouts"):
        KVCache(2, 1, 2, 64, layout="head-major").copy_prefix(cache, 5)
    with pytest.raises(InvalidParameterError, match="cannot copy 11 positions"):
        KVCache(2, 1, 2, 64).copy_prefix(cache, 11)
