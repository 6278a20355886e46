"""The OpenAI-compatible server (specedge.server) behind a real uvicorn on 127.0.0.1.

Invariants guarded here:

* what a client gets through the server (chat or completions, streamed or not) is
  exactly what ``Generator.generate`` returns for the same request: same text, same
  token counts, same finish reason (both sides in exact mode, ``"specedge": {"exact": true}``,
  whose replies do not depend on slots or k);
* concurrent clients are all served, none lost, each output equal to its serial run;
* a client that leaves mid-stream (or while waiting) frees the worker or its queue
  slot, and the next request is served;
* every client mistake is answered in OpenAI's error format with a 4xx status
  (400 parameters/JSON, 401 key, 404 model/route, 413 body, 429 queue full), never a 500.

The bundle is a tiny random Llama (word-level tokenizer "t0".."t299", a chat
template) exported in the module fixture, so no weights are downloaded.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest

for _module in ("starlette", "uvicorn", "openai", "httpx", "torch", "transformers"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402
from live_server import LoopbackServer  # noqa: E402

from specedge.runtime.generator import Generator  # noqa: E402
from specedge.server.app import create_app  # noqa: E402

API_KEY = "sk-test-key"
MODEL = "tiny"
# Role markers are vocabulary words, so the rendered prompt encodes to known ids.
CHAT_TEMPLATE = ("{% for m in messages %}{{ {'system': 't3', 'user': 't4', 'assistant': 't5'}[m['role']] }} "
                 "{{ m['content'] }} t6 {% endfor %}{% if add_generation_prompt %}t5 {% endif %}")
SLOW_STEP_S = 0.02  # per target forward in the slowed tests: 300 plain tokens take >= 6 s
LONG_TOKENS = 300


# ----------------------------------------------------------------------------- fixtures
def _build_bundle(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from specedge.export.bundle import ExportConfig, export_bundle

    torch.manual_seed(0)
    src = folder / "src"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 eos_token_id=1, bos_token_id=0)).save_pretrained(src)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t0", unk_token="t2")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(src)
    out = folder / "bundle"
    export_bundle(ExportConfig(target=str(src), out=out, draft="self-int4", max_context=512, quiet=True))
    return out


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> Generator:
    return Generator.from_bundle(_build_bundle(tmp_path_factory.mktemp("server")))


class Served(LoopbackServer):
    """A plain uvicorn server for ``app`` (tests/live_server.py)."""

    JOIN_S = 15.0

    def __init__(self, app) -> None:
        super().__init__(uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                       timeout_graceful_shutdown=2)))

    def client(self, key: str | None = API_KEY, **kw) -> openai.OpenAI:
        # max_retries=0: a 429 or 5xx must reach the test, not be retried away.
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, **kw)

    def post(self, path: str, body, key: str | None = API_KEY, timeout: float = 30) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers=headers, timeout=timeout)

    def health(self, key: str | None = API_KEY) -> dict:
        """GET /health; the cache slots' details come only with a valid key."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + "/health", headers=headers, timeout=10).json()

    def wait_for(self, predicate, timeout: float = 5.0) -> dict:
        return super().wait_for(predicate, timeout)


@pytest.fixture(scope="module")
def served(gen):
    warmups = []
    original = gen.warmup
    gen.warmup = lambda: (warmups.append(1), original())[1]
    srv = Served(create_app(gen, api_key=API_KEY, queue_size=32, max_body_bytes=64 * 1024, model_name=MODEL))
    del gen.warmup
    srv.warmups = warmups
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def long_messages(gen) -> list[dict]:
    """A chat whose greedy reply runs to LONG_TOKENS without EOS: the slowed tests rely on it."""
    messages = _chat("t90 t91")
    assert gen.generate(messages=messages, max_new_tokens=LONG_TOKENS, temperature=0).finish_reason == "length"
    return messages


