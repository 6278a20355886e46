"""The bench's configurations run as cold requests on a Generator that keeps conversation slots."""

from __future__ import annotations

from specedge.bench.configs import parse_config_name


def test_bench_runs_are_cold_requests_even_on_a_generator_that_keeps_a_slot(reference):
    """The configurations run one prompt one after another on one Generator. Reusing the slot
    would give the later ones the prompt's cache (a near-zero TTFT) and a warm draft (no
    catch-up, an inflated speedup); with the bench's configs every run computes the whole prompt."""
    gen = reference()
    prompt = list(range(3, 40))
    for name in ("baseline", "model-k4", "model-adaptive", "auto-adaptive"):
        config = parse_config_name(name).generation_config(8, chat=False)
        result = gen.generate(input_ids=prompt, config=config)
        assert result.stats.reused_tokens == 0, name
    # The same Generator does reuse the prompt when asked: the check above is not vacuous.
    again = gen.generate(input_ids=prompt, max_new_tokens=8, chat=False, speculation=False)
    assert again.stats.reused_tokens > 0


def test_peer_companions_draft_from_a_fresh_reply_memory_per_peer_and_round(reference):
    """Our runs interleaved with a peer's must not replay the identical replies earlier runs gave
    to the same prompt: each companion (label, category, round) gets its own reply memory."""
    from specedge.bench.peers import OURS_BEST, Job, _companions

    gen = reference()
    prompt = list(range(3, 40))
    job = Job("w", "repeat", prompt, 16, [])
    best = {"repeat": {"config": "suffix-adaptive"}}
    first = _companions(gen, best)[OURS_BEST](job, 0)
    memory = gen.memory.replies
    # The same prompt again, as a second peer's companions or a second round would run it.
    again = _companions(gen, best)[OURS_BEST](job, 0)
    assert gen.memory.replies is not memory
    assert again.tokens == first.tokens
    later_round = _companions(gen, best)
    later_round[OURS_BEST](job, 0)
    round_zero = gen.memory.replies
    later_round[OURS_BEST](job, 1)
    assert gen.memory.replies is not round_zero
