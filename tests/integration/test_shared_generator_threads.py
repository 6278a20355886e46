"""Hardening: one Generator shared by several threads gives each call the output it gives alone.

What is guaranteed (runtime/generator.py): a Generator owns one KV cache per model, so
its generations are serialised by an internal lock. ``generate()`` holds it for the whole
call; a ``stream()`` holds it from its first ``next()`` until it is exhausted, cancelled
or closed, so a stream another thread is slowly consuming makes other threads wait for
it (nothing interleaves inside the caches). What is *not* possible is to run a second
generation on the same Generator from the thread that still holds an unfinished stream:
the lock is not reentrant, so that raises a SpecedgeError instead of hanging forever.
For parallel generations, load one Generator per thread.

What this module tries, on a tiny llama target with its int4 self-draft (greedy,
fixed k = 4, different prompts per thread):

- 2 and 4 threads calling ``generate()`` at once (sequential and pipelined modes, and
  with the n-gram drafter): each result equals the serial run's, no exceptions, the lock
  is free afterwards;
- ``stream()`` from two threads, each consuming slowly (a sleep per delta) so the
  threads interleave: each stream's text and tokens equal the serial run's;
- the same thread starting a second generation while its first stream is unfinished:
  a SpecedgeError naming the problem (not a deadlock, checked with a timeout), and the
  Generator works normally once the first stream is closed.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specedge.errors import SpecedgeError
from specedge.runtime.generator import Generator
from tiny_models import build_model

PROMPTS = [list(range(6, 26)), list(range(40, 52)), [7, 8, 9, 10, 11, 12, 13], list(range(100, 130))]
# Exact mode: a reply then does not depend on which slot (reused prefix or cold) it ran in.
SETTINGS = dict(max_new_tokens=80, drafter="model", draft_tokens=4, adaptive=False, exact=True)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from specedge.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("hardening-threads")
    folder = build_model(root / "model", "llama", 0)
    out = root / "bundle"
    export_bundle(ExportConfig(target=str(folder), out=out, draft="self-int4", max_context=256, quiet=True))
    return out


@pytest.fixture(scope="module")
def gen(bundle) -> Generator:
    return Generator.from_bundle(bundle, threads=1)


def _serial(gen: Generator, **extra) -> list:
    return [gen.generate(input_ids=p, **{**SETTINGS, **extra}) for p in PROMPTS]


@pytest.mark.parametrize("n_threads", [2, 4])
@pytest.mark.parametrize("extra", [{}, {"mode": "pipelined"}, {"drafter": "ngram"}],
                         ids=["sequential", "pipelined", "ngram"])
def test_concurrent_generate_equals_serial(gen, n_threads, extra):
    serial = _serial(gen, **extra)
    prompts = PROMPTS[:n_threads]
    start = threading.Barrier(n_threads)

    def run(prompt):
        start.wait(30)  # release all threads at once
        return gen.generate(input_ids=prompt, **{**SETTINGS, **extra})

    with ThreadPoolExecutor(n_threads) as pool:
        results = list(pool.map(run, prompts * 2))  # each prompt twice, all in flight together
    for i, result in enumerate(results):
        expected = serial[i % n_threads]
        assert result.token_ids == expected.token_ids and result.text == expected.text
        assert result.finish_reason == expected.finish_reason
    assert not gen._lock.locked()


def test_streams_from_two_threads_interleaved(gen):
    serial = _serial(gen)[:2]
    texts: dict[int, list[str]] = {0: [], 1: []}
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def consume(i):
        try:
            start.wait(30)
            stream = gen.stream(input_ids=PROMPTS[i], **SETTINGS)
            for delta in stream:
                texts[i].append(delta)
                time.sleep(0.002)  # a slow consumer: the other thread gets scheduled in between
            results[i] = stream.result
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors
    for i in range(2):
        assert "".join(texts[i]) == serial[i].text
        assert results[i].token_ids == serial[i].token_ids
    assert not gen._lock.locked()


def test_second_generation_in_the_thread_holding_a_stream_raises_instead_of_hanging(gen):
    expected = gen.generate(input_ids=PROMPTS[1], **SETTINGS)
    outcome: dict[str, object] = {}

    def scenario():
        stream = gen.stream(input_ids=PROMPTS[0], **SETTINGS)
        next(stream)  # the stream now holds the Generator
        try:
            gen.generate(input_ids=PROMPTS[1], **SETTINGS)
        except SpecedgeError as exc:
            outcome["error"] = str(exc)
        try:
            next(gen.stream(input_ids=PROMPTS[1], **SETTINGS))
        except SpecedgeError as exc:
            outcome["stream_error"] = str(exc)
        stream.close()
        outcome["after"] = gen.generate(input_ids=PROMPTS[1], **SETTINGS)

    worker = threading.Thread(target=scenario, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "deadlock: a second generation waited for the same thread's stream"
    assert "unfinished generation on this Generator" in outcome["error"]
    assert "unfinished generation" in outcome["stream_error"]
    assert outcome["after"].token_ids == expected.token_ids
    assert not gen._lock.locked()


def test_a_callback_that_raises_releases_the_generator_on_every_exit_path(gen):
    """``stream(callback=...)`` whose callback starts a second generation raises; the stream
    it was driving must let go of the Generator at once, not at the next garbage collection
    (a stream and its generator refer to each other): this thread can generate again, and
    another thread is not kept waiting. The cyclic collector is off during the scenario, and
    the exception (with its traceback) is kept alive, so nothing but the fix can free the lock."""
    import gc

    expected = gen.generate(input_ids=PROMPTS[1], **SETTINGS)
    outcome: dict[str, object] = {}

    def scenario():
        try:
            gen.stream(input_ids=PROMPTS[0], callback=lambda delta: gen.generate(input_ids=PROMPTS[1], **SETTINGS),
                       **SETTINGS)
        except SpecedgeError as exc:
            outcome["error"] = exc  # keeps the traceback, and every frame in it, alive
        outcome["locked_after_error"] = gen._lock.locked()
        outcome["same_thread"] = gen.generate(input_ids=PROMPTS[1], **SETTINGS)
        other = threading.Thread(target=lambda: outcome.__setitem__(
            "other_thread", gen.generate(input_ids=PROMPTS[1], **SETTINGS)), daemon=True)
        other.start()
        other.join(120)
        outcome["other_alive"] = other.is_alive()

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        worker = threading.Thread(target=scenario, daemon=True)
        worker.start()
        worker.join(240)
    finally:
        if was_enabled:
            gc.enable()
    assert not worker.is_alive(), "the raising callback left the Generator held"
    assert "unfinished generation" in str(outcome["error"])
    assert outcome["locked_after_error"] is False
    assert outcome["same_thread"].token_ids == expected.token_ids
    assert outcome["other_alive"] is False and outcome["other_thread"].token_ids == expected.token_ids
    assert not gen._lock.locked()


def test_warmup_and_tune_take_the_generator_too(gen):
    """warmup() and tune() run forwards on the shared caches, so they hold the Generator like a
    generation does: from the thread holding an unfinished stream they refuse, instead of
    writing into the caches under the stream."""
    stream = gen.stream(input_ids=PROMPTS[0], **SETTINGS)
    next(stream)
    try:
        with pytest.raises(SpecedgeError, match="unfinished generation"):
            gen.warmup(tune=False)
        with pytest.raises(SpecedgeError, match="unfinished generation"):
            gen.tune()
        with pytest.raises(SpecedgeError, match="unfinished generation"):
            gen.forget_replies()
    finally:
        stream.close()
    assert not gen._lock.locked()