@contextlib.contextmanager
def slowed(gen: Generator, delay: float = SLOW_STEP_S):
    """Make every target forward sleep first: a long generation that holds the worker, same tokens.
    The bare engine is patched: fast mode (the default) runs it directly, exact mode through its wrapper."""
    forward = gen.target.inner.forward

    def slow(*args, **kwargs):
        time.sleep(delay)
        return forward(*args, **kwargs)

    gen.target.inner.forward = slow
    try:
        yield
    finally:
        del gen.target.inner.forward  # back to the class's method


def _chat(content: str) -> list[dict]:
    return [{"role": "system", "content": "t7 t8"}, {"role": "user", "content": content}]


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


def _error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


# ----------------------------------------------------------------------------- equality with generate()
def test_startup_ran_warmup_and_health_and_models(served):
    assert served.warmups == [1]
    health = served.health(key=None)  # no key needed: load balancers probe it
    assert health["status"] == "ok" and health["model"] == MODEL and health["busy"] is False
    assert "cache" not in health and "cache" in served.health()  # what the slots hold: for a key only
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client().models.retrieve(MODEL).id == MODEL


def test_chat_non_streaming_equals_generate(served, gen):
    messages = _chat("t10 t11 t12")
    want = gen.generate(messages=messages, max_new_tokens=40, temperature=0, exact=True)
    got = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                  extra_body={"specedge": {"exact": True}})
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_ids), len(want.token_ids))
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    spec = got.model_extra["specedge"]
    assert spec["drafter"] == "auto" and 0 <= spec["accepted"] <= spec["drafted"]
    assert {"acceptance", "mean_accepted_length", "k_chosen", "tokens_per_s", "time_to_first_token_s"} <= set(spec)


def test_chat_streaming_equals_generate(served, gen):
    messages = _chat("t20 t21")
    want = gen.generate(messages=messages, max_new_tokens=50, temperature=0, exact=True)
    stream = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=50, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"specedge": {"exact": True}})
    text, chunks = _stream_text(stream)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert finishing[0].model_extra["specedge"]["drafter"] == "auto"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_ids)


def test_stream_ends_with_done_and_usage_only_when_asked(served):
    body = {"messages": _chat("t30"), "max_tokens": 8, "temperature": 0, "stream": True}
    response = served.post("/v1/chat/completions", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(e.removeprefix("data: ")) for e in events[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_generate(served, gen, stream):
    prompt = "t40 t41 t42 t43"
    want = gen.generate(prompt, chat=False, max_new_tokens=30, temperature=0, exact=True)
    client = served.client()
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=stream,
                                    extra_body={"specedge": {"exact": True}})
    if stream:
        text, chunks = _stream_text(got)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        text = got.choices[0].text
        assert got.usage.completion_tokens == len(want.token_ids) == 30
    assert text == want.text


def test_completions_default_to_16_tokens_and_accept_token_ids(served, gen):
    ids = [50, 51, 52]
    want = gen.generate(input_ids=ids, max_new_tokens=16, temperature=0, exact=True)
    got = served.client().completions.create(model=MODEL, prompt=ids, temperature=0, extra_body={"specedge": {"exact": True}})
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 16


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_equal_generate(served, gen, stream):
    messages = _chat("t10 t11 t12")
    full = gen.generate(messages=messages, max_new_tokens=40, temperature=0, exact=True).text.split()
    stop = full[len(full) // 2]  # a word from the middle of the reply
    want = gen.generate(messages=messages, max_new_tokens=40, temperature=0, stop=(stop, "t299 t299"), exact=True)
    assert want.finish_reason == "stop"
    got = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                  stop=[stop, "t299 t299"], stream=stream, extra_body={"specedge": {"exact": True}})
    if stream:
        text, chunks = _stream_text(got)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reason == ["stop"]
    else:
        text = got.choices[0].message.content
        assert got.choices[0].finish_reason == "stop"
    assert text == want.text and stop not in text


def test_seeded_sampling_equals_generate(served, gen):
    # A fixed k: adaptive k follows measured step times, and the random stream with it; no reply memory:
    # the default drafts from earlier replies too, and a seed holds for the same proposals.
    messages = _chat("t60 t61")
    want = gen.generate(messages=messages, max_new_tokens=30, temperature=0.9, top_p=0.95, seed=7, draft_tokens=3,
                        reply_memory=False, exact=True)
    got = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0.9,
                                                  top_p=0.95, seed=7, extra_body={"specedge": {
                                                      "draft_tokens": 3, "reply_memory": False, "exact": True}})
    assert got.choices[0].message.content == want.text
    # The call's k on every step but the last, which drafts fewer (maybe 0) when max_tokens leaves less room.
    k_chosen = got.model_extra["specedge"]["k_chosen"]
    assert k_chosen.get("3", 0) >= 1 and sum(n for k, n in k_chosen.items() if k != "3") <= 1, k_chosen


