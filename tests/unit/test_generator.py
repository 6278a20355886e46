"""Invariant: the Generator's call path gives every entry point the output plain generation gives.

On the numpy reference engines (tests/reference_engine.py), with a real Manifest, tokenizer and
chat template, so no export is needed:
- generate and stream agree (deltas join to the text, the stream's result is generate's result);
- cancel and close stop at a block boundary with a prefix of the full output, and release the
  Generator; a raising callback ends the run and releases it too; re-entry from the thread that
  holds an open stream raises instead of hanging;
- prefill and conversation reuse skip what a slot holds and change no token; exact and 1-row slots
  are never mixed;
- stop strings, EOS and max_context end a reply with the right reason;
- warmup and tune measure a cost profile and change no output; concurrent calls equal serial ones.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from reference_engine import PROMPT_IDS, ReferenceConfig, ReferenceEngine, plain_greedy, target_weights
from specedge.errors import ContextOverflowError, InvalidParameterError, SpecedgeError
from tiny_models import EOS_ID, word

SPEC = {"drafter": "model", "draft_tokens": 3, "adaptive": False}  # a fixed schedule: seeded runs repeat


@pytest.fixture
def gen(reference):
    return reference()


def test_text_prompts_go_through_the_chat_template_and_the_text_decodes_the_tokens(gen):
    prompt = "w010 w011 w012"
    ids = gen.encode_prompt(prompt)
    assert ids == gen.codec.encode("user w010 w011 w012 assistant")  # the template, rendered and encoded
    out = gen.generate(prompt, max_new_tokens=16, **SPEC)
    assert out.prompt_ids == ids and len(out.token_ids) == 16
    assert out.token_ids == plain_greedy(ReferenceEngine(target_weights()), ids, 16)
    assert out.text == gen.codec.decode(out.token_ids)
    assert gen.generate(prompt, max_new_tokens=16, chat=False).prompt_ids == gen.codec.encode(prompt)


@pytest.mark.parametrize("options", [{"speculation": False}, SPEC, {"drafter": "suffix", "draft_tokens": 2},
                                     {**SPEC, "temperature": 0.8, "seed": 5}], ids=["plain", "model", "suffix", "sampled"])
def test_stream_deltas_join_to_generates_text(gen, options):
    whole = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=40, **options)
    stream = gen.stream(input_ids=PROMPT_IDS, max_new_tokens=40, **options)
    deltas = list(stream)
    assert len(deltas) > 1 and "".join(deltas) == whole.text
    assert stream.result.token_ids == whole.token_ids and stream.result.finish_reason == "length"
    seen = []
    gen.stream(input_ids=PROMPT_IDS, max_new_tokens=40, callback=seen.append, **options)
    assert "".join(seen) == whole.text


@pytest.mark.parametrize("stop_by", ["cancel", "close"])
def test_cancel_and_close_keep_a_prefix_and_release_the_generator(gen, stop_by):
    full = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=48, **SPEC).token_ids
    stream = gen.stream(input_ids=PROMPT_IDS, max_new_tokens=48, **SPEC)
    next(stream)
    next(stream)
    if stop_by == "cancel":
        stream.cancel()
        rest = list(stream)  # at most the block in flight, then the stream ends
        assert len(rest) <= 1 and stream.cancelled
        assert stream.result.finish_reason == "cancelled"
    else:
        stream.close()
    kept = stream.result.token_ids
    assert 0 < len(kept) < 48 and kept == full[:len(kept)]
    assert gen.generate(input_ids=PROMPT_IDS, max_new_tokens=48, **SPEC).token_ids == full  # released, unharmed


def test_a_raising_callback_ends_the_run_and_releases_the_generator(gen):
    def fail(delta: str) -> None:
        raise RuntimeError("consumer went away")

    with pytest.raises(RuntimeError, match="consumer went away"):
        gen.stream(input_ids=PROMPT_IDS, max_new_tokens=32, callback=fail, **SPEC)
    assert len(gen.generate(input_ids=PROMPT_IDS, max_new_tokens=8).token_ids) == 8


def test_a_second_call_from_the_thread_holding_a_stream_raises(gen):
    stream = gen.stream(input_ids=PROMPT_IDS, max_new_tokens=32)
    next(stream)
    with pytest.raises(SpecedgeError, match="already has an unfinished generation"):
        gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4)
    stream.close()
    assert len(gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("options", [{"speculation": False}, SPEC], ids=["plain", "model"])
def test_a_conversations_next_turn_reuses_its_prefix_and_equals_a_cold_start(reference, options):
    gen = reference(cache_slots=2)
    first = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24, **options)
    turn = PROMPT_IDS + first.token_ids + [40, 41, 42]
    warm = gen.generate(input_ids=turn, max_new_tokens=24, **options)
    cold = gen.generate(input_ids=turn, max_new_tokens=24, reuse_prefix=False, **options)
    assert warm.token_ids == cold.token_ids
    assert warm.stats.reused_tokens == len(PROMPT_IDS) + 24 - 1  # the last reply token was never fed
    assert cold.stats.reused_tokens == 0


def test_prefill_ahead_leaves_only_the_new_tokens_to_compute(gen):
    head = PROMPT_IDS[:14]
    ahead = gen.prefill(input_ids=head)
    assert ahead["prompt_tokens"] == ahead["computed_tokens"] == 14 and ahead["reused_tokens"] == 0
    assert gen.prefill(input_ids=head)["computed_tokens"] == 0  # already held
    out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=20, **SPEC)
    assert out.stats.reused_tokens == 14
    assert out.token_ids == plain_greedy(ReferenceEngine(target_weights()), PROMPT_IDS, 20)


def test_exact_and_one_row_slots_are_not_mixed(gen):
    gen.generate(input_ids=PROMPT_IDS, max_new_tokens=8, exact=False)
    again = gen.generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8, exact=True)
    assert again.stats.reused_tokens == 0
    gen.generate(input_ids=PROMPT_IDS, max_new_tokens=8, exact=True)
    again = gen.generate(input_ids=PROMPT_IDS + [40], max_new_tokens=8)  # the default: fast, 1-row steps
    assert again.stats.reused_tokens == 0


def test_a_stop_string_ends_the_text_before_it(gen):
    full = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=40, speculation=False)
    stop = word(full.token_ids[10])
    out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=40, stop=(stop,), **SPEC)
    assert out.finish_reason == "stop"
    first = full.text.index(stop)
    assert out.text == full.text[:first] and stop not in out.text


def test_eos_ends_a_reply_with_stop(tmp_path):
    from reference_engine import reference_bundle
    from specedge.runtime.generator import Generator

    weights = target_weights()
    plain = plain_greedy(ReferenceEngine(weights), PROMPT_IDS, 40)
    # EOS's output row becomes 1.5x that of the 6th reply token: where that token would win, EOS wins.
    lm_head = weights.lm_head.copy()
    lm_head[EOS_ID] = 1.5 * lm_head[plain[5]]
    engine = ReferenceEngine(replace(weights, lm_head=lm_head))
    tokens = plain_greedy(engine, PROMPT_IDS, 40)
    assert tokens[-1] == EOS_ID and len(tokens) <= 6
    gen = Generator(reference_bundle(tmp_path, engine, ReferenceEngine(replace(weights, lm_head=lm_head))))
    for options in ({"speculation": False}, SPEC, {"drafter": "suffix"}):
        out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=40, **options)
        assert out.token_ids == tokens and out.finish_reason == "stop"


def test_max_context_ends_a_reply_with_length_and_says_why(reference):
    gen = reference(config=ReferenceConfig(max_context=40))
    for options in ({"speculation": False}, SPEC, {**SPEC, "draft_tokens": 8}):
        out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=100, **options)
        assert len(PROMPT_IDS) + len(out.token_ids) == 40
        assert out.finish_reason == "length" and "max_context (40 tokens" in out.message
    with pytest.raises(ContextOverflowError, match="prompt is 40 tokens but max_context is 40"):
        gen.generate(input_ids=list(range(6, 46)), max_new_tokens=1)


@pytest.mark.parametrize("kwargs, match", [
    ({"input_ids": []}, "the prompt is empty"),
    ({"input_ids": [96]}, r"outside \[0, 96\)"),
    ({"input_ids": PROMPT_IDS, "draft_tokens": 0.5}, "draft_tokens"),
    ({"input_ids": PROMPT_IDS, "drafter": "nope"}, "drafter"),
    ({"prompt": "w010", "input_ids": [7]}, "exactly one of prompt, messages or input_ids"),
])
def test_bad_calls_are_typed_errors_before_any_forward(gen, kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        gen.generate(max_new_tokens=4, **kwargs)
    assert gen.loaded.target.forwards == gen.loaded.draft.forwards == 0


def test_a_bundle_without_a_draft_model_refuses_the_model_drafter_and_runs_the_others(reference):
    gen = reference(draft=None)
    with pytest.raises(InvalidParameterError, match="drafter 'model' needs a draft model"):
        gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4, drafter="model")
    expected = plain_greedy(ReferenceEngine(target_weights()), PROMPT_IDS, 24)
    assert gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24).token_ids == expected  # falls back to ngram
    assert gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24, drafter="suffix").token_ids == expected


def test_warmup_and_tune_measure_costs_and_change_no_output(gen):
    before = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24, **SPEC).token_ids
    gen.warmup(tune=True)
    assert gen.cost_profile is not None
    costs = gen.memory.costs_for("model", exact=True)  # what new replies start from: the measured profile
    assert set(costs.target_s) == set(range(1, 10)) and all(t > 0 for t in costs.target_s.values())
    assert costs.draft_token_s > 0 and costs.draft_catchup_token_s > 0
    # Fast mode prices its plain step at the profile's 1-row step, the rest alike.
    fast = gen.memory.costs_for("model", exact=False)
    assert fast.target_s[1] == gen.cost_profile.target_one_row_s > 0
    assert {n: t for n, t in fast.target_s.items() if n > 1} == {n: t for n, t in costs.target_s.items() if n > 1}
    assert gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24, **SPEC).token_ids == before
    assert gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24).token_ids == before  # adaptive, on the profile


def test_concurrent_calls_equal_serial_ones(gen):
    prompts = [PROMPT_IDS, PROMPT_IDS[::-1], PROMPT_IDS[5:], [9, 8, 7, 6]]
    serial = [gen.generate(input_ids=p, max_new_tokens=16, **SPEC).token_ids for p in prompts]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = gen.generate(input_ids=prompts[i], max_new_tokens=16, **SPEC).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == serial


def test_seeded_sampling_repeats_for_a_fixed_schedule(gen):
    a = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24, temperature=0.9, seed=11, **SPEC)
    b = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=24, temperature=0.9, seed=11, **SPEC)
    assert a.token_ids == b.token_ids
    assert np.all(np.array(a.token_ids) < 96)
