"""Invariant: reusing a conversation's cached prefix changes how much is prefilled, never a token.

- A later turn that extends an earlier one prefills only its new tokens (``reused_tokens``),
  and in exact mode (where this machine's export allows it) its reply equals a cold start's: greedy plain and speculative, fp32 (both attention
  graphs) and int4, and seeded plain sampling; speculative sampling keeps the target's
  distribution (chi-square).
- The draft model's prefix is kept too: the second turn's catch-up is smaller.
- A prompt that diverges at token 0 reuses nothing and is still right; an over-long prompt is
  refused before anything runs and the slot stays usable; a cancelled stream keeps only the
  committed tokens; a forward that raises drops its slot.
- Several conversations each find their own slot by longest prefix (LRU eviction past the
  count); a new conversation gets the prefix another slot holds copied (the draft's too) and replies
  as a cold start; ``prefill`` pushes a known prefix ahead of the request, the draft's included; a draft
  cache bridged by the draft window is continued on the next turn, not bridged again.
- Concurrent callers on one Generator each get their cold replies (1 or 2 slots); a prefill whose
  request never comes is evicted and changes nothing; the server's worker runs a waiting request
  before queued prefills; a draft forward or a prefill forward that raises drops its slot too.
- Slot memory: priced from the manifest (``specedge info``) and reported per slot (/health).
"""

from __future__ import annotations

import pytest

from conftest import PROMPT_IDS
from exactness import assert_agrees, exact_holds

SYSTEM = list(range(30, 70))  # a 40-token "system prompt"
TURNS = [list(range(80, 86)), list(range(90, 97)), list(range(100, 104))]


def _conversation(gen, **options):
    """Run three turns, each prompt = the whole history so far + the next user turn."""
    history, replies = list(SYSTEM), []
    for turn in TURNS:
        history += turn
        out = gen.generate(input_ids=history, max_new_tokens=12, **options)
        replies.append(out)
        history += out.token_ids
    return replies


@pytest.fixture(scope="module")
def fresh(tiny_model, export):
    from specedge.runtime.generator import Generator

    def make(bundle, **kw):
        return Generator.from_bundle(bundle, threads=1, **kw)

    return make


@pytest.mark.parametrize("attention", ["gqa", "standard"])
@pytest.mark.parametrize("speculation", [dict(speculation=False), dict(drafter="model", draft_tokens=3,
                                                                        adaptive=False)],
                         ids=["plain", "model-k3"])
def test_later_turns_reuse_the_prefix_and_reply_as_a_cold_start(attention, speculation, tiny_model, export, fresh):
    folder = tiny_model("llama")
    bundle = export(folder, draft=folder, attention=attention)
    # Exact where the graph is row-invariant on this machine (the standard graph is not on every CPU:
    # there exact mode is refused, and a fast-mode reply may differ from the cold one only at a near tie).
    gen = fresh(bundle)
    exact = exact_holds(gen)
    warm = _conversation(gen, exact=exact, **speculation)
    cold = _conversation(fresh(bundle), reuse_prefix=False, exact=exact, **speculation)
    history = list(SYSTEM)
    for turn, w, c in zip(TURNS, warm, cold):
        history += turn
        assert_agrees(gen, history, c.token_ids, w.token_ids, exact=exact)
        if w.token_ids != c.token_ids:
            break  # a near tie: the later turns' prompts differ
        history += c.token_ids
    assert warm[0].stats.reused_tokens == 0
    for turn, reply in enumerate(warm[1:], 1):
        # Everything but the new user turn (and the last reply token, never fed) was held.
        assert reply.stats.reused_tokens >= len(SYSTEM) + sum(map(len, TURNS[:turn])), turn
    assert all(r.stats.reused_tokens == 0 for r in cold)
    if speculation.get("drafter") == "model":
        assert warm[2].stats.catchup_tokens < cold[2].stats.catchup_tokens


def test_a_bridged_draft_cache_is_continued_not_bridged_again(int4_bundle, fresh):
    """With a draft window shorter than the history, turn 1 bridges the draft's catch-up (sink +
    recent tokens); later turns continue that cache through its gap and read only what is new."""
    options = dict(drafter="model", draft_tokens=3, adaptive=False, draft_window=16, exact=True)
    gen = fresh(int4_bundle)
    warm = _conversation(gen, **options)
    cold = _conversation(fresh(int4_bundle), reuse_prefix=False, **options)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    held = gen.slots.slots[0].draft_prefix
    assert held.skipped > 0 and held.head == 4  # the gap of turn 1 is still there, 4 sink tokens before it
    for turn in (1, 2):
        # The user turn, and the reply's last tokens the draft had not read (at most the final block: k + 1).
        new = len(TURNS[turn]) + 3 + 1
        assert warm[turn].stats.catchup_tokens <= new < cold[turn].stats.catchup_tokens == 16, turn