def test_latency_cap_and_draft_window_per_request(served, gen):
    messages = _chat("t90 t91")
    want = gen.generate(messages=messages, max_new_tokens=30, temperature=0, exact=True)
    got = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0,
        extra_body={"specedge": {"max_latency_s": 0.5, "draft_window": 8, "draft_tokens": 4, "exact": True}})
    assert got.choices[0].message.content == want.text
    assert got.model_extra["specedge"]["catchup_tokens"] <= 8


def test_speculation_off_per_request(served, gen):
    messages = _chat("t70 t71")
    want = gen.generate(messages=messages, max_new_tokens=30, temperature=0, exact=True)
    got = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                  extra_body={"specedge": {"speculation": False, "exact": True}})
    assert got.choices[0].message.content == want.text
    assert got.model_extra["specedge"]["drafter"] == "none" and got.model_extra["specedge"]["drafted"] == 0


def test_server_wide_no_speculation(gen):
    srv = Served(create_app(gen, speculation=False, warmup=False))
    try:
        messages = _chat("t80")
        want = gen.generate(messages=messages, max_new_tokens=20, temperature=0, exact=True)
        got = srv.client().chat.completions.create(model=gen.bundle.name, messages=messages, max_tokens=20,
                                                   temperature=0, extra_body={"specedge": {"exact": True}})
        assert got.choices[0].message.content == want.text
        assert got.model_extra["specedge"]["drafter"] == "none"
        response = srv.post("/v1/chat/completions", {"messages": messages, "specedge": {"speculation": True}})
        _error(response, 400, "specedge.speculation")
    finally:
        srv.close()


def test_serving_lowers_the_switch_interval_and_the_last_app_to_stop_restores_it(served):
    """A streamed delta waits for the GIL at each hand-off to the event loop for up to the switch
    interval (server/app.py HANDOFF_SWITCH_INTERVAL_S); a process that serves gets the short one, and
    gets its own back once no app serves (two apps here, as the preemptive bench runs three)."""
    import sys

    from specedge.server.app import HANDOFF_SWITCH_INTERVAL_S, _SwitchInterval

    assert sys.getswitchinterval() <= HANDOFF_SWITCH_INTERVAL_S + 1e-9  # ``served`` is serving
    saved = sys.getswitchinterval()
    counter = _SwitchInterval()
    try:
        sys.setswitchinterval(0.004)
        counter.enter()
        counter.enter()
        assert sys.getswitchinterval() <= HANDOFF_SWITCH_INTERVAL_S + 1e-9
        counter.exit()
        assert sys.getswitchinterval() <= HANDOFF_SWITCH_INTERVAL_S + 1e-9  # one app still serves
        counter.exit()
        assert abs(sys.getswitchinterval() - 0.004) < 2e-6  # kept in whole microseconds
        sys.setswitchinterval(0.0001)  # a caller's shorter interval is kept, not raised
        counter.enter()
        assert abs(sys.getswitchinterval() - 0.0001) < 2e-6
        counter.exit()
    finally:
        sys.setswitchinterval(saved)


