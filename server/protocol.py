"""The OpenAI wire format: request JSON in, a prompt + GenerationConfig out; results back out as JSON.

Pure functions over dicts (no HTTP), so every rule here can be tested without a
server. Validation follows the OpenAI API where specedge can honour it, and
refuses what it cannot honour with a 400 naming the parameter, instead of
silently ignoring it: a client that asks for ``n=2`` or ``logprobs`` must learn
that it will not get them.

Conventions taken from the OpenAI API:

* an explicit ``null`` means "the default", like an absent field;
* ``temperature`` defaults to 1.0 (sampling), as OpenAI's does; send 0 for greedy;
* chat ``max_tokens`` defaults to the room left in the context (capped by the server's
  ``--max-tokens``, :data:`~.limits.DEFAULT_MAX_TOKENS`), completions' to 16.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import ChatTemplateError, ContextOverflowError, InvalidParameterError, SpecedgeError
from ..runtime.drafters import needs_draft_model
from ..runtime.options import GenerationConfig
from ..runtime.results import GenerationResult
from ..runtime.options import OPTIONS, check
from .limits import CACHE_SHARING
from .worker import ShuttingDown

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples unless told otherwise; greedy is temperature=0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions endpoint's documented default
SHUTDOWN_RETRY_AFTER_S = 5  # what a 503 during shutdown suggests: long enough for a restart to begin
# keys of the `specedge` request extension: the GenerationConfig options marked server=True
SPECEDGE_FIELDS = tuple(name for name, option in OPTIONS.items() if option.server)

# Parameters specedge does not implement, accepted only at the value that means "off",
# so frameworks that always send them (Pipecat, LiveKit) work unchanged.
_NEUTRAL_COMMON: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
}
_NEUTRAL_CHAT: dict[str, tuple] = {
    **_NEUTRAL_COMMON,
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, "auto" can only mean "none"
    "parallel_tool_calls": (True, False),  # meaningless without tools
    "response_format": ({"type": "text"},),
    "store": (False,),
    "service_tier": ("auto", "default"),  # Pipecat passes its setting through
}
_NEUTRAL_COMPLETIONS: dict[str, tuple] = {
    **_NEUTRAL_COMMON,
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "logprobs": (),  # even 0 asks for the sampled token's logprob; only null is off
}
# Labels that change nothing about the output: validated, then ignored.
_INFORMATIONAL = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "n", "specedge", "cache_salt"} | set(_INFORMATIONAL)
_CHAT_KNOWN = _COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL_CHAT)
_COMPLETIONS_KNOWN = _COMMON | {"prompt"} | set(_NEUTRAL_COMPLETIONS)


class APIError(Exception):
    """An error answered in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error_from(exc: BaseException) -> APIError:
    """Map an exception from the library (or from a chat template) to the answer a client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        return APIError(400, str(exc), code="invalid_parameter")
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), type="server_error", code="server_shutting_down",
                        headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})
    if isinstance(exc, ChatTemplateError):  # the bundle's template, not the messages: not the client's fault
        return APIError(500, str(exc), type="server_error", code="bundle_error")
    if isinstance(exc, SpecedgeError):
        return APIError(500, str(exc), type="server_error", code="generation_failed")
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


@dataclass(frozen=True)
class ParsedRequest:
    """One validated request, ready for the worker."""

    kind: str  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a final chunk with usage
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))


# ----------------------------------------------------------------------------- field checks
def _bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


def _int(body: dict, name: str, *, minimum: int | None = None, where: str | None = None) -> int | None:
    """``body[name]`` as an int (None when absent); ``where`` names it in errors (default: name)."""
    value = body.get(name)
    where = where or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(where, f"{where} must be an integer; got {value!r}")
    if minimum is not None and value < minimum:
        raise _bad(where, f"{where} must be >= {minimum}; got {value}")
    return value


def _option(body: dict, name: str, *, option: str | None = None, where: str | None = None) -> Any:
    """``body[name]`` checked as GenerationConfig field ``option`` (default: name), with the bounds
    stated once in runtime/options.py; None when absent. A field that spells None as 0 maps 0 to
    None here, so the caller sees ``(value, present)`` through ``name in body``."""
    value = body.get(name)
    if value is None:
        return None
    field = option or name
    if OPTIONS[field].zero_is_none and value == 0 and isinstance(value, int) and not isinstance(value, bool):
        return None
    try:
        return check(field, value, where=where or name)
    except InvalidParameterError as exc:
        raise _bad(where or name, str(exc)) from None


def _bool(body: dict, name: str, default: bool, *, where: str | None = None) -> bool:
    value = body.get(name)
    where = where or name
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(where, f"{where} must be true or false; got {value!r}")
    return value


def _check_known(body: dict, known: set[str], neutral: dict[str, tuple], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise _bad(unknown[0], f"unknown parameter {unknown[0]!r} for {endpoint}"
                   + (f" (and {unknown[1:]})" if len(unknown) > 1 else ""))
    for name, allowed in neutral.items():
        value = body.get(name)
        # bool is an int in Python: keep False from passing for 0 and 0 for False.
        if value is not None and not any(value == a and isinstance(value, bool) == isinstance(a, bool)
                                         for a in allowed):
            raise APIError(400, f"{name}={value!r} is not supported by specedge"
                           + (f"; only {' or '.join(repr(a) for a in allowed)} (or null) is accepted" if allowed
                              else "; leave it unset (null)"), param=name, code="unsupported_parameter")


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise _bad(f"stream_options.{unknown[0]}", f"unknown stream option {unknown[0]!r}")
    _bool(options, "include_obfuscation", False)  # validated; specedge never pads chunks
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", "stream_options.include_usage must be true or false")
    return stream, bool(include_usage)


def _speculation(body: dict, *, server_speculation: bool, has_draft: bool, server_exact: bool = False) -> dict:
    """The ``specedge`` request extension -> GenerationConfig fields."""
    ext = body.get("specedge")
    if ext is None:
        ext = {}
    if not isinstance(ext, dict):
        raise _bad("specedge", "specedge must be an object, e.g. {\"speculation\": false}")
    unknown = sorted(set(ext) - set(SPECEDGE_FIELDS))
    if unknown:
        raise _bad(f"specedge.{unknown[0]}", f"unknown specedge field {unknown[0]!r}; known: "
                   f"{', '.join(SPECEDGE_FIELDS)}")
    out: dict[str, Any] = {"speculation": server_speculation, "exact": server_exact}  # the request's own win
    for name in SPECEDGE_FIELDS:
        if ext.get(name) is not None:
            out[name] = _option(ext, name, where=f"specedge.{name}")  # 0 = None where the option says so
    if out["speculation"] and not server_speculation:
        raise _bad("specedge.speculation", "speculation is off on this server (started with --no-speculation)")
    drafter = out.get("drafter")
    if drafter is not None and needs_draft_model(drafter) and not has_draft:
        raise _bad("specedge.drafter", f"drafter {drafter!r} needs a draft model, and none is loaded")
    return out


def _cache_salt(body: dict) -> str | None:
    """The request's ``cache_salt`` (vLLM's field): a non-empty string, or None."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("cache_salt", f"cache_salt must be a non-empty string; got {salt!r}")
    return salt


