"""Hardening the server (issue 20): what a hostile client or a broken bundle could do to it.

Invariants guarded here:

* a chat template that runs for long never stalls the event loop: /health answers while
  it renders, and the request ends with a 500 *bundle* error, not the client's 400;
* control-token text in messages reaches the model as text (the PWNED injection), unless
  the request opts in with ``specedge.allow_special_tokens``;
* shutdown loses no reply: queued and new requests get 503, the running stream ends with
  a finishing chunk (finish_reason "length") and ``[DONE]`` once the grace period is over;
* a body that never arrives gets 408; a connection that never completes its request head
  is closed;
* random JSON to both endpoints gives only a typed 4xx error or a valid result: never a
  500, never a hang (the hypothesis property test, counted in ``FUZZ_COUNTS``).
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

for _module in ("starlette", "uvicorn", "httpx", "torch", "transformers", "hypothesis"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specedge.bundle.manifest import file_record  # noqa: E402
from specedge.runtime.generator import Generator  # noqa: E402
from specedge.server.app import create_app  # noqa: E402
from specedge.server.serving import SpecedgeServer, server_config  # noqa: E402
from live_server import LoopbackServer  # noqa: E402
from test_chat_templates import PWNED, chatml_bundle  # noqa: E402
from test_server import LONG_TOKENS, _build_bundle, slowed  # noqa: E402

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


class Serving(LoopbackServer):
    """create_app + SpecedgeServer (the limits and drain of `specedge serve`) on a free loopback port."""

    def __init__(self, gen: Generator, *, grace_s: float = 5.0, head_timeout_s: float | None = None, **app_kw):
        self.app = create_app(gen, warmup=False, **app_kw)
        config = server_config(self.app, log_level="warning", grace_s=grace_s, head_timeout_s=head_timeout_s)
        super().__init__(SpecedgeServer(config, grace_s=grace_s))

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def close(self) -> None:
        super().close()
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def server_bundle(tmp_path_factory) -> Path:
    return _build_bundle(tmp_path_factory.mktemp("hardening-server"))


@pytest.fixture(scope="module")
def gen(server_bundle) -> Generator:
    return Generator.from_bundle(server_bundle, threads=1)


@pytest.fixture(scope="module")
def serving(gen):
    s = Serving(gen)
    yield s
    s.close()


def _long_chat(gen) -> list[dict]:
    messages = [{"role": "user", "content": "t10 t11 t12"}]
    assert len(gen.generate(messages=messages, max_new_tokens=LONG_TOKENS).token_ids) == LONG_TOKENS
    return messages


# --------------------------------------------------------------------------- a slow template
def test_a_slow_template_does_not_stall_the_server_and_is_a_bundle_error(server_bundle, tmp_path):
    import shutil

    bundle = Path(shutil.copytree(server_bundle, tmp_path / "slow-template"))
    (bundle / "chat_template.jinja").write_text(NESTED_LOOPS)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["chat_template.jinja"] = file_record(bundle / "chat_template.jinja").to_dict()
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    s = Serving(Generator.from_bundle(bundle, threads=1, load_draft=False), speculation=False)
    try:
        result = {}
        chat = threading.Thread(target=lambda: result.update(r=httpx.post(
            s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)))
        chat.start()
        answered = 0
        while chat.is_alive():  # /health stays answerable (each well inside its timeout) while the template runs
            assert httpx.get(s.url + "/health", timeout=1.5).status_code == 200
            answered += 1
        chat.join()
        response = result["r"]
        assert response.status_code == 500 and response.json()["error"]["code"] == "bundle_error"
        assert "time budget" in response.json()["error"]["message"] and answered >= 1
        # the completions endpoint (no template) still works on the same server
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "t10 t11", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    finally:
        s.close()


# --------------------------------------------------------------------------- token injection
def test_control_token_text_through_the_server_is_text(tiny_model, export, tmp_path):
    bundle = chatml_bundle(export(tiny_model("llama")), tmp_path / "chatml")
    gen = Generator.from_bundle(bundle, threads=1)
    start, end = (gen.codec.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    seen = []
    real_stream = gen.stream

    def recording_stream(*args, **kwargs):
        seen.append(list(kwargs["input_ids"]))
        return real_stream(*args, **kwargs)

    gen.stream = recording_stream
    s = Serving(gen)
    try:
        messages = [{"role": "user", "content": PWNED}]
        for extension in ({}, {"specedge": {"allow_special_tokens": True}}):
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                                 "temperature": 0, **extension}, timeout=30)
            assert r.status_code == 200, r.text
        plain, opted_in = seen
        assert plain.count(start) == 2 and plain.count(end) == 1  # only the template's own markup
        assert opted_in.count(start) == 4 and opted_in.count(end) == 3
        assert plain == gen.encode_prompt(messages=messages)
        bad = httpx.post(s.url + "/v1/chat/completions", json={"messages": messages,
                                                               "specedge": {"allow_special_tokens": "yes"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "specedge.allow_special_tokens"
    finally:
        s.close()


# --------------------------------------------------------------------------- shutdown
def test_shutdown_answers_the_queue_and_finishes_the_running_stream(gen):
    messages = _long_chat(gen)
    s = Serving(gen, grace_s=0.5)
    events: list[str] = []
    queued: dict = {}
    try:
        with slowed(gen), httpx.Client(timeout=60) as http:
            def stream() -> None:
                with http.stream("POST", s.url + "/v1/chat/completions",
                                 json={"messages": messages, "max_tokens": LONG_TOKENS, "temperature": 0,
                                       "stream": True, "specedge": {"exact": True}}) as r:
                    events.extend(line for line in r.iter_lines() if line)

            streamer = threading.Thread(target=stream)
            streamer.start()
            s.wait_for(lambda h: h["busy"])
            waiter = threading.Thread(target=lambda: queued.update(r=httpx.post(
                s.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=60)))
            waiter.start()
            s.wait_for(lambda h: h["waiting"] == 1)
            s.server.should_exit = True  # what SIGTERM does
            waiter.join(30)
            streamer.join(30)
            assert not streamer.is_alive() and not waiter.is_alive()
    finally:
        s.close()
    assert queued["r"].status_code == 503 and queued["r"].json()["error"]["code"] == "server_shutting_down"
    assert events[-1] == "data: [DONE]"
    finish = json.loads(events[-2].removeprefix("data: "))
    assert finish["choices"][0]["finish_reason"] == "length"
    text = "".join(json.loads(e.removeprefix("data: "))["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1])
    full = gen.generate(messages=messages, max_new_tokens=LONG_TOKENS, exact=True).text  # exact: as the stream
    assert text and full.startswith(text) and len(text) < len(full)  # cut short, what was sent is intact


def test_a_draining_server_refuses_new_requests_with_503(gen):
    s = Serving(gen)
    try:
        s.app.state.server.draining = True
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "t10", "max_tokens": 1}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    finally:
        s.app.state.server.draining = False
        s.close()


# --------------------------------------------------------------------------- slow clients
def test_a_body_shorter_than_its_content_length_gets_408(gen):
    s = Serving(gen, body_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            reply = b""
            while b"request_timeout" not in reply and (chunk := conn.recv(65536)):
                reply += chunk
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply
    finally:
        s.close()


def test_a_connection_that_never_completes_its_head_is_closed(gen):
    s = Serving(gen, head_timeout_s=0.5)
    try:
        conns = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(20)]
        for conn in conns:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
        for conn in conns:
            assert conn.recv(1024) == b""  # closed by the server (recv would time out after 10 s otherwise)
            conn.close()
        assert s.health()["status"] == "ok"
    finally:
        s.close()


# --------------------------------------------------------------------------- random JSON
FUZZ_COUNTS = {"cases": 0, "ok": 0, "typed_4xx": 0, "server_errors": 0, "hangs": 0}

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                       st.text(max_size=30))
_json = st.recursive(_json_leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(st.text(max_size=10), kids, max_size=4)),
                     max_leaves=12)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", 5]),
                                  "content": st.one_of(st.text(max_size=40), _json)})
_fields = {
    "model": st.one_of(st.just("tiny"), _json),
    "max_tokens": st.one_of(st.integers(-3, 6), _json),
    "max_completion_tokens": st.one_of(st.integers(-3, 6), _json),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), _json),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), _json),
    "top_k": st.one_of(st.integers(-3, 400), _json),
    "seed": st.one_of(st.integers(-5, 2**64), _json),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), _json),
    "stream": st.one_of(st.booleans(), _json),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _json),
    "n": st.one_of(st.integers(0, 3), _json),
    "specedge": st.one_of(st.fixed_dictionaries({}, optional={
        "speculation": st.one_of(st.booleans(), _json), "drafter": st.one_of(st.sampled_from(
            ["none", "model", "ngram", "composite", "suffix"]), _json),
        "draft_tokens": st.one_of(st.integers(-1, 10), _json), "max_latency_s": st.one_of(st.floats(-1, 70), _json),
        "draft_window": st.one_of(st.integers(-1, 100), _json),
        "allow_special_tokens": st.one_of(st.booleans(), _json)}), _json),
    "messages": st.one_of(st.lists(_message, min_size=1, max_size=3), _json),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-2, 400), max_size=8), _json),
    "logprobs": _json, "tools": _json, "frequency_penalty": _json, "user": _json,
}
_text = st.one_of(st.text(max_size=40),
                  st.lists(st.sampled_from(["t10 ", "t11 ", "t1", "<|im_end|>", "\n"]), max_size=12).map("".join),
                  st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=4))  # surrogates
# Valid values of every field a request may carry, so that most near-valid bodies get a reply.
_valid_fields = {
    "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "seed": st.integers(0, 2**32), "stop": st.lists(st.text(max_size=4), max_size=3),
    "stream": st.booleans(), "n": st.just(1), "user": st.text(max_size=5), "frequency_penalty": st.just(0),
    "specedge": st.fixed_dictionaries({}, optional={
        "speculation": st.booleans(), "drafter": st.sampled_from(["none", "model", "ngram", "composite", "suffix"]),
        "draft_tokens": st.integers(0, 10), "max_latency_s": st.floats(0.001, 60),
        "draft_window": st.integers(0, 100), "allow_special_tokens": st.booleans()}),
}


@st.composite
def _near_valid(draw, chat: bool) -> dict:
    """A valid request with a few valid extras, and sometimes one field replaced by random JSON."""
    if chat:
        body = {"messages": draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                                 "content": _text}), min_size=1, max_size=3))}
    else:
        body = {"prompt": draw(st.one_of(_text, st.lists(st.integers(0, 299), min_size=1, max_size=6)))}
    body["max_tokens"] = draw(st.integers(1, 4))
    for name in draw(st.lists(st.sampled_from(sorted(_valid_fields)), max_size=4, unique=True)):
        body[name] = draw(_valid_fields[name])
    if draw(st.booleans()):
        body[draw(st.sampled_from(sorted(_fields)))] = draw(_json)
    return body


def _bodies(chat: bool):
    return st.one_of(
        _near_valid(chat), _near_valid(chat),  # twice: most cases are requests that could be served
        st.fixed_dictionaries({}, optional=_fields),
        _json,  # not even an object
        st.dictionaries(st.text(max_size=12), _json, max_size=5),
    )


def _valid_reply(path: str, body: dict, response: httpx.Response) -> bool:
    if body.get("stream") is True and response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in response.text.split("\n") if line]
        return lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    data = response.json()
    key = "message" if path.endswith("chat/completions") else "text"
    choice = data["choices"][0]
    return choice["finish_reason"] in ("stop", "length") and (key in choice)


_fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@_fuzz
@given(body=_bodies(chat=True))
def test_random_json_to_chat_completions(serving, body):
    _check_reply(serving, "/v1/chat/completions", body)


@_fuzz
@given(body=_bodies(chat=False))
def test_random_json_to_completions(serving, body):
    _check_reply(serving, "/v1/completions", body)


def _check_reply(serving, path: str, body) -> None:
    """Only a typed 4xx error or a valid reply; never a 5xx, never a hang."""
    FUZZ_COUNTS["cases"] += 1
    try:
        response = httpx.post(serving.url + path, content=json.dumps(body), timeout=30,
                              headers={"Content-Type": "application/json"})
    except httpx.TimeoutException:
        FUZZ_COUNTS["hangs"] += 1
        raise
    if response.status_code >= 500:
        FUZZ_COUNTS["server_errors"] += 1
    assert response.status_code < 500, (body, response.text)
    if response.status_code == 200:
        assert _valid_reply(path, body if isinstance(body, dict) else {}, response), (body, response.text)
        FUZZ_COUNTS["ok"] += 1
    else:
        error = response.json()["error"]
        assert 400 <= response.status_code < 500 and error["message"] and error["type"], (body, response.text)
        FUZZ_COUNTS["typed_4xx"] += 1


def test_zz_report_fuzz_counts(capsys):
    """Runs after the property test in this module: prints the counts issue 20's closing note asks for."""
    if not FUZZ_COUNTS["cases"]:
        pytest.skip("the property test did not run in this session")
    with capsys.disabled():
        print(f"\nrandom-JSON server cases: {FUZZ_COUNTS}")
    assert FUZZ_COUNTS["server_errors"] == 0 and FUZZ_COUNTS["hangs"] == 0
    assert FUZZ_COUNTS["cases"] == FUZZ_COUNTS["ok"] + FUZZ_COUNTS["typed_4xx"]