# ----------------------------------------------------------------------------- concurrency
def test_sixteen_concurrent_clients_all_served_equal_to_serial(served, gen):
    prompts = [f"t{100 + i} t{150 + i}" for i in range(16)]
    serial = [gen.generate(messages=_chat(p), max_new_tokens=24, temperature=0, exact=True).text for p in prompts]
    before = served.health()["completed"]
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def client(i: int) -> None:
        try:
            c = served.client(timeout=60)
            barrier.wait()
            kw = dict(model=MODEL, messages=_chat(prompts[i]), max_tokens=24, temperature=0, extra_body={"specedge": {"exact": True}})
            if i % 2:
                results[i] = _stream_text(c.chat.completions.create(stream=True, **kw))[0]
            else:
                results[i] = c.chat.completions.create(**kw).choices[0].message.content
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    elapsed = time.monotonic() - t0
    assert not errors, errors
    assert sorted(results) == list(range(16)), "a request was lost"
    assert [results[i] for i in range(16)] == serial
    assert elapsed < 60, f"16 clients took {elapsed:.1f} s"
    state = served.health()
    assert state["completed"] - before == 16 and state["waiting"] == 0 and not state["busy"]


# ----------------------------------------------------------------------------- disconnects
def test_disconnect_mid_stream_frees_the_worker(served, gen, long_messages):
    before = served.health()["cancelled"]
    body = {"model": MODEL, "messages": long_messages, "max_tokens": LONG_TOKENS, "temperature": 0,
            "stream": True, "specedge": {"speculation": False}}
    with slowed(gen):
        with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content":"t' in line:
                    break  # one real delta: the generation is running
        t_closed = time.monotonic()
        state = served.wait_for(lambda s: not s["busy"], timeout=3)  # the whole run would take >= 6 s
        assert state["cancelled"] == before + 1
        assert time.monotonic() - t_closed < 3
    messages = _chat("t92")
    want = gen.generate(messages=messages, max_new_tokens=10, temperature=0, exact=True)
    got = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                  extra_body={"specedge": {"exact": True}})
    assert got.choices[0].message.content == want.text


def test_disconnect_while_waiting_non_streaming_frees_the_worker(served, gen, long_messages):
    before = served.health()["cancelled"]
    body = {"model": MODEL, "messages": long_messages, "max_tokens": LONG_TOKENS, "temperature": 0,
            "specedge": {"speculation": False}}
    with slowed(gen):
        with pytest.raises(httpx.ReadTimeout):
            served.post("/v1/chat/completions", body, timeout=0.5)  # the client gives up and closes
        state = served.wait_for(lambda s: not s["busy"], timeout=3)
        assert state["cancelled"] == before + 1