def test_prefill_ahead_fills_the_draft_too(int4_bundle, fresh):
    """Generator.prefill also feeds the draft model (whole, past the draft window: it runs before the
    turn ends), so the request's draft reads only the tail and sees the whole conversation."""
    options = dict(drafter="model", draft_tokens=3, adaptive=False, draft_window=16, exact=True)
    gen = fresh(int4_bundle)
    known = SYSTEM + TURNS[0]
    report = gen.prefill(input_ids=known, **options)
    assert report["draft_computed_tokens"] == len(known)
    assert gen.prefill(input_ids=known, **options)["draft_computed_tokens"] == 0
    assert gen.prefill(input_ids=known, speculation=False, exact=True)["draft_computed_tokens"] == 0
    out = gen.generate(input_ids=known + [5, 6], max_new_tokens=8, **options)
    assert out.stats.catchup_tokens <= 3  # the 2 new tokens and the first target token, never the window
    assert out.token_ids == fresh(int4_bundle).generate(input_ids=known + [5, 6], max_new_tokens=8,
                                                         reuse_prefix=False, **options).token_ids
    assert gen.slots.slots[0].draft_prefix.skipped == 0  # no gap: the draft read everything


def test_int4_reuse_is_exact_too(int4_bundle, fresh):
    options = dict(drafter="model", draft_tokens=4, adaptive=False, exact=True)
    assert [r.token_ids for r in _conversation(fresh(int4_bundle), **options)] == \
           [r.token_ids for r in _conversation(fresh(int4_bundle), reuse_prefix=False, **options)]


def test_seeded_plain_sampling_with_reuse_equals_a_cold_start(self_spec_bundle, fresh):
    """The target's logits are bit-identical with reuse, so a seeded plain sample is too."""
    options = dict(temperature=0.9, seed=7, speculation=False, exact=True)
    assert [r.token_ids for r in _conversation(fresh(self_spec_bundle), **options)] == \
           [r.token_ids for r in _conversation(fresh(self_spec_bundle), reuse_prefix=False, **options)]


def test_speculative_sampling_with_reuse_keeps_the_target_distribution(sampling_pair):
    """The draft is not batch-invariant, so its reused prefix moves p_draft in the low bits: a seed
    no longer pins the sample, but the rejection rule keeps the target's distribution."""
    from distribution import assert_same_distribution, token_counts

    prompt = [6, 7, 8, 9, 10, 11, 12, 13]
    plain = token_counts(sampling_pair, prompt, 400, 16, speculation=False, reuse_prefix=False)
    assert sampling_pair.generate(input_ids=prompt, max_new_tokens=2, draft_tokens=2,
                                  adaptive=False).stats.reused_tokens == len(prompt) - 1
    warm = token_counts(sampling_pair, prompt, 400, 16, draft_tokens=2, adaptive=False)
    assert_same_distribution(plain, warm)


def test_a_prompt_that_diverges_at_token_0_reuses_nothing(llama_bundle, fresh, load_generator):
    gen = fresh(llama_bundle)
    gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4, speculation=False)
    other = [7] + PROMPT_IDS[1:]
    out = gen.generate(input_ids=other, max_new_tokens=8, speculation=False)
    assert out.stats.reused_tokens == 0
    assert out.token_ids == fresh(llama_bundle).generate(input_ids=other, max_new_tokens=8,
                                                          speculation=False).token_ids


def test_an_over_long_prompt_is_refused_and_the_slot_stays_usable(llama_bundle, fresh):
    from specedge.errors import ContextOverflowError

    gen = fresh(llama_bundle)
    first = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4, speculation=False)
    with pytest.raises(ContextOverflowError):
        gen.generate(input_ids=PROMPT_IDS * 20, max_new_tokens=4, speculation=False)
    again = gen.generate(input_ids=PROMPT_IDS + first.token_ids, max_new_tokens=4, speculation=False)
    assert again.stats.reused_tokens == len(PROMPT_IDS) + len(first.token_ids) - 1


