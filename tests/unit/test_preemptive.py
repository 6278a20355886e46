"""Invariant: a cancelled request never leaves a slot holding tokens the next request does not share.

Preemptive generation (LiveKit's default, Pipecat's eager end of turn) sends a request on each
interim transcript and cancels it when the transcript grows; then the final request comes. After
any such cancel (before the first block, after the prefill, after a few blocks), the next attempt
and the final request reuse the whole prefix they share with the cancelled one, in the slot it
used, and the final reply equals a cold request's token for token (exact mode). Cancels are
placed after N blocks, never after a time, so the test is deterministic.
"""

from __future__ import annotations

import pytest

from specedge.runtime.slots import common_prefix

SYSTEM = [(7 * i) % 88 + 5 for i in range(60)]  # a system prompt every caller shares
USER = [(11 * i) % 80 + 9 for i in range(30)]  # the final transcript of the user's turn
TAIL = [2, 3, 4, 2, 5]  # the chat template's end of message and assistant header
OPTIONS = {"max_new_tokens": 24, "exact": True, "reply_memory": False}


def _prompt(history: list[int], words: int) -> list[int]:
    return history + USER[:words] + TAIL


def _cancelled_attempt(gen, prompt: list[int], blocks: int) -> int:
    """Send ``prompt`` and cancel it after ``blocks`` deltas (0: cancelled before it starts, so the
    cancel lands while its prefill runs); return the tokens it reused."""
    stream = gen.stream(input_ids=prompt, **OPTIONS)
    if blocks == 0:
        stream.cancel()
    for i, _ in enumerate(stream):
        if i + 1 >= blocks > 0:
            break
    stream.close()
    assert stream.result.finish_reason == "cancelled"
    return stream.result.stats.reused_tokens


@pytest.mark.parametrize("blocks", [0, 1, 3, 8])
@pytest.mark.parametrize("turn", ["first", "later"])
def test_after_cancelled_attempts_the_final_request_reuses_the_whole_common_prefix(reference, blocks, turn):
    gen = reference(cache_slots=4)
    history = list(SYSTEM)
    if turn == "later":  # an earlier turn of the conversation is held: the attempts continue it
        first = gen.generate(input_ids=_prompt(SYSTEM, 12), **OPTIONS)
        history = first.prompt_ids + first.token_ids + [6]
    attempts = [_prompt(history, n) for n in (8, 16, 24)]
    previous = None
    for prompt in attempts:
        reused = _cancelled_attempt(gen, prompt, blocks)
        if previous is not None:  # the cancelled attempt's slot is taken again, its prompt reused
            assert reused == common_prefix(previous, prompt)
        previous = prompt
    final_prompt = _prompt(history, len(USER))
    final = gen.generate(input_ids=final_prompt, **OPTIONS)
    assert final.stats.reused_tokens == common_prefix(previous, final_prompt)
    assert sum(bool(slot.tokens) for slot in gen.slots.slots) == 1  # one conversation, one slot
    cold = reference(cache_slots=4).generate(input_ids=final_prompt, reuse_prefix=False, **OPTIONS)
    assert final.token_ids == cold.token_ids and final.stats.reused_tokens > 0


def test_a_cancelled_attempt_does_not_make_another_conversation_follow_it(reference):
    """The rule for cancelled prompts is a continuation rule: a caller that shares only the system
    prompt still takes a free slot (with the system prompt copied in), and the cancelled conversation
    keeps its own."""
    gen = reference(cache_slots=4)
    mine = _prompt(SYSTEM, 16)
    _cancelled_attempt(gen, mine, 3)
    other = SYSTEM + [(13 * i) % 70 + 11 for i in range(20)] + TAIL
    assert gen.generate(input_ids=other, **OPTIONS).stats.reused_tokens == len(SYSTEM)
    assert sum(bool(slot.tokens) for slot in gen.slots.slots) == 2
    assert gen.generate(input_ids=_prompt(SYSTEM, 30), **OPTIONS).stats.reused_tokens == len(SYSTEM) + 16