# ----------------------------------------------------------------------------- queue full
def test_queue_full_is_429_and_a_waiting_client_that_leaves_frees_its_slot(gen, long_messages):
    srv = Served(create_app(gen, queue_size=1, warmup=False, model_name=MODEL))
    long_body = {"messages": long_messages, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True,
                 "specedge": {"speculation": False}}
    try:
        with slowed(gen), httpx.Client(timeout=30) as http:
            with http.stream("POST", srv.url + "/v1/chat/completions", json=long_body) as running:
                running_lines = running.iter_lines()  # kept: a dropped iterator closes the connection
                next(running_lines)  # headers + role chunk: admitted
                srv.wait_for(lambda s: s["busy"])
                # A second client waits in the one slot, then leaves: the slot frees at once.
                with http.stream("POST", srv.url + "/v1/chat/completions", json=long_body) as waiting:
                    waiting_lines = waiting.iter_lines()
                    next(waiting_lines)
                    srv.wait_for(lambda s: s["waiting"] == 1)
                    refused = srv.post("/v1/chat/completions", {"messages": _chat("t95"), "max_tokens": 4})
                    error = _error(refused, 429)
                    assert error["type"] == "rate_limit_error" and refused.headers["retry-after"]
                srv.wait_for(lambda s: s["waiting"] == 0)
                # The slot is free again: this one waits behind the running one and is served
                # once that one's client leaves.
                done: list = []
                waiter = threading.Thread(target=lambda: done.append(srv.post(
                    "/v1/chat/completions", {"messages": _chat("t95"), "max_tokens": 4, "temperature": 0,
                                             "specedge": {"exact": True}})))
                waiter.start()
                srv.wait_for(lambda s: s["waiting"] == 1)
            waiter.join(30)
        assert done and done[0].status_code == 200, done
        want = gen.generate(messages=_chat("t95"), max_new_tokens=4, temperature=0, exact=True)
        assert done[0].json()["choices"][0]["message"]["content"] == want.text
        state = srv.health()
        assert state["rejected"] == 1 and state["cancelled"] == 2 and state["completed"] == 1
    finally:
        srv.close()


def test_requests_are_served_first_come_first_served(gen, long_messages):
    """Queued requests reach the Generator in arrival order. The order is recorded where the worker
    starts each generation (server side), not where clients receive replies: client threads may
    record their finish in either order when two short replies arrive close together."""
    srv = Served(create_app(gen, queue_size=4, warmup=False, model_name=MODEL))
    started: list[tuple[int, ...]] = []
    statuses: list[int] = []
    stream = gen.stream

    def recording_stream(*args, **kwargs):
        started.append(tuple(kwargs["input_ids"]))
        return stream(*args, **kwargs)

    gen.stream = recording_stream
    try:
        with slowed(gen), httpx.Client(timeout=30) as http:
            body = {"messages": long_messages, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True,
                    "specedge": {"speculation": False}}
            with http.stream("POST", srv.url + "/v1/chat/completions", json=body) as running:
                lines = running.iter_lines()
                next(lines)
                srv.wait_for(lambda s: s["busy"])
                waiters = []
                for i in range(3):  # queued one after another, while the worker is held
                    def post(i=i):
                        r = srv.post("/v1/chat/completions", {"messages": _chat(f"t{200 + i}"), "max_tokens": 3})
                        statuses.append(r.status_code)
                    waiters.append(threading.Thread(target=post))
                    waiters[-1].start()
                    srv.wait_for(lambda s, n=i + 1: s["waiting"] == n)
            for t in waiters:
                t.join(30)
        assert statuses == [200, 200, 200]
        queued = [tuple(gen.encode_prompt(messages=_chat(f"t{200 + i}"))) for i in range(3)]
        assert started[1:] == queued  # after the long request, in the order they arrived
    finally:
        del gen.stream  # back to the class's method
        srv.close()


def test_a_failing_generation_is_a_500_in_openai_format_and_the_worker_lives_on(served, gen):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    gen.target.inner.forward = broken  # the bare engine: both modes run it
    try:
        response = served.post("/v1/chat/completions", {"messages": _chat("t10"), "max_tokens": 4})
        error = _error(response, 500)
        assert error["type"] == "server_error"
        with pytest.raises(openai.APIError):
            _stream_text(served.client().chat.completions.create(model=MODEL, messages=_chat("t10"),
                                                                 max_tokens=4, stream=True))
    finally:
        del gen.target.inner.forward
    want = gen.generate(messages=_chat("t10"), max_new_tokens=4, temperature=0, exact=True)
    got = served.client().chat.completions.create(model=MODEL, messages=_chat("t10"), max_tokens=4, temperature=0,
                                                  extra_body={"specedge": {"exact": True}})
    assert got.choices[0].message.content == want.text