def test_a_cancelled_stream_keeps_only_committed_tokens(self_spec_bundle, fresh):
    gen = fresh(self_spec_bundle)
    stream = gen.stream(input_ids=PROMPT_IDS, max_new_tokens=40, drafter="model", draft_tokens=4, adaptive=False, exact=True)
    next(stream)
    stream.cancel()
    for _ in stream:
        pass
    committed = stream.result.token_ids
    assert stream.result.finish_reason == "cancelled" and len(committed) < 40
    slot = gen.slots.slots[0]
    assert slot.tokens == (PROMPT_IDS + committed)[:len(slot.tokens)]
    assert slot.target_kv.length == len(slot.tokens) <= len(PROMPT_IDS) + len(committed)
    prompt = PROMPT_IDS + committed
    warm = gen.generate(input_ids=prompt, max_new_tokens=10, speculation=False, exact=True)
    assert warm.token_ids == fresh(self_spec_bundle).generate(input_ids=prompt, max_new_tokens=10,
                                                              speculation=False, exact=True).token_ids


def test_a_forward_that_raises_drops_its_slot(llama_bundle, fresh, monkeypatch):
    gen = fresh(llama_bundle)
    gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4, speculation=False)
    calls = {"n": 0}
    original = gen.target.inner.forward

    def flaky(ids, kv, num_logits=1):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return original(ids, kv, num_logits)

    monkeypatch.setattr(gen.target.inner, "forward", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        gen.generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8, speculation=False)
    assert gen.slots.slots[0].tokens == [] and gen.slots.slots[0].target_kv.length == 0
    monkeypatch.setattr(gen.target.inner, "forward", original)
    out = gen.generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8, speculation=False)
    assert out.stats.reused_tokens == 0
    assert out.token_ids == fresh(llama_bundle).generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8,
                                                          speculation=False).token_ids


def test_conversations_find_their_own_slots(llama_bundle, fresh):
    gen = fresh(llama_bundle, cache_slots=2)
    a, b = list(range(30, 60)), list(range(150, 180))
    ra = gen.generate(input_ids=a, max_new_tokens=6, speculation=False, exact=True)
    rb = gen.generate(input_ids=b, max_new_tokens=6, speculation=False, exact=True)
    assert len(gen.slots.slots) == 2
    for prompt, reply in ((a, ra), (b, rb)):
        nxt = prompt + reply.token_ids + [7, 8]
        out = gen.generate(input_ids=nxt, max_new_tokens=6, speculation=False, exact=True)
        assert out.stats.reused_tokens == len(prompt) + len(reply.token_ids) - 1
        assert out.token_ids == fresh(llama_bundle).generate(input_ids=nxt, max_new_tokens=6,
                                                              speculation=False, exact=True).token_ids
    # A third conversation evicts the least recently used slot (a's), never b's.
    gen.generate(input_ids=list(range(200, 220)), max_new_tokens=4, speculation=False, exact=True)
    assert gen.generate(input_ids=b + rb.token_ids + [7, 8] , max_new_tokens=2,
                        speculation=False, exact=True).stats.reused_tokens > len(b)


@pytest.mark.parametrize("speculation", [dict(speculation=False), dict(drafter="model", draft_tokens=2,
                                                                        adaptive=False)],
                         ids=["plain", "model-k2"])
def test_a_new_conversation_copies_the_prefix_another_slot_holds(self_spec_bundle, fresh, speculation):
    """A second caller with the same system prompt takes a free slot with that prompt's K/V copied in
    (the draft's too): it prefills only its own turn, replies as a cold start, and the first caller's
    slot still holds its whole conversation."""
    options = dict(max_new_tokens=6, exact=True, **speculation)
    gen = fresh(self_spec_bundle, cache_slots=2)
    first = SYSTEM + TURNS[0]
    ra = gen.generate(input_ids=first, **options)
    second = SYSTEM + TURNS[1]
    rb = gen.generate(input_ids=second, **options)
    assert len(gen.slots.slots) == 2 and rb.stats.reused_tokens == len(SYSTEM)
    assert rb.token_ids == fresh(self_spec_bundle).generate(input_ids=second, **options).token_ids
    if "drafter" in speculation:
        assert gen.slots.slots[1].draft_prefix.tokens[:len(SYSTEM)] == SYSTEM
    nxt = first + ra.token_ids + TURNS[2]
    again = gen.generate(input_ids=nxt, **options)
    assert again.stats.reused_tokens == len(first) + len(ra.token_ids) - 1
    assert again.token_ids == fresh(self_spec_bundle).generate(input_ids=nxt, **options).token_ids


