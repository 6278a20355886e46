"""Invariant: whatever a request's handling raises, its client is answered and the server stays whole.

Issue #41: a StopIteration (a hostile message ran the chat encoder out of placeholders) could not
be "raised into a Future": the request never answered, its connection stayed open, and after ~126
of them every request got uvicorn's plain-text 503. Checked here with injected failures, at the two
places a request's code runs off the event loop:

* parsing (the parse pool: JSON, template, tokenisation): a StopIteration or RuntimeError from
  ``encode_prompt`` is a 500 with the JSON error body, on every endpoint, streaming or not;
* the worker thread: a StopIteration, or a BaseException that escapes the worker's own ``except
  Exception`` (SystemExit, KeyboardInterrupt), from ``Generator.stream`` / ``prefill``: a
  non-streaming request gets the 500 JSON body, a streaming one (its 200 status line is sent when
  it is queued) gets the same error object as an SSE event, then ``[DONE]``; a prefill (answered
  202 when queued) is counted as failed;

and after each: /health answers, nothing is running or waiting, the failure is counted once, and
a normal request succeeds. Past the connection limit, the 503 carries the JSON error body too.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

for _module in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_module)

import httpx  # noqa: E402

from live_server import LoopbackServer  # noqa: E402
from reference_engine import reference_generator  # noqa: E402
from specedge.server.app import create_app  # noqa: E402
from specedge.server.serving import SpecedgeServer, server_config  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "w010 w011"}], "max_tokens": 3, "temperature": 0}
COMPLETION = {"prompt": "w010 w011 w012", "max_tokens": 3, "temperature": 0}
ROUTES = {  # name: (path, body)
    "chat": ("/v1/chat/completions", CHAT),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
    "completions": ("/v1/completions", COMPLETION),
    "completions-stream": ("/v1/completions", {**COMPLETION, "stream": True}),
    "prefill": ("/v1/specedge/prefill", CHAT),
}
TIMEOUT_S = 20  # every answer here comes in well under a second; a hang fails the test instead


class Served(LoopbackServer):
    """``create_app`` under ``SpecedgeServer`` with ``server_config``'s limits, on a free loopback port."""

    def __init__(self, gen, **config_kw) -> None:
        self.app = create_app(gen, warmup=False)
        super().__init__(SpecedgeServer(server_config(self.app, log_level="critical", **config_kw)))

    def health_response(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=TIMEOUT_S)

    def settled(self, failed: int) -> dict:
        """/health once the worker has counted ``failed`` failures and holds nothing (prefills finish after 202)."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            response = self.health_response()
            assert response.status_code == 200, response.text
            state = response.json()
            if state["failed"] == failed and not state["busy"] and not state["waiting"] and \
                    not state["waiting_prefills"]:
                return state
            assert time.monotonic() < deadline, f"the worker never settled: {state}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return reference_generator(tmp_path_factory.mktemp("server-errors"))


@pytest.fixture(scope="module")
def served(gen):
    s = Served(gen)
    yield s
    s.close()


def _raiser(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc
    return fail


def _post(served: Served, route: str) -> httpx.Response:
    path, body = ROUTES[route]
    return httpx.post(served.url + path, json=body, timeout=TIMEOUT_S)


def _assert_internal_error(body: dict) -> None:
    assert body["error"]["type"] == "server_error", body
    assert body["error"]["code"] == "internal_error", body
    assert body["error"]["message"].startswith("internal error: "), body


def _assert_served_normally(served: Served, route: str) -> None:
    response = _post(served, route)
    if route == "prefill":
        assert response.status_code == 202, response.text
        return
    assert response.status_code == 200, response.text
    if route.endswith("stream"):
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and all("error" not in json.loads(e[6:]) for e in events[:-1])
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("exc", [StopIteration(), RuntimeError("injected")], ids=["StopIteration", "RuntimeError"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_failure_while_parsing_is_a_500_with_a_json_body(served, gen, monkeypatch, route, exc):
    before = served.settled(served.health_response().json()["failed"])
    monkeypatch.setattr(gen, "encode_prompt", _raiser(exc))
    response = _post(served, route)  # StopIteration here used to leave the request hanging for ever
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/json"
    _assert_internal_error(response.json())
    monkeypatch.undo()
    after = served.settled(before["failed"])  # never reached the worker: nothing queued, nothing counted
    assert after["admitted"] == before["admitted"]
    _assert_served_normally(served, route)


@pytest.mark.parametrize("exc", [StopIteration(), SystemExit(3), KeyboardInterrupt()],
                         ids=["StopIteration", "SystemExit", "KeyboardInterrupt"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_failure_in_the_worker_is_answered_and_the_worker_serves_on(served, gen, monkeypatch, route, exc):
    before = served.settled(served.health_response().json()["failed"])
    monkeypatch.setattr(gen, "prefill" if route == "prefill" else "stream", _raiser(exc))
    response = _post(served, route)  # a BaseException used to end the worker thread: every later request hung
    if route == "prefill":
        assert response.status_code == 202, response.text  # answered when queued; the failure is counted
    elif route.endswith("stream"):
        assert response.status_code == 200, response.text  # the status line went out when it was queued
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]"
        _assert_internal_error(json.loads(events[-2].removeprefix("data: ")))
    else:
        assert response.status_code == 500, response.text
        _assert_internal_error(response.json())
    after = served.settled(before["failed"] + 1)
    monkeypatch.undo()
    assert after["admitted"] - before["admitted"] == (route != "prefill")
    _assert_served_normally(served, route)
    assert served.settled(before["failed"] + 1)["completed"] == after["completed"] + 1


def test_past_the_connection_limit_the_503_is_the_json_error_body(gen):
    s = Served(gen, max_connections=2)
    idle = []
    try:
        for _ in range(2):  # two open connections that send nothing: the limit is reached
            idle.append(socket.create_connection(("127.0.0.1", s.port)))
        deadline = time.monotonic() + TIMEOUT_S
        while (response := s.health_response()).status_code != 503:  # until the server has accepted both
            assert time.monotonic() < deadline, "the connection limit never applied"
            time.sleep(0.01)
        assert response.headers["content-type"] == "application/json"
        assert response.json() == {"error": {"message": "the server is at its limit of 2 open connections; "
                                             "retry shortly", "type": "server_error", "param": None,
                                             "code": "server_overloaded"}}
        assert response.headers["retry-after"] == "1"
        for sock in idle:
            sock.close()
        idle.clear()
        while (response := s.health_response()).status_code != 200:  # the closed connections are let go
            assert time.monotonic() < deadline, "the server never let the closed connections go"
            time.sleep(0.01)
        assert response.json()["status"] == "ok"
    finally:
        for sock in idle:
            sock.close()
        s.close()