# ----------------------------------------------------------------------------- client mistakes
@pytest.mark.parametrize("change, param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"user": 5}, "user"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"specedge": {"k": 3}}, "specedge.k"),
    ({"specedge": {"drafter": "magic"}}, "specedge.drafter"),
    ({"specedge": {"draft_tokens": -1}}, "specedge.draft_tokens"),
    ({"specedge": {"max_latency_s": 0}}, "specedge.max_latency_s"),
    ({"specedge": {"max_latency_s": "fast"}}, "specedge.max_latency_s"),
    ({"specedge": {"draft_window": 3}}, "specedge.draft_window"),  # the option's bound: > 4 (0 = None)
    ({"specedge": {"speculation": "no"}}, "specedge.speculation"),
    ({"stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "caf\udce9"}]}, "messages"),  # a lone surrogate: 400, not 500
    ({"seed": 2 ** 70}, "seed"),
    ({"specedge": {"draft_window": 1.5}}, "specedge.draft_window"),
])
def test_bad_chat_parameters_are_400(served, change, param):
    body = {"model": MODEL, "messages": _chat("t10"), "max_tokens": 4} | change
    body = {k: v for k, v in body.items() if v is not None}
    error = _error(served.post("/v1/chat/completions", body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_parameters_are_accepted(served, gen):
    # What voice frameworks send by default must not fail.
    body = {"model": MODEL, "messages": _chat("t10"), "max_tokens": 4, "temperature": 0, "frequency_penalty": 0,
            "presence_penalty": 0.0, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
            "logprobs": False, "user": "caller-1", "n": 1, "top_logprobs": None, "service_tier": "auto",
            "metadata": {"call": "42"}, "safety_identifier": "caller-1", "specedge": {"exact": True}}
    response = served.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    want = gen.generate(messages=_chat("t10"), max_new_tokens=4, temperature=0, exact=True)
    assert response.json()["choices"][0]["message"]["content"] == want.text


def test_bad_completions_parameters_are_400(served):
    _error(served.post("/v1/completions", {"model": MODEL}), 400, "prompt")
    _error(served.post("/v1/completions", {"prompt": ["t1", "t2"]}), 400, "prompt")
    _error(served.post("/v1/completions", {"prompt": "t10", "echo": True}), 400, "echo")
    _error(served.post("/v1/completions", {"prompt": "t10", "messages": []}), 400, "messages")


def test_openai_client_raises_bad_request(served):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client().chat.completions.create(model=MODEL, messages=_chat("t10"), temperature=-1)


def test_context_overflow_is_400(served):
    error = _error(served.post("/v1/chat/completions", {"messages": _chat("t9 " * 600)}), 400, "messages")
    assert error["code"] == "context_length_exceeded" and "max_context" in error["message"]


def test_unknown_model_is_404(served):
    error = _error(served.post("/v1/chat/completions", {"model": "gpt-4o", "messages": _chat("t10")}), 404, "model")
    assert error["code"] == "model_not_found"


def test_malformed_json_is_400(served):
    error = _error(served.post("/v1/chat/completions", b'{"messages": [}'), 400)
    assert error["code"] == "invalid_json"
    _error(served.post("/v1/chat/completions", b"[1, 2]"), 400)
    _error(served.post("/v1/chat/completions", b"\xff\xfe"), 400)
    _error(served.post("/v1/chat/completions", b"[" * 50000), 400)


def test_oversize_body_is_413(served):
    big = {"messages": _chat("t10 " * 30000)}  # ~120 KB > the 64 KiB limit
    _error(served.post("/v1/chat/completions", big), 413)

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"messages": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(served.url + "/v1/chat/completions", content=chunked(), timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    _error(response, 413)


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_missing_or_wrong_api_key_is_401(served, key):
    error = _error(served.post("/v1/chat/completions", {"messages": _chat("t10")}, key=key), 401)
    assert error["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        served.client(key=key).models.list()


def test_unknown_route_and_wrong_method_answer_openai_errors(served):
    _error(httpx.get(served.url + "/v1/nothing", timeout=10), 404)
    _error(httpx.get(served.url + "/v1/chat/completions", timeout=10), 405)


# ----------------------------------------------------------------------------- the command line
def test_serve_command_passes_its_options_to_the_app(gen, monkeypatch):
    from click.testing import CliRunner

    from specedge.cli.main import main

    from specedge.server import serving

    ran = {}
    monkeypatch.setattr(serving.SpecedgeServer, "run", lambda self, sockets=None: ran.update(
        app=self.config.app, host=self.config.host, port=self.config.port, grace=self.grace_s, config=self.config))
    result = CliRunner().invoke(main, ["serve", str(gen.bundle), "--port", "8123", "--api-key", "k1",
                                       "--queue-size", "3", "--max-body-bytes", "999", "--model-name", "m",
                                       "--no-speculation", "--no-warmup", "--shutdown-grace", "7"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (ran["host"], ran["port"]) == ("127.0.0.1", 8123)  # loopback unless told otherwise
    # uvicorn waits for connections longer than the app's grace, so a cut reply still gets its last chunks
    assert ran["grace"] == 7.0 and ran["config"].timeout_graceful_shutdown > 7
    assert ran["config"].limit_concurrency == serving.MAX_CONNECTIONS
    server = ran["app"].state.server
    assert (server.api_keys, server.worker.queue_size, server.max_body_bytes, server.model_name) == (("k1",), 3, 999,
                                                                                                      "m")
    assert server.cache_sharing == "key"  # the default: clients with different keys or salts share nothing
    assert server.max_tokens == 256  # the default reply cap for requests without max_tokens (Pipecat, LiveKit)
    ran.clear()
    result = CliRunner().invoke(main, ["serve", str(gen.bundle), "--no-warmup", "--max-tokens", "0"],
                                catch_exceptions=False)
    assert result.exit_code == 0 and ran["app"].state.server.max_tokens is None  # 0: the context's end
    assert "--max-tokens" in CliRunner().invoke(main, ["serve", "--help"]).output
    assert server.speculation is False and server.generator.draft is None  # the baseline loads no draft


def test_serve_command_reports_a_missing_bundle_in_one_line(tmp_path):
    from click.testing import CliRunner

    from specedge.cli.main import main

    result = CliRunner().invoke(main, ["serve", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output


# ----------------------------------------------------------------------------- conversation caches
def test_prefill_ahead_then_the_request_reuses_it(served, gen):
    """POST /v1/specedge/prefill fills a slot (202 at once); the request then prefills only its tail."""
    messages = _chat("t40 t41 t42 t43")
    before = served.health()["completed"]
    response = served.post("/v1/specedge/prefill", {"model": MODEL, "messages": messages, "specedge": {"exact": True}})
    assert response.status_code == 202 and response.json()["status"] == "queued"
    state = served.wait_for(lambda s: s["completed"] > before and s["waiting_prefills"] == 0)
    assert state["cache"]["slots"] >= 1 and max(state["cache"]["held_tokens"]) > 0
    busiest = state["cache"]["per_slot"][0]  # most recently used first: the prefilled slot
    assert busiest["held_tokens"] > 0 and 0 < busiest["used_bytes"] < busiest["allocated_bytes"] == \
        state["cache"]["slot_bytes"]
    body = served.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4,
                                                "temperature": 0, "specedge": {"exact": True}}).json()
    assert body["specedge"]["reused_tokens"] == body["usage"]["prompt_tokens"] - 1
    cold = gen.generate(messages=messages, max_new_tokens=4, reuse_prefix=False, exact=True).text
    assert body["choices"][0]["message"]["content"] == cold


def test_prefill_needs_the_api_key(served):
    assert served.post("/v1/specedge/prefill", {"model": MODEL, "messages": _chat("t1")}, key=None).status_code == 401
