"""Client helpers for ``specedge serve``: prefill a conversation while the user speaks.

``POST /v1/specedge/prefill`` pays only for the tokens the real request then shares with it, so a
prefill must carry exactly the messages the framework's LLM service will send: its system
instruction, the history, and the user turn so far. These helpers build that list from the
framework's own objects, the way the framework itself does, and send it with the key and the model
id, checking the answer (a 401 or 404 is an exception, never a silent no-op).

Standard library only (the edge install gains no dependency); the framework helpers work on the
objects they are given (``livekit_messages`` imports LiveKit's own instructions helper when called).

    from specedge.client import aprefill, pipecat_messages      # Pipecat 1.14
    await aprefill(BASE_URL, await pipecat_messages(llm, context, frame.text), api_key=KEY, model="smollm2")

    from specedge.client import aprefill, livekit_messages      # LiveKit Agents 1.8
    await aprefill(BASE_URL, livekit_messages(session.current_agent, ev.transcript), api_key=KEY, model="smollm2")
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from .errors import SpecedgeError

PREFILL_TIMEOUT_S = 5.0  # the server answers 202 before it prefills: a loopback call takes milliseconds


class PrefillError(SpecedgeError):
    """The server refused a prefill (``status``: the HTTP status; 0 when it could not be reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"prefill refused ({status}): {message}" if status else f"prefill failed: {message}")
        self.status = status


def prefill(base_url: str, messages: list[dict], *, api_key: str | None = None, model: str | None = None,
            timeout: float = PREFILL_TIMEOUT_S, **fields: Any) -> dict:
    """Send ``messages`` to ``{base_url}/specedge/prefill`` (``base_url`` as given to the openai client,
    ending in ``/v1``) and return the server's 202 body (``{"status": "queued", "prompt_tokens": n}``).

    ``api_key``: sent as ``Authorization: Bearer``; ``model``: the id the real requests send;
    ``fields``: other request fields the real request sends that change its cache slot
    (``cache_salt``, ``specedge={"exact": True}``). Raises :class:`PrefillError` on any other status.
    """
    body = {"messages": messages, **fields}
    if model is not None:
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(base_url.rstrip("/") + "/specedge/prefill", method="POST", headers=headers,
                                     data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise PrefillError(0, str(getattr(exc, "reason", exc))) from None
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = {}
    if status != 202:
        error = answer.get("error") if isinstance(answer, dict) else None
        raise PrefillError(status, error.get("message", raw[:200]) if isinstance(error, dict) else raw[:200])
    return answer


async def aprefill(base_url: str, messages: list[dict], **kw: Any) -> dict:
    """:func:`prefill` on a worker thread, for frameworks' event loops; the same arguments."""
    return await asyncio.to_thread(prefill, base_url, messages, **kw)


async def pipecat_messages(llm, context, transcript: str) -> list[dict]:
    """The messages a Pipecat ``OpenAILLMService`` (``llm``) sends for ``context`` (its ``LLMContext``)
    once the user's turn ``transcript`` is added: built by the service's own adapter, with the
    service's ``system_instruction`` first, as ``get_chat_completions`` builds them (Pipecat 1.14)."""
    instruction = getattr(llm.settings, "system_instruction", None)
    params = await llm.get_llm_adapter().get_llm_invocation_params(
        context, system_instruction=instruction if isinstance(instruction, str) else None,
        convert_developer_to_user=not llm.supports_developer_role)
    return [*params["messages"], {"role": "user", "content": transcript}]


def livekit_messages(agent, transcript: str) -> list[dict]:
    """The messages LiveKit's ``openai.LLM`` sends for ``agent``'s reply once the user's turn
    ``transcript`` is added: the agent's chat context (its ``instructions`` first, which
    ``session.history`` leaves out) with the user message, in the plugin's "openai" format
    (LiveKit Agents 1.8). ``agent``: ``session.current_agent``."""
    from livekit.agents.voice.generation import update_instructions  # the call the agent's activity makes

    chat_ctx = agent.chat_ctx.copy()
    # The activity puts the instructions first when it starts and re-renders them for each voice reply.
    update_instructions(chat_ctx, instructions=agent.instructions, add_if_missing=True, modality="audio")
    chat_ctx.add_message(role="user", content=transcript)
    messages, _ = chat_ctx.to_provider_format("openai")
    return messages
