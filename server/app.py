"""The HTTP layer: an OpenAI-compatible Starlette app over one Generator.

Routes::

    POST /v1/chat/completions   messages -> chat.completion (or SSE chat.completion.chunk)
    POST /v1/completions        prompt   -> text_completion (or SSE text_completion chunks)
    GET  /v1/models             the one model served
    GET  /health                liveness + queue state (no API key needed); the cache slots'
                                details only to a caller with a valid key (anyone when no key is set)

Every error is answered in OpenAI's format with a 4xx status when the client
caused it: 400 bad parameters or JSON, 401 API key, 404 model or route, 408 body
too slow, 413 body too large, 429 queue full; 503 while shutting down. Generation
runs on the single worker thread (server/worker.py); this module only parses,
queues and streams.

Nothing slow runs on the event loop: JSON decoding, validation, the chat template
(which has its own time budget) and tokenisation run on a small parse pool, so one
large body or a slow template never stalls /health or other streams.

Cache isolation: every request runs under a cache namespace (runtime/slots.py), so one client's
cached conversation is never reused, not even its prefix, by another's request: by default one per
(API key, ``cache_salt``) pair; ``cache_sharing`` picks the policy (limits.CACHE_SHARING).

Graceful shutdown (``begin_shutdown``, called by server/serving.py on SIGTERM before
uvicorn stops): new requests get 503, queued ones 503, and the running one may
finish within the grace period; past it, it is cut (inside its forward on CPU) and its
client gets what was generated with finish_reason "length" (streams: a finishing
chunk and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import sys
import threading
import time
from typing import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import SpecedgeError
from ..runtime.generator import Generator
from . import protocol
from .limits import (CACHE_SHARING, DEFAULT_CACHE_SHARING, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS,
                     DEFAULT_QUEUE_SIZE)
from .protocol import APIError, ParsedRequest
from .worker import GenerationWorker, Job, QueueFull, ShuttingDown

log = logging.getLogger("specedge.server")

RETRY_AFTER_S = 1  # what a 429 suggests; one short generation usually frees a slot
# A body must arrive within this. A client that declares more bytes than it sends (or drips
# them) would otherwise hold a connection and a handler forever; 30 s covers 1 MiB at 35 KB/s.
BODY_TIMEOUT_S = 30.0
# Requests parsed at once off the event loop. Parsing is CPU work under the GIL, so more
# threads buy no throughput; two keep one slow template (bounded by its own time budget)
# from delaying every other request's parse.
PARSE_THREADS = 2


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _sse(data: dict | str) -> str:
    """One server-sent event; compact JSON keeps each chunk small for per-block streaming."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends, and as soon as its client leaves.

    Starlette stops iterating when the client disconnects, and the ``finally`` then frees the worker. But
    it listens for ``http.disconnect`` only on servers that report ASGI spec < 2.4 (uvicorn says 2.3);
    from 2.4 it learns of the disconnect at its next send, which during a long prefill is the first
    token, after the whole prefill has run for nobody. So from 2.4 this response listens itself and
    cancels the job on the disconnect (the prefill's forward stops, engines/ort.py). On a normal end the
    job has finished and the cancel is a no-op.
    """

    def __init__(self, content, worker: GenerationWorker, job: Job, headers: dict) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._worker = worker
        self._job = job

    async def __call__(self, scope, receive, send) -> None:
        spec = tuple(int(part) for part in str(scope.get("asgi", {}).get("spec_version", "2.0")).split(".")[:2])
        listener = asyncio.ensure_future(self._cancel_on_disconnect(receive)) if spec >= (2, 4) else None
        try:
            await super().__call__(scope, receive, send)
        finally:
            if listener is not None:
                listener.cancel()
            self._worker.cancel(self._job)

    async def _cancel_on_disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._worker.cancel(self._job)


class _Server:
    """The route handlers, closed over one generator and one worker."""

    def __init__(self, generator: Generator, *, api_keys: tuple[str, ...], queue_size: int, max_body_bytes: int,
                 model_name: str, speculation: bool, body_timeout_s: float = BODY_TIMEOUT_S,
                 cache_sharing: str = "key", max_tokens: int | None = None, exact: bool = False) -> None:
        self.generator = generator
        self.exact = exact  # requests run in exact mode unless they say otherwise (serve --exact)
        self.max_tokens = max_tokens  # a chat reply's cap when the request sends none (None: the context)
        self.body_timeout_s = body_timeout_s
        self.api_keys = api_keys
        self.cache_sharing = cache_sharing
        self.max_body_bytes = max_body_bytes
        self.model_name = model_name
        self.speculation = speculation
        self.worker = GenerationWorker(generator, queue_size)
        self.started = int(time.time())
        self.draining = False
        self.parse_pool = concurrent.futures.ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="specedge-parse")

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop taking work (503), answer the queue (503), and cut the running reply after ``grace_s``.

        Runs on the event loop; returns at once.
        """
        if self.draining:
            return
        self.draining = True
        self.worker.drain()
        log.info("shutting down: the running reply gets %.1f s to finish", grace_s)
        asyncio.get_running_loop().call_later(grace_s, self.worker.cut_running)

    # ----------------------------------------------------------------- checks
    def _tenant(self, request: Request) -> str | None:
        """Which configured key the request sends ("key<i>"), or None when it sends none of them."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        sent = token.strip().encode()
        found = None
        for i, key in enumerate(self.api_keys):  # every key compared: the time taken names none of them
            # compare_digest: the time taken must not reveal how much of the key matched.
            if hmac.compare_digest(sent, key.encode()) and scheme.lower() == "bearer":
                found = f"key{i}"
        return found

    def _authorize(self, request: Request) -> str | None:
        """401 unless the request sends a configured key (none configured: everyone passes). Returns
        the caller's tenant for cache isolation: None with at most one key (one tenant)."""
        if not self.api_keys:
            return None
        tenant = self._tenant(request)
        if tenant is None:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant if len(self.api_keys) > 1 else None

    def _isolate(self, req: ParsedRequest, tenant: str | None) -> ParsedRequest:
        """The request under its cache namespace (the sharing policy's), or with no cache reuse at all."""
        if self.cache_sharing == "none":
            config = dataclasses.replace(req.config, reuse_prefix=False, reply_memory=False)
        else:
            config = dataclasses.replace(req.config, cache_salt=protocol.cache_namespace(
                self.cache_sharing, tenant, req.config.cache_salt))
        return dataclasses.replace(req, config=config)

    async def _body(self, request: Request) -> bytes:
        """The request body, bounded in size (413) and in time (408)."""
        too_big = APIError(413, f"request body is larger than {self.max_body_bytes} bytes "
                                "(the server's --max-body-bytes)", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big  # refuse before reading a byte of it

        async def read() -> bytes:
            body = bytearray()
            async for part in request.stream():  # chunked bodies have no content-length: count as they come
                body += part
                if len(body) > self.max_body_bytes:
                    raise too_big
            return bytes(body)

        try:
            return await asyncio.wait_for(read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s (is Content-Length "
                                "larger than the body?)", code="request_timeout") from None

    def _parse(self, kind: str, raw: bytes) -> ParsedRequest:
        """JSON, validation, chat template and tokenisation: on the parse pool, never on the loop."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:  # "[[[[..." nests deeper than the parser's stack
            raise APIError(400, "the request body nests too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            return protocol.parse_request(kind, data, self.generator, model_name=self.model_name,
                                          speculation=self.speculation, max_tokens=self.max_tokens,
                                          exact=self.exact)
        except StopIteration as exc:
            # asyncio refuses to set a StopIteration on run_in_executor's Future ("cannot be raised into
            # a Future"): the request would wait forever, holding its connection. Answered 500 instead.
            raise RuntimeError("parsing the request raised StopIteration") from exc

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise protocol.api_error_from(ShuttingDown("the server is shutting down; retry on another instance "
                                                       "or after the restart"))

    # ----------------------------------------------------------------- routes
    async def health(self, request: Request) -> JSONResponse:
        state = {"status": "ok", "model": self.model_name, "speculation": self.speculation, "exact": self.exact,
                 "drafter": self.generator.manifest.speculation.drafter if self.speculation else "none",
                 "max_tokens": self.max_tokens, **self.worker.status()}
        # The slots' held tokens tell how long others' conversations are: for callers with a key only.
        if not self.api_keys or self._tenant(request) is not None:
            state["cache"] = self.generator.slots.describe()
        return JSONResponse(state)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "specedge",
                "max_model_len": self.generator.max_context}

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        self._authorize(request)
        if request.path_params["model_id"] != self.model_name:
            raise APIError(404, f"The model {request.path_params['model_id']!r} does not exist",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def chat_completions(self, request: Request):
        return await self._complete(request, "chat")

    async def completions(self, request: Request):
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: str):
        tenant = self._authorize(request)
        self._refuse_if_draining()
        raw = await self._body(request)
        loop = asyncio.get_running_loop()
        req = self._isolate(await loop.run_in_executor(self.parse_pool, self._parse, kind, raw), tenant)
        job = Job(loop, req.prompt_ids, req.config, name=req.id)
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}; retry shortly", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as exc:
            raise protocol.api_error_from(exc) from None
        headers = {"x-request-id": req.id}
        if req.stream:
            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return _EventStream(self._stream(req, job), self.worker, job, headers)
        result = await self._collect(request, job)
        if result is None:  # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        return JSONResponse(protocol.completion_body(req, result, job.queue_s), headers=headers)

    async def prefill(self, request: Request) -> JSONResponse:
        """POST /v1/specedge/prefill: a chat-completions body whose conversation is pushed into a cache
        slot ahead of the real request (e.g. on each interim speech-to-text result). Answers 202 at
        once; the prefill runs when no generation waits."""
        tenant = self._authorize(request)
        self._refuse_if_draining()
        raw = await self._body(request)
        loop = asyncio.get_running_loop()
        req = self._isolate(await loop.run_in_executor(self.parse_pool, self._parse, "chat", raw), tenant)
        job = Job(loop, req.prompt_ids, req.config, name=req.id, prefill=True)
        try:
            self.worker.submit_prefill(job)
        except ShuttingDown as exc:
            raise protocol.api_error_from(exc) from None
        return JSONResponse({"object": "specedge.prefill", "status": "queued", "prompt_tokens": len(req.prompt_ids)},
                            status_code=202, headers={"x-request-id": req.id})

    async def _stream(self, req: ParsedRequest, job: Job):
        """SSE body: deltas as blocks commit, a finishing chunk, optional usage, ``[DONE]``."""
        if req.kind == "chat":
            yield _sse(protocol.chunk(req, role=True))
        while True:
            kind, value = await job.events.get()
            if kind == "delta":
                yield _sse(protocol.chunk(req, text=value))
            elif kind == "done":
                yield _sse(protocol.chunk(req, result=value, queue_s=job.queue_s))
                if req.include_usage:
                    yield _sse(protocol.usage_chunk(req, value))
                break
            else:  # the status line is long gone: report the error in-band, as OpenAI does
                yield _sse(protocol.api_error_from(value).body())
                break
        yield _sse("[DONE]")

    async def _collect(self, request: Request, job: Job):
        """Wait for a non-streaming job; cancel it if the client disconnects first."""

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.worker.cancel(job)
            job.events.put_nowait(("gone", None))

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    return value
                if kind == "error":
                    raise protocol.api_error_from(value)
                if kind == "gone":
                    return None
        finally:
            watcher.cancel()
            self.worker.cancel(job)  # no-op unless this handler itself was cancelled


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Routing errors (404 unknown path, 405 wrong method) in the same format as the rest.
    return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                    code="not_found" if exc.status_code == 404 else "method_not_allowed"))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    err = protocol.api_error_from(exc)
    if isinstance(exc, SpecedgeError):  # a typed failure (a broken bundle template...): one line, no traceback
        log.error("%s %s: %s", request.method, request.url.path, exc)
    else:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error_response(err)


# The worker thread runs Python between its forwards (drafting, detokenising, the controller) and
# holds the GIL meanwhile; the event loop that writes each streamed delta to its client waits for
# the GIL at every hand-off (the loop's wake-up, the socket write) for up to the interpreter's switch
# interval, 5 ms by default. Measured on SmolLM2 and the Qwen pair (2-core Xeon model 207, a 10-turn
# call, reused prefix; docs/results/2026-12-08-voice-path-handoff.md): a delta reached its client
# 5.8-7.7 ms after the worker emitted it at 5 ms, 2.7 at 1 ms, 1.7-1.9 at 0.5 ms, 1.2-1.4 at 0.2 ms,
# decode speed unchanged. 0.5 ms takes most of the gain while a forced switch stays rare next to a
# forward.
HANDOFF_SWITCH_INTERVAL_S = 0.0005


class _SwitchInterval:
    """Lowers the interpreter's switch interval while at least one app is serving, and puts the
    caller's back when the last one stops (several apps may share a process: the bench runs three)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._serving = 0
        self._previous = sys.getswitchinterval()

    def enter(self) -> None:
        with self._lock:
            if self._serving == 0:
                self._previous = sys.getswitchinterval()
                sys.setswitchinterval(min(self._previous, HANDOFF_SWITCH_INTERVAL_S))
            self._serving += 1

    def exit(self) -> None:
        with self._lock:
            self._serving -= 1
            if self._serving == 0:
                sys.setswitchinterval(self._previous)


_switch_interval = _SwitchInterval()


def create_app(generator: Generator, *, api_key: str | Sequence[str] | None = None,
               queue_size: int = DEFAULT_QUEUE_SIZE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               model_name: str | None = None, speculation: bool = True, warmup: bool = True,
               body_timeout_s: float = BODY_TIMEOUT_S, cache_sharing: str = DEFAULT_CACHE_SHARING,
               max_tokens: int | None = DEFAULT_MAX_TOKENS, exact: bool = False) -> Starlette:
    """An OpenAI-compatible app serving ``generator``.

    ``api_key``: a key, or several (one per client); when set, /v1/* needs
    ``Authorization: Bearer <one of them>``, and /health shows the cache slots only to such callers.
    ``cache_sharing``: which requests may reuse each other's cached prompt prefixes
    (limits.CACHE_SHARING): "key" (default) the same key and cache_salt, "salt" the same
    cache_salt, "none" no two requests.
    ``queue_size``: requests that may wait while one generates; more get 429.
    ``max_body_bytes``: larger request bodies get 413.
    ``model_name``: the id clients pass as ``model`` (default: the bundle folder's name).
    ``speculation``: False forces plain decoding for every request (the baseline).
    ``warmup``: run every session once at startup (``Generator.warmup()``), so the
    first request pays no session setup.
    ``body_timeout_s``: a request body must arrive within this (408 otherwise).
    ``max_tokens``: a chat reply's length when the request sends neither ``max_tokens`` nor
    ``max_completion_tokens`` (None: the room left in the context, OpenAI's rule).
    ``exact``: requests run in exact mode (token-identical greedy output, 2-row plain steps) unless they
    send ``"specedge": {"exact": false}``; refused at start on a bundle exact mode cannot run.
    While it serves, the interpreter's switch interval is at most HANDOFF_SWITCH_INTERVAL_S (streamed
    deltas reach their clients sooner); the last app to stop puts the previous value back.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens must be an integer >= 1 or None; got {max_tokens!r}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an integer >= 1; got {max_body_bytes!r}")
    keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(dict.fromkeys(api_key))
    if (api_key is not None and not keys) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError("api_key must be a non-empty string, a list of them, or None")
    if cache_sharing not in CACHE_SHARING:
        raise ValueError(f"cache_sharing must be one of {', '.join(CACHE_SHARING)}; got {cache_sharing!r}")
    if exact:
        generator.check_exact()  # a bundle exact mode cannot run is refused at start, not per request
    server = _Server(generator, api_keys=keys, queue_size=queue_size, max_body_bytes=max_body_bytes,
                     model_name=model_name or generator.bundle.name, speculation=speculation,
                     body_timeout_s=body_timeout_s, cache_sharing=cache_sharing, max_tokens=max_tokens,
                     exact=exact)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        server.worker.start()
        _switch_interval.enter()
        try:
            if warmup:
                await asyncio.to_thread(_warmup, generator)
            yield
        finally:
            _switch_interval.exit()
            await asyncio.to_thread(server.worker.stop)
            server.parse_pool.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/specedge/prefill", server.prefill, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.server = server
    app.state.worker = server.worker
    return app


def _warmup(generator: Generator) -> None:
    """Sessions first (the expensive part), then the chat template's one-time compile."""
    t0 = time.perf_counter()
    generator.warmup()
    if generator.codec.chat_template:
        try:
            generator.codec.render_chat([{"role": "user", "content": "hi"}])
        except SpecedgeError as exc:  # the template rejects this probe, or is broken: chat requests will say so
            log.warning("chat template probe: %s", exc)
    log.info("warm-up done in %.2f s", time.perf_counter() - t0)
