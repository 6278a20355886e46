"""The docs' copyable python blocks run as written, against a real ``specedge serve``.

Invariants guarded here:

* every python block in the README's voice-agent section is marked ``<!-- snippet: name -->``,
  and every marked block (README.md, docs/*.md) runs: a block that raises fails the build;
* each runs against ``specedge serve`` (the CLI, in a subprocess, on 127.0.0.1 and a free port,
  with an API key and ``--model-name smollm2``), the only edit being the port in its URL;
* the framework blocks are then driven through the real client packages (the ``clients`` extra:
  openai always, pipecat-ai and livekit-agents skipped cleanly when absent): their requests carry
  no max_tokens of their own beyond what the snippet sets, and a prefill built by
  ``specedge.client`` from the framework's objects is what the real request then reuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

for _module in ("starlette", "uvicorn", "openai", "httpx", "torch", "transformers"):
    pytest.importorskip(_module)

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
API_KEY = "sk-snippets"
MODEL = "smollm2"  # the id every snippet sends
README_URL = "http://127.0.0.1:8000"
VOICE_SECTION = "## Using specedge from a voice-agent framework"
MARKER = re.compile(r"<!--\s*snippet:\s*([\w-]+)\s*-->\s*\n```python\n(.*?)```", re.S)
# What a snippet imports that only the clients extra installs: the snippet is skipped without it.
NEEDS = {"pipecat-service": ("pipecat",), "pipecat-prefill": ("pipecat",),
         "livekit-session": ("livekit.agents", "livekit.plugins.openai"), "livekit-prefill": ("livekit.agents",)}


def snippets(path: Path) -> dict[str, str]:
    return {name: code for name, code in MARKER.findall(path.read_text(encoding="utf-8"))}


ALL = {name: code for path in DOCS for name, code in snippets(path).items()}


def test_every_python_block_in_the_voice_agent_section_is_a_marked_snippet():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(VOICE_SECTION)
    section = text[start:text.index("\n## ", start + 1)]
    blocks = section.count("```python")
    marked = MARKER.findall(section)
    assert blocks == len(marked) >= 5, f"{blocks} python blocks, {len(marked)} marked <!-- snippet: name -->"
    assert set(NEEDS) <= set(ALL) and "openai-stream" in ALL
    names = [name for path in DOCS for name, _ in MARKER.findall(path.read_text(encoding="utf-8"))]
    assert len(names) == len(set(names)), "snippet names must be unique"


# ----------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(int4_bundle, tmp_path_factory):
    """``specedge serve`` as a user runs it (a subprocess), on loopback; yields (base url, its log path)."""
    log = tmp_path_factory.mktemp("snippets") / "serve.log"
    port = _free_port()
    command = [sys.executable, "-m", "specedge.cli.main", "serve", str(int4_bundle), "--port", str(port),
               "--model-name", MODEL, "--threads", "1", "--api-key", API_KEY]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items() if k != "SPECEDGE_API_KEY"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "specedge serve did not start: " + log.read_text()
        time.sleep(0.2)
    yield url, log
    proc.terminate()
    proc.wait(30)


@pytest.fixture
def run_snippet(server, monkeypatch, capsys):
    """``run_snippet(name) -> namespace``: the block exec'd as a script, with the live server's port."""
    url, _ = server
    monkeypatch.setenv("SPECEDGE_API_KEY", API_KEY)

    def run(name: str) -> dict:
        for module in NEEDS.get(name, ()):
            pytest.importorskip(module)
        code = ALL[name]
        assert README_URL in code or name not in NEEDS, "a framework snippet names the server's URL"
        namespace = {"__name__": f"snippet_{name.replace('-', '_')}"}
        exec(compile(code.replace(README_URL, url), f"README snippet {name}", "exec"), namespace)
        return namespace

    return run


def _health(url: str) -> dict:
    return httpx.get(url + "/health", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()


# ----------------------------------------------------------------------------- the snippets
def test_the_openai_snippet_streams_and_reports_usage_with_cached_tokens(run_snippet, capsys, server):
    run_snippet("openai-stream")
    out = capsys.readouterr().out.strip().splitlines()
    spec, usage = out[-2], out[-1].split()
    assert "'drafter'" in spec and "'reused_tokens'" in spec
    assert int(usage[0]) > 0 and 0 <= int(usage[1]) < int(usage[0])  # prompt_tokens, cached_tokens
    assert _health(server[0])["max_tokens"] == 256  # the server's default cap, shown in /health


def test_the_pipecat_service_streams_through_pipecat(run_snippet, server):
    ns = run_snippet("pipecat-service")
    from pipecat.processors.aggregators.llm_context import LLMContext

    llm = ns["llm"]

    async def reply() -> tuple[str, list]:
        chunks = [c async for c in await llm.get_chat_completions(
            LLMContext(messages=[{"role": "user", "content": "What are your opening hours?"}]))]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks

    text, chunks = asyncio.run(reply())
    assert text and chunks[-1].usage.completion_tokens <= 96  # the snippet's max_completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_the_livekit_llm_streams_through_livekit(run_snippet):
    lk_llm = pytest.importorskip("livekit.agents.llm")

    async def reply() -> str:  # LiveKit runs a session inside its entrypoint's event loop: so does the snippet
        ns = run_snippet("livekit-session")
        ctx = lk_llm.ChatContext.empty()
        ctx.add_message(role="system", content=ns["agent"].instructions)
        ctx.add_message(role="user", content="What are your opening hours?")
        async with ns["session"].llm.chat(chat_ctx=ctx) as stream:
            return "".join([c.delta.content or "" async for c in stream if c.delta])

    assert asyncio.run(reply())


def _prefilled_then_reused(server, prefill, request) -> tuple[dict, dict]:
    """Run a snippet's prefill, wait for the worker, then the framework's real request."""
    url, _ = server
    before = _health(url)["completed"]
    answer = prefill()
    assert answer["status"] == "queued"
    deadline = time.monotonic() + 30
    while _health(url)["completed"] <= before or _health(url)["waiting_prefills"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return answer, request()


def test_the_pipecat_prefill_is_what_the_real_request_reuses(run_snippet, server):
    service, recipe = run_snippet("pipecat-service"), run_snippet("pipecat-prefill")
    from pipecat.processors.aggregators.llm_context import LLMContext

    llm = service["llm"]
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi, how can I help?"}]
    context = LLMContext(messages=list(history))
    ahead = recipe["PrefillAhead"](llm, context)
    transcript = "What are your opening hours on Sunday"

    async def real_request():
        context.add_message({"role": "user", "content": transcript})
        chunks = [c async for c in await llm.get_chat_completions(context)]
        return chunks[-1].usage

    answer, usage = _prefilled_then_reused(server, lambda: asyncio.run(ahead.prefill(transcript)),
                                           lambda: asyncio.run(real_request()))
    # Everything but the last prompt token came from the prefilled slot: the system instruction included.
    assert usage.prompt_tokens == answer["prompt_tokens"]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert "shared only" not in server[1].read_text()


def test_the_livekit_prefill_is_what_the_real_request_reuses(run_snippet, server):
    recipe = run_snippet("livekit-prefill")
    transcript = "Can I book a table for two"

    async def in_loop():
        session_ns = run_snippet("livekit-session")
        recipe["prefill_while_the_user_speaks"](session_ns["session"])  # the hook registers on the session
        return session_ns["agent"], session_ns["session"].llm

    agent, llm = asyncio.run(in_loop())

    async def real_request():
        from specedge.client import livekit_messages

        # What the agent's activity hands openai.LLM: the agent's chat context (instructions first)
        # with the user's turn; the plugin converts it to the "openai" format itself.
        ctx = agent.chat_ctx.copy()
        from livekit.agents.voice.generation import update_instructions

        update_instructions(ctx, instructions=agent.instructions, add_if_missing=True, modality="audio")
        ctx.add_message(role="user", content=transcript)
        assert ctx.to_provider_format("openai")[0] == livekit_messages(agent, transcript)
        async with llm.chat(chat_ctx=ctx) as stream:
            return [c.usage async for c in stream if c.usage][-1]

    answer, usage = _prefilled_then_reused(server, lambda: asyncio.run(recipe["prefill"](agent, transcript)),
                                           lambda: asyncio.run(real_request()))
    assert usage.prompt_tokens == answer["prompt_tokens"]
    assert usage.prompt_cached_tokens == usage.prompt_tokens - 1  # LiveKit's name for cached_tokens
    assert "shared only" not in server[1].read_text()


def test_a_prefill_without_the_key_or_with_another_model_raises(server):
    from specedge.client import PrefillError, prefill

    url = server[0] + "/v1"
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(PrefillError, match=r"\(401\)") as info:
        prefill(url, messages, model=MODEL)
    assert info.value.status == 401
    with pytest.raises(PrefillError, match=r"\(404\).*smollm2"):
        prefill(url, messages, model="smollm2-self-int4", api_key=API_KEY)
    assert prefill(url, messages, model=MODEL, api_key=API_KEY)["status"] == "queued"


def test_a_prefill_of_other_messages_than_the_request_is_logged(server):
    """The old recipes' mistake: the prefill leaves out the system instruction the request carries."""
    from specedge.client import prefill

    url, log = server
    user = {"role": "user", "content": "Is the shop open on holidays"}
    before = _health(url)["completed"]
    prefill(url + "/v1", [user], model=MODEL, api_key=API_KEY)
    while _health(url)["completed"] <= before:
        time.sleep(0.05)
    system = {"role": "system", "content": "You are a helpful phone assistant."}
    body = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                      json={"model": MODEL, "messages": [system, user], "max_tokens": 4}).json()
    assert 2 * body["usage"]["prompt_tokens_details"]["cached_tokens"] < body["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 10
    while "shared only" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