def test_prefill_ahead_leaves_only_the_tail_to_compute(llama_bundle, fresh):
    gen = fresh(llama_bundle)
    known = SYSTEM + TURNS[0]
    report = gen.prefill(input_ids=known, exact=True)
    assert report == {**report, "prompt_tokens": len(known), "reused_tokens": 0, "computed_tokens": len(known)}
    assert gen.prefill(input_ids=known, exact=True)["computed_tokens"] == 0
    out = gen.generate(input_ids=known + [5, 6], max_new_tokens=6, speculation=False, exact=True)
    assert out.stats.reused_tokens == len(known)
    assert out.token_ids == fresh(llama_bundle).generate(input_ids=known + [5, 6], max_new_tokens=6,
                                                          speculation=False, exact=True).token_ids


def test_slot_memory_is_priced_from_the_manifest_and_reported_per_slot(int4_bundle, fresh):
    """`specedge info` prices a slot from the manifest alone; that price is what a slot allocates,
    and describe() (/health) reports each slot's used and allocated bytes."""
    from specedge.runtime.slots import SlotCost

    gen = fresh(int4_bundle, cache_slots=3)
    cost = SlotCost.of(gen.manifest)
    assert cost.bytes == gen.slots.slots[0].nbytes() == cost.target_bytes + cost.draft_bytes > cost.target_bytes
    out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=5, drafter="model", draft_tokens=2, adaptive=False)
    state = gen.slots.describe()
    assert state["slot_bytes"] == cost.bytes and state["max_bytes"] == 3 * cost.bytes
    assert state["bytes"] == cost.bytes  # one slot allocated so far, however many are allowed
    [slot] = state["per_slot"]
    held = len(PROMPT_IDS) + len(out.token_ids)
    assert slot["held_tokens"] == slot["target_positions"] <= held
    per_position = cost.target_bytes // gen.max_context
    draft_per_position = cost.draft_bytes // gen.max_context
    assert slot["used_bytes"] == slot["target_positions"] * per_position + slot["draft_positions"] * draft_per_position
    assert 0 < slot["used_bytes"] < slot["allocated_bytes"] == cost.bytes
    assert SlotCost.of(gen.manifest, with_draft=False).bytes == cost.target_bytes


def test_cache_limits_are_checked(llama_bundle):
    from specedge.errors import InvalidParameterError
    from specedge.runtime.generator import Generator

    with pytest.raises(InvalidParameterError, match="cache_slots must be an integer >= 1"):
        Generator.from_bundle(llama_bundle, cache_slots=0)
    with pytest.raises(InvalidParameterError, match="cannot hold one slot"):
        Generator.from_bundle(llama_bundle, cache_memory=1000)


def _turns(gen, system, turns, **options):
    history, replies = list(system), []
    for turn in turns:
        history += turn
        out = gen.generate(input_ids=history, max_new_tokens=6, **options)
        replies.append(out.token_ids)
        history += out.token_ids
    return replies


@pytest.mark.parametrize("slots", [1, 2])
def test_concurrent_conversations_each_reply_as_their_cold_start(self_spec_bundle, fresh, slots):
    """Three callers talk at once through one Generator (threads started together by a barrier):
    whatever the interleaving and however often their slots are evicted, each caller's replies are
    its cold replies, so no conversation's tokens reach another."""
    import threading

    # Every caller's system prompt starts alike (a copied prefix must never carry one caller's turns).
    calls = {name: (list(range(280, 290)) + list(range(base, base + 14)),
                    [list(range(base + 30, base + 34)), [base + 40, base + 41]])
             for name, base in (("a", 10), ("b", 100), ("c", 200))}
    options = dict(drafter="model", draft_tokens=2, adaptive=False, exact=True)
    cold = {name: _turns(fresh(self_spec_bundle), *call, reuse_prefix=False, **options)
            for name, call in calls.items()}
    gen = fresh(self_spec_bundle, cache_slots=slots)
    barrier = threading.Barrier(len(calls))
    got, errors = {}, []

    def talk(name):
        try:
            barrier.wait()
            got[name] = _turns(gen, *calls[name], **options)
        except BaseException as exc:  # surfaced below: an assert in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == cold
    assert len(gen.slots.slots) <= slots