def test_the_preemptive_bench_through_the_server_reuses_the_prefix_and_replies_as_a_single_request(reference):
    """bench/preemptive.py end to end on reference Generators behind real servers: cancels after N
    deltas (deterministic), every attempt accounted for, the final replies equal across configurations."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from specedge.bench.conversation import Conversation
    from specedge.bench.preemptive import (CONFIGS, CancelPlan, LocalServer, attempt_texts, format_report,
                                           run_preemptive)

    assert attempt_texts("w010 w011 w012 w013", 3) == ["w010", "w010 w011", "w010 w011 w012"]
    talk = Conversation("w020 w021 w022 w023 w024 w025", ("w030 w031 w032 w033 w034 w035 w036 w037",
                                                           "w040 w041 w042 w043 w044 w045"))
    servers = {name: LocalServer(reference(cache_slots=4)) for name in CONFIGS}
    try:
        report = run_preemptive(servers, talk, plan=CancelPlan(attempts=3, after_blocks=2), max_new_tokens=12)
    finally:
        for server in servers.values():
            server.close()
    assert report.identical
    rows = {(t.config, t.turn): t for t in report.turns}
    for t in report.turns:  # the bound: measured for every preemptive turn, on its uncached tokens only
        assert (t.bound is not None) == (t.config == "preemptive")
        if t.bound is not None:
            assert t.bound.new_tokens == t.prompt_tokens - t.reused_tokens and t.prompt_ids
            assert t.bound.bound_s == t.bound.step_s + t.bound.prefill_s > 0
            assert t.queue_s is not None and t.server_prefill_s is not None
    summary = report.summary()["preemptive"]
    assert summary["turns_bounded"] == 2 and 0 <= summary["turns_within_bound"] <= 2
    assert summary["cancel_to_free_p50_s"] <= summary["cancel_to_free_p90_s"] <= summary["cancel_to_free_max_s"]
    text = format_report(report, CancelPlan(attempts=3, after_blocks=2))
    assert f"{summary['turns_within_bound']} of 2 preemptive turns within it" in text
    # The JSON carries each preemptive turn's bound with its sum, a cold turn none, and no turn its token ids.
    json_turns = {(t["config"], t["turn"]): t for t in report.to_json()["turns"]}
    bounded = json_turns["preemptive", 0]
    assert bounded["bound"]["bound_s"] == rows["preemptive", 0].bound.bound_s and "prompt_ids" not in bounded
    assert all("bound" not in t for (config, _), t in json_turns.items() if config != "preemptive")
    for turn in range(2):
        final = rows["preemptive", turn]
        assert len(final.attempts) == 3 and all(a.ran for a in final.attempts)  # cancelled while streaming
        assert rows["cold", turn].reused_tokens == 0
        # The final request reuses what its last attempt shared with it (at least the single request's reuse).
        # Whether a reference-engine attempt is still running when the server sees the disconnect is a
        # race (it may have finished its 12 tokens): the first turn's reuse depends on it, a later turn's
        # does not (it continues the held conversation either way). The in-process tests above pin the
        # cancelled case deterministically.
        assert final.reused_tokens >= rows["single", turn].reused_tokens
        assert turn == 0 or final.reused_tokens > 0



def test_a_reply_that_differs_from_the_cold_one_is_measured_against_the_near_tie_bound(reference):
    """bench/preemptive.py _explain_turn: a reply that leaves the cold reply on the same prompt gets the
    target's top-2 gap at the first differing token, judged against the bundle's bound; a turn whose
    prompt already differs (an earlier reply differed) is counted, not compared; a cut reply (a prefix
    of the other) is no divergence."""
    from types import SimpleNamespace

    from specedge.bench.preemptive import CancelPlan, PreemptiveReport, PreemptiveTurn, _explain_turn, format_report

    gen = reference()
    prompt = SYSTEM + USER + TAIL
    cold = gen.generate(input_ids=prompt, max_new_tokens=8, temperature=0, exact=True).token_ids
    parted = cold[:3] + [(cold[3] + 1) % 50 + 3]  # leaves the cold reply at token 3

    def turn(config: str, turn_index: int, prompt_ids: list[int], reply: list[int]) -> PreemptiveTurn:
        return PreemptiveTurn(config, turn_index, len(prompt_ids), 0, 0.1, "", prompt_ids=prompt_ids,
                              reply_ids=reply)

    servers = {name: SimpleNamespace(generator=gen) for name in ("cold", "single", "preemptive")}
    for bound, near in ((1e9, True), (0.0, False)):
        gen.near_tie_gap = bound
        report = PreemptiveReport([turn("cold", 0, prompt, cold), turn("single", 0, prompt, parted),
                                   turn("preemptive", 0, prompt, cold[:5]),  # cut short: a prefix, not a divergence
                                   turn("cold", 1, prompt + [9], cold), turn("single", 1, prompt + [10], parted)])
        _explain_turn(report, servers, 0)
        _explain_turn(report, servers, 1)
        (found,) = report.divergences
        assert (found.turn, found.config) == (0, "single") and report.uncompared == 1
        assert found.divergence.index == 3 and found.divergence.tokens == (cold[3], parted[3])
        assert found.divergence.top2_gap >= 0 and found.divergence.near_tie is near
        assert report.near_ties_only is near
        text = format_report(report, CancelPlan())
        assert ("apart: a near tie" in text) is near and ("NOT a near tie" in text) is not near
        assert "1 later reply(ies) not compared" in text
        assert report.to_json()["divergences"][0]["config"] == "single"