def cache_namespace(sharing: str, tenant: str | None, salt: str | None) -> str | None:
    """The cache salt a request runs under (runtime/slots.py: slots written under one are never reused
    under another), from the server's ``sharing`` policy (:data:`CACHE_SHARING`), the caller's
    ``tenant`` (which API key it sent; None when the server has at most one key) and its own ``salt``.
    Different (tenant, salt) pairs never map to one namespace."""
    if sharing not in CACHE_SHARING or sharing == "none":
        raise ValueError(f"no namespace under cache sharing {sharing!r}")
    if sharing == "salt" or tenant is None:
        return salt
    return json.dumps([tenant, salt])  # injective: a client's salt cannot spell another tenant's namespace


def _model(body: dict, model_name: str) -> str:
    model = body.get("model")
    if model is None:
        return model_name
    if not isinstance(model, str):
        raise _bad("model", "model must be a string")
    if model != model_name:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    return model


def _config(body: dict, *, max_tokens: int, chat: bool, server_speculation: bool, has_draft: bool,
            server_exact: bool = False) -> GenerationConfig:
    n = _int(body, "n", minimum=1)
    if n is not None and n != 1:
        raise _bad("n", f"n must be 1: specedge generates one choice per request; got {n}")
    temperature = _option(body, "temperature")
    top_p = _option(body, "top_p")
    if type(body.get("top_k")) is int and body["top_k"] == -1:
        body = {**body, "top_k": 0}  # vLLM's extension: -1 and 0 both mean "off"
    top_k = _option(body, "top_k")
    seed = _option(body, "seed")
    for name, kind in _INFORMATIONAL.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise _bad(name, f"{name} must be {'a string' if kind is str else 'an object'}")
    try:
        return GenerationConfig(
            cache_salt=_cache_salt(body), max_new_tokens=max_tokens,
            temperature=OPENAI_DEFAULT_TEMPERATURE if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, seed=seed, stop=_option(body, "stop") or (),
            chat=chat, **_speculation(body, server_speculation=server_speculation, has_draft=has_draft,
                                      server_exact=server_exact))
    except InvalidParameterError as exc:
        raise _bad(None, str(exc)) from None


# ----------------------------------------------------------------------------- requests
def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"{where} must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"{where}.role", f"{where}.role must be a string")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""  # an assistant turn that only called tools
        if isinstance(content, list):  # content parts: only text can reach a text model
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{j}]", f"{where}.content[{j}] must be a text part "
                               "{\"type\": \"text\", \"text\": ...}; this model reads text only")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"{where}.content must be a string or a list of text parts")
        # "developer" is OpenAI's newer name for "system"; model templates know only "system".
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt_ids(body: dict, generator) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "prompt is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return generator.encode_prompt(prompt, chat=False)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return generator.encode_prompt(input_ids=prompt)
    raise _bad("prompt", "prompt must be a string, a list of token ids, or a list holding one of those "
               "(specedge answers one prompt per request)")