def test_a_prefill_whose_request_never_comes_is_evicted_and_changes_nothing(llama_bundle, fresh):
    """A prefill that is never followed by its request holds its slot until evicted (least recently
    used first), never more slots or bytes than the pool allows, and others' replies stay cold."""
    gen = fresh(llama_bundle, cache_slots=2)
    orphan = list(range(150, 190))
    gen.prefill(input_ids=orphan, exact=True)
    a, b = (list(range(10, 40)), [[41, 42]]), (list(range(200, 230)), [[231, 232, 233]])
    assert _turns(gen, *a, speculation=False, exact=True) == _turns(fresh(llama_bundle), *a, speculation=False,
                                                                     reuse_prefix=False, exact=True)
    assert any(slot.tokens[:len(orphan)] == orphan for slot in gen.slots.slots)  # a took the free slot
    assert _turns(gen, *b, speculation=False, exact=True) == _turns(fresh(llama_bundle), *b, speculation=False,
                                                                     reuse_prefix=False, exact=True)
    assert not any(slot.tokens[:len(orphan)] == orphan for slot in gen.slots.slots)  # evicted by b
    assert len(gen.slots.slots) == 2 and gen.slots.nbytes() == 2 * gen.slots.slots[0].nbytes()
    # Its request arriving late is merely a cold start, still right.
    late = gen.generate(input_ids=orphan + [5], max_new_tokens=6, speculation=False, exact=True)
    assert late.stats.reused_tokens == 0
    assert late.token_ids == fresh(llama_bundle).generate(input_ids=orphan + [5], max_new_tokens=6,
                                                          speculation=False, exact=True).token_ids


def test_the_worker_runs_a_waiting_request_before_queued_prefills():
    """Prefills wait behind generations: while one generation runs, two prefills and a request
    arrive; the request runs next, then the prefills (the oldest dropped past the bound)."""
    import asyncio
    import threading

    from specedge.runtime.results import GenerationResult
    from specedge.runtime.options import GenerationConfig
    from specedge.server.worker import GenerationWorker, Job

    class Stream:
        def __init__(self, ids):
            self.result = GenerationResult("", [], "stop", prompt_ids=ids)

        def __iter__(self):
            return iter(())

        def cancel(self):
            pass

    class Recorder:  # a Generator stand-in: records call order; the first call waits for a gate
        def __init__(self):
            self.order, self.gate, self.done = [], threading.Event(), threading.Semaphore(0)
            self.started = threading.Event()

        def _call(self, kind, ids):
            if not self.order:
                self.started.set()
                self.gate.wait()
            self.order.append((kind, ids[0]))
            self.done.release()

        def stream(self, *, input_ids, config):
            self._call("generate", input_ids)
            return Stream(input_ids)

        def prefill(self, *, input_ids, config):
            self._call("prefill", input_ids)
            return {"computed_tokens": 1, "reused_tokens": 0, "seconds": 0.0}

    fake = Recorder()
    worker = GenerationWorker(fake, queue_size=2)
    loop = asyncio.new_event_loop()  # never run: events queue up unread
    job = lambda first, prefill=False: Job(loop, [first], GenerationConfig(), prefill=prefill)  # noqa: E731
    try:
        worker.submit(job(1))
        fake.started.wait()  # the first generation is running (and held)
        for first in (2, 3, 4):
            worker.submit_prefill(job(first, prefill=True))  # 2 is dropped: only queue_size prefills wait
        worker.submit(job(5))
        fake.gate.set()
        for _ in range(4):
            fake.done.acquire()
        assert fake.order == [("generate", 1), ("generate", 5), ("prefill", 3), ("prefill", 4)]
        assert worker.status()["cancelled"] == 1
    finally:
        worker.stop()
        loop.close()


@pytest.mark.parametrize("where", ["draft", "prefill"])
def test_a_draft_or_prefill_forward_that_raises_drops_its_slot(int4_bundle, fresh, monkeypatch, where):
    gen = fresh(int4_bundle)
    options = dict(drafter="model", draft_tokens=2, adaptive=False)
    gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4, **options)
    engine = gen.draft if where == "draft" else gen.target.inner

    def broken(ids, kv, num_logits=1):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        if where == "draft":
            gen.generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8, **options)
        else:
            gen.prefill(input_ids=PROMPT_IDS + [40, 41])
    slot = gen.slots.slots[0]
    assert slot.tokens == [] and slot.target_kv.length == 0 and slot.draft_prefix.tokens == []
    monkeypatch.undo()
    out = gen.generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8, **options)
    assert out.stats.reused_tokens == 0
    assert out.token_ids == fresh(int4_bundle).generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8,
                                                         **options).token_ids
