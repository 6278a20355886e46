"""Invariant: a cancel stops the forward in progress, and the caches keep only what was committed before it.

ONNX Runtime's ``RunOptions.terminate`` stops a session run between graph nodes; the ORT engine
sets it when the generation's :class:`~specedge.engines.base.Interrupt` is set. A stopped forward
raises ForwardCancelled and advances no cache length, so a prefill cut off midway leaves its slot
holding the tokens it held before (never tokens whose K/V were not written), and the next request's
reply equals a cold request's. The cancel is issued from inside the session run (the run is wrapped:
the wrapper cancels, then calls the real run), so the stop is deterministic: no timing is involved.

- Engine: both ORT paths (IO binding and plain ``run``) stop, raise ForwardCancelled, keep ``length``;
  a later run (a fresh RunOptions) succeeds and computes the same logits as a cold cache.
- Generator: a stream cancelled while its prefill runs (target, then draft catch-up) ends "cancelled",
  its slot keeps the earlier turn's committed tokens only (and the whole chunks a long prefill finished
  before the cut), and the next request reuses just those and replies as a cold request does.
- Server: a client that leaves while its streamed request's prefill runs (the run is held until the server
  has cancelled the job) stops that forward; no later reply is lost, and each equals a cold request's.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.request

import numpy as np
import pytest

from exactness import assert_agrees, exact_holds
from specedge.engines.base import EngineOptions, Interrupt
from specedge.errors import ForwardCancelled
from specedge.runtime.slots import common_prefix

SYSTEM = list(range(30, 90))  # a 60-token "system prompt"
TURN_1 = list(range(100, 108))
TURN_2 = list(range(110, 140))


def _cancel_inside(monkeypatch, engine, cancel, *, when=lambda calls: True) -> list[BaseException]:
    """Wrap ``engine``'s session runs: when ``when(call_number)`` holds, ``cancel()`` runs inside the
    run (the stop is registered, the real run has not begun) and then the real run is called. Returns
    the list the real run's exceptions are recorded in (ORT's own terminate error)."""
    session, raised, calls = engine.session, [], [0]

    def wrap(real):
        def run(*args):
            calls[0] += 1
            if when(calls[0]):
                cancel()
            try:
                return real(*args)
            except Exception as exc:
                raised.append(exc)
                raise
        return run

    monkeypatch.setattr(session, "run_with_iobinding", wrap(session.run_with_iobinding))
    monkeypatch.setattr(session, "run", wrap(session.run))
    return raised


@pytest.mark.parametrize("io_binding", [True, False], ids=["io-binding", "plain-run"])
def test_a_stopped_forward_raises_keeps_length_and_the_next_run_is_sound(io_binding, llama_bundle, monkeypatch):
    from specedge.runtime.generator import Generator

    gen = Generator.from_bundle(llama_bundle, threads=1, engine_options=EngineOptions(use_io_binding=io_binding))
    engine = gen.target.inner
    kv = engine.new_cache()
    engine.forward(np.asarray(SYSTEM, np.int64), kv)
    interrupt = Interrupt()
    raised = _cancel_inside(monkeypatch, engine, interrupt.set)
    engine.interrupt = interrupt
    with pytest.raises(ForwardCancelled):
        engine.forward(np.asarray(TURN_2, np.int64), kv)
    assert len(raised) == 1 and "terminate flag" in str(raised[0])  # ORT itself stopped the run
    assert kv.length == len(SYSTEM)
    with pytest.raises(ForwardCancelled):  # once set, a forward does not even start
        engine.forward(np.asarray(TURN_2, np.int64), kv)
    assert len(raised) == 1 and kv.length == len(SYSTEM)
    monkeypatch.undo()
    engine.interrupt = Interrupt()  # the next generation's: its run gets a fresh RunOptions
    warm = engine.forward(np.asarray(TURN_2, np.int64), kv).copy()
    engine.interrupt = None
    cold_kv = engine.new_cache()
    cold = engine.forward(np.asarray(SYSTEM + TURN_2, np.int64), cold_kv)
    assert kv.length == cold_kv.length == len(SYSTEM) + len(TURN_2)
    assert int(np.argmax(warm)) == int(np.argmax(cold))
    np.testing.assert_allclose(warm, cold, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["target-prefill", "draft-catch-up", "verify"])
def test_a_cancel_midway_keeps_only_committed_tokens_and_the_next_reply_is_a_cold_one(which, self_spec_bundle,
                                                                                      monkeypatch):
    from specedge.runtime.generator import Generator

    gen = Generator.from_bundle(self_spec_bundle, threads=1, cache_slots=2)
    exact = exact_holds(gen)
    options = dict(max_new_tokens=10, drafter="model", draft_tokens=3, adaptive=False, exact=exact,
                   reply_memory=False)
    first = gen.generate(input_ids=SYSTEM + TURN_1, **options)
    held = first.prompt_ids + first.token_ids
    slot = next(s for s in gen.slots.slots if s.tokens)
    held = held[:len(slot.tokens)]  # the last committed token's K/V is written by the next forward
    prompt = held + TURN_2
    stream = gen.stream(input_ids=prompt, **options)
    # The self-speculative bundle loads the target and the draft as two sessions of one graph.
    engine = {"target-prefill": gen.target.inner, "verify": gen.target.inner}.get(which, gen.draft)
    # target-prefill: the request's first run (its prompt's new tokens); draft-catch-up: the draft's first run
    # (it feeds the whole new history); verify: the target's second run (the first verify of k + 1 rows).
    when = (lambda n: n == 2) if which == "verify" else (lambda n: n == 1)
    raised = _cancel_inside(monkeypatch, engine, stream.cancel, when=when)
    deltas = list(stream)
    assert stream.result.finish_reason == "cancelled"
    assert raised and "terminate flag" in str(raised[0])
    committed = stream.result.token_ids
    assert len(committed) == (0 if which == "target-prefill" else 1)  # cut before (or right after) the first token
    monkeypatch.undo()
    # The slot claims no position whose K/V was not written: only the earlier turn when the prefill was cut.
    assert len(slot.tokens) == slot.target_kv.length
    assert slot.tokens == (held if which == "target-prefill" else (prompt + committed)[:len(slot.tokens)])
    assert len(slot.draft_prefix.tokens) <= slot.draft_kv.length
    assert "".join(deltas) == stream.result.text
    kept = list(slot.tokens)
    final = gen.generate(input_ids=prompt, **options)
    assert final.stats.reused_tokens == min(common_prefix(kept, prompt), len(prompt) - 1) >= len(held)
    cold = Generator.from_bundle(self_spec_bundle, threads=1).generate(input_ids=prompt, reuse_prefix=False,
                                                                        **options)
    assert_agrees(gen, prompt, cold.token_ids, final.token_ids, exact=exact)
    if exact:
        assert final.token_ids == cold.token_ids


def test_a_prefill_cut_inside_a_later_chunk_keeps_the_chunks_before_it(self_spec_bundle, monkeypatch):
    """A long cold prompt is prefilled in chunks (runtime/loop.py PREFILL_CHUNK); a cancel inside the
    third chunk's forward leaves the slot holding the first two, and the next request with that prompt
    reuses exactly those and replies as a cold request does."""
    from specedge.runtime import loop
    from specedge.runtime.generator import Generator

    monkeypatch.setattr(loop, "PREFILL_CHUNK", 16)
    gen = Generator.from_bundle(self_spec_bundle, threads=1, cache_slots=2)
    exact = exact_holds(gen)
    options = dict(max_new_tokens=10, drafter="model", draft_tokens=3, adaptive=False, exact=exact,
                   reply_memory=False)
    prompt = SYSTEM + TURN_2  # 90 tokens: chunks of 16 x 5 and 10
    stream = gen.stream(input_ids=prompt, **options)
    with monkeypatch.context() as patch:
        raised = _cancel_inside(patch, gen.target.inner, stream.cancel, when=lambda n: n == 3)
        list(stream)
    assert stream.result.finish_reason == "cancelled" and stream.result.token_ids == []
    assert len(raised) == 1 and "terminate flag" in str(raised[0])
    slot = next(s for s in gen.slots.slots if s.tokens)
    assert slot.tokens == prompt[:32] and slot.target_kv.length == 32
    final = gen.generate(input_ids=prompt, **options)
    assert final.stats.reused_tokens == 32
    cold = Generator.from_bundle(self_spec_bundle, threads=1).generate(input_ids=prompt, reuse_prefix=False,
                                                                        **options)
    assert_agrees(gen, prompt, cold.token_ids, final.token_ids, exact=exact)
    if exact:
        assert final.token_ids == cold.token_ids


def _completions(port: int, prompt: list[int], exact: bool, *,
                 leave_when: threading.Event | None = None) -> bytes | dict:
    """POST /v1/completions with token ids. With ``leave_when``: streamed, and the client closes the
    connection once the response has started and ``leave_when`` is set (it leaves while its request
    runs); returns the head. Else the JSON reply."""
    stream = leave_when is not None
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream,
                       "specedge": {"exact": exact}}).encode()
    if not stream:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=60).read())
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(4096)
            if not data:
                break
            head += data
        assert leave_when.wait(timeout=30), "the request's forward never started"  # a failure guard only
    return head


def _reporting_spec(app, version: str):
    """``app`` behind a server that reports ASGI ``spec_version`` ``version`` (uvicorn reports 2.3)."""
    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = dict(scope, asgi=dict(scope.get("asgi", {}), spec_version=version))
        await app(scope, receive, send)
    return wrapped


# Starlette listens for a streaming client's disconnect itself below ASGI 2.4 only (server/app.py _EventStream)
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_the_server_loses_no_reply_when_clients_leave_mid_prefill(llama_bundle, monkeypatch, spec_version):
    """Streamed requests whose clients leave while their prefill runs never cost a later request its
    reply: each disconnect stops the forward in progress (ORT's terminate), every later request
    answers its cold reply, and no job fails, whichever ASGI spec the server reports.

    No timing is involved: each cut request's prefill is held inside its session run until the server
    has cancelled the job (its client left only once that run had begun), so the stop is registered
    before the real run starts, on any machine. A cancelled generation starts no other run, so the
    first ``len(prompts)`` session runs are the cut requests' prefills, in order.
    """
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from specedge.bench.preemptive import LocalServer
    from specedge.runtime.generator import Generator

    config = uvicorn.Config
    monkeypatch.setattr(uvicorn, "Config", lambda app, **options: config(_reporting_spec(app, spec_version),
                                                                           **options))

    gen = Generator.from_bundle(llama_bundle, threads=1, cache_slots=2)
    exact = exact_holds(gen)
    prompts = [SYSTEM + TURN_1 + TURN_2[:n] for n in (4, 12, 20, 30)]
    running = [threading.Event() for _ in prompts]  # cut request i's prefill is inside its session run
    cancelled = [threading.Event() for _ in prompts]  # the server has cancelled cut request i's job
    cuts = iter(range(len(prompts)))

    def hold() -> None:
        """Inside cut request i's prefill run: let its client leave, wait for the server's cancel."""
        i = next(cuts)
        running[i].set()
        cancelled[i].wait(timeout=30)  # a failure guard: unset, the run completes and the asserts below fail

    raised = _cancel_inside(monkeypatch, gen.target.inner, hold, when=lambda n: n <= len(prompts))
    server = LocalServer(gen)
    real_cancel = server.worker.cancel

    def cancel(job) -> None:
        """The handler's cancel when its client left: once it returns, the job's Interrupt has set the
        held run's terminate flag. (A reply's handler cancels its finished job too: a no-op.)"""
        real_cancel(job)
        cancelled[prompts.index(job.prompt_ids)].set()

    monkeypatch.setattr(server.worker, "cancel", cancel)
    try:
        for prompt, started in zip(prompts, running):
            assert _completions(server.port, prompt, exact, leave_when=started).startswith(b"HTTP/1.1 200")
        replies = [_completions(server.port, prompt, exact) for prompt in prompts]
    finally:
        server.close()  # joins the worker (the lifespan's stop): every job below is counted
    assert not server.thread.is_alive(), "the server did not stop"
    assert len(raised) == len(prompts) and all("terminate flag" in str(exc) for exc in raised)  # ORT stopped each
    jobs = list(server.worker.finished)
    assert [job.prompt_ids for job in jobs] == prompts + prompts
    assert [job.outcome for job in jobs] == ["cancelled"] * len(prompts) + ["completed"] * len(prompts)
    for job in jobs[:len(prompts)]:  # cut inside the prefill: no token committed
        assert job.result.finish_reason == "cancelled" and job.result.token_ids == []
    status = server.worker.status()
    assert (status["completed"], status["cancelled"], status["failed"]) == (len(prompts), len(prompts), 0)
    cold = Generator.from_bundle(llama_bundle, threads=1)
    for prompt, reply in zip(prompts, replies):
        want = cold.generate(input_ids=prompt, max_new_tokens=12, reuse_prefix=False, exact=exact)
        choice, tokens = reply["choices"][0], reply["usage"]["completion_tokens"]
        assert choice["finish_reason"] in ("stop", "length") and tokens > 0
        if exact:  # fast mode may differ from a cold start at a near tie (tests/exactness.py); exact may not
            assert (choice["text"], tokens) == (want.text, len(want.token_ids))