def parse_request(kind: str, body: dict, generator, *, model_name: str, speculation: bool = True,
                  max_tokens: int | None = None, exact: bool = False) -> ParsedRequest:
    """Validate an OpenAI request body and encode its prompt.

    ``kind``: "chat" (``/v1/chat/completions``) or "completion" (``/v1/completions``).
    ``max_tokens``: the server's cap on a chat reply that sends neither ``max_tokens`` nor
    ``max_completion_tokens`` (None: the room left in the context); a request's own value wins.
    ``exact``: the server's default for ``specedge.exact`` (``serve --exact``); a request's own value wins.
    Raises :class:`APIError` (4xx) for anything a client got wrong.
    """
    chat = kind == "chat"
    if chat:
        _check_known(body, _CHAT_KNOWN, _NEUTRAL_CHAT, "/v1/chat/completions")
    else:
        _check_known(body, _COMPLETIONS_KNOWN, _NEUTRAL_COMPLETIONS, "/v1/completions")
    model = _model(body, model_name)
    stream, include_usage = _stream_flags(body)
    server_max_tokens = max_tokens
    max_tokens = _option(body, "max_completion_tokens", option="max_new_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _option(body, "max_tokens", option="max_new_tokens")
    ext = body.get("specedge")
    allow_special = isinstance(ext, dict) and ext.get("allow_special_tokens") is True
    try:
        ids = _prompt_ids(body, generator) if not chat else \
            generator.encode_prompt(messages=_messages(body), allow_special_tokens=allow_special)
    except APIError:
        raise
    except SpecedgeError as exc:  # InvalidParameterError, ContextOverflowError, the template's raise_exception
        err = api_error_from(exc)
        if err.status < 500:
            err.param = "messages" if chat else "prompt"
        raise err from None
    if max_tokens is None and chat:
        room = generator.max_context - len(ids)
        max_tokens = room if server_max_tokens is None else min(server_max_tokens, room)
    elif max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    config = _config(body, max_tokens=max_tokens, chat=chat, server_speculation=speculation,
                     has_draft=generator.draft is not None, server_exact=exact)
    prefix = "chatcmpl-" if chat else "cmpl-"
    return ParsedRequest(kind, model, ids, config, stream, include_usage, id=prefix + uuid.uuid4().hex[:24])


# ----------------------------------------------------------------------------- responses
def finish_reason(result: GenerationResult) -> str:
    # Only OpenAI's two values go out. "cancelled" reaches a client only when a shutdown cut its
    # reply short: the text is a truncated answer, which is what "length" tells a client.
    return "stop" if result.finish_reason == "stop" else "length"


def usage(result: GenerationResult) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens taken
    from a conversation slot instead of computed (``specedge.reused_tokens``), as OpenAI's prompt
    caching reports them, so frameworks that log cache hits see ours."""
    prompt, completion = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": result.stats.reused_tokens}}


def speculation_stats(result: GenerationResult, queue_s: float = 0.0) -> dict:
    """The ``specedge`` response extension: per-request speculative metrics, as vLLM reports them."""
    s = result.stats
    return {"drafter": s.drafter, "drafted": s.drafted, "accepted": s.accepted,
            "acceptance": round(s.acceptance, 4), "mean_accepted_length": round(s.mean_accepted_length, 4),
            "k_chosen": {str(k): v for k, v in sorted(s.k_chosen.items())}, "steps": s.steps,
            "tokens_per_s": round(s.tokens_per_s, 2), "time_to_first_token_s": round(s.time_to_first_token_s, 5),
            "total_s": round(s.total_s, 5), "queue_s": round(queue_s, 5),
            # the draft's one-off catch-up (its prompt prefill, bounded by draft_window), and the
            # steps run plain because it would not have paid off in this reply
            "catchup_s": round(s.catchup_s, 5), "catchup_tokens": s.catchup_tokens,
            "catchup_deferred": s.catchup_deferred, "reused_tokens": s.reused_tokens}


def completion_body(req: ParsedRequest, result: GenerationResult, queue_s: float = 0.0) -> dict:
    """The non-streaming response: ``chat.completion`` or ``text_completion``."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": None, "finish_reason": finish_reason(result)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result)}
        obj = "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice],
            "usage": usage(result), "specedge": speculation_stats(result, queue_s)}


def chunk(req: ParsedRequest, *, text: str | None = None, role: bool = False,
          result: GenerationResult | None = None, queue_s: float = 0.0) -> dict:
    """One streamed chunk: the role opener, a text delta, or (with ``result``) the finishing chunk."""
    reason = finish_reason(result) if result is not None else None
    if req.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    out = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None  # OpenAI: null on every chunk but the last
    if result is not None:
        out["specedge"] = speculation_stats(result, queue_s)
    return out


def usage_chunk(req: ParsedRequest, result: GenerationResult) -> dict:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [],
            "usage": usage(result)}
