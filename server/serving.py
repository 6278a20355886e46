"""uvicorn, configured for an exposed endpoint: connection limits, timeouts, graceful shutdown.

uvicorn's own settings bound most of what a hostile or broken client can hold:

* ``limit_concurrency``: connections + running requests past this get 503 at once (in the
  app's JSON error format: ``_HeadTimeoutH11`` answers it, not uvicorn's plain-text page);
* ``h11_max_incomplete_event_size``: a request head (line + headers) larger than this is
  refused (400) instead of being buffered;
* ``timeout_keep_alive``: an idle connection between requests is closed.

uvicorn has no limit on how long a request *head* may take to arrive (its keep-alive
timer starts only after a first response, and any byte cancels it), so 200 clients each
sending half a header held 200 connections open. ``_HeadTimeoutH11`` adds that timer:
from the moment a connection opens (or a response completes), the next request head must
arrive within ``HEAD_TIMEOUT_S``. The body has its own deadline in the app (408).

Shutdown: on SIGTERM/SIGINT, :class:`SpecedgeServer` first tells the app to drain
(``begin_shutdown``: 503 for new and queued requests, the running reply gets
``grace_s`` and is then cut at a block boundary with a proper finish), and only then lets
uvicorn close the listeners and wait for connections, for longer than the grace period.
"""

from __future__ import annotations

import asyncio
import json
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import DEFAULT_SHUTDOWN_GRACE_S
from .protocol import APIError

uvicorn_log = logging.getLogger("uvicorn.error")

# A request head (request line + headers) is a few hundred bytes from any real client;
# 10 s is generous on a slow link and short enough that idle half-open connections do not pile up.
HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 32 * 1024  # h11's default is 16 KiB; 32 KiB leaves room for long bearer tokens
# Open connections (streams included) before uvicorn answers 503. One generation runs at a
# time and --queue-size wait; the rest are /health probes and clients being refused.
MAX_CONNECTIONS = 128
KEEP_ALIVE_S = 5  # uvicorn's default: an idle keep-alive connection is closed after this
# After the grace period the running reply stops inside its forward (CPU) or at its next block
# boundary (GPU; one verify step: well under a second on any model specedge runs) and its last
# chunks are written;
# uvicorn waits this much longer before it cancels what is left.
SHUTDOWN_MARGIN_S = 5.0
OVERLOAD_RETRY_AFTER_S = 1  # what a 503 past MAX_CONNECTIONS suggests: most connections are short requests


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (see the module docstring)."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own check answers past limit_concurrency with a plain-text page; the same check
        # runs in front of the app instead, answering in the JSON error format every other error uses.
        limit, self.limit_concurrency = self.limit_concurrency, None
        if limit is not None:
            self.app = _ConcurrencyLimit(self.app, limit, self.connections, self.tasks)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _head_timeout(self) -> None:
        # A request in flight (head received, response not complete) is the app's to time out.
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


class _ConcurrencyLimit:
    """ASGI wrapper: 503 with a JSON error body while ``limit`` connections are open or requests
    run (uvicorn's own rule, evaluated in the request's task, which counts itself)."""

    def __init__(self, app, limit: int, connections: set, tasks: set) -> None:
        self.app, self.limit, self.connections, self.tasks = app, limit, connections, tasks
        error = APIError(503, f"the server is at its limit of {limit} open connections; retry shortly",
                         type="server_error", code="server_overloaded")
        self.body = json.dumps(error.body()).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (len(self.connections) < self.limit and len(self.tasks) <= self.limit):
            return await self.app(scope, receive, send)
        uvicorn_log.warning("Exceeded concurrency limit.")
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(self.body)).encode()),
                                (b"retry-after", str(OVERLOAD_RETRY_AFTER_S).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


class SpecedgeServer(uvicorn.Server):
    """A uvicorn server that drains the specedge app before uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app  # the Starlette app create_app() built (config.loaded_app may be wrapped)
        drain = getattr(getattr(app, "state", None), "server", None)
        if drain is not None:
            drain.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)


def server_config(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, max_connections: int = MAX_CONNECTIONS,
                  head_timeout_s: float | None = None) -> uvicorn.Config:
    """uvicorn settings for serving ``app`` (the limits above)."""
    if not (isinstance(grace_s, (int, float)) and 0 <= grace_s <= 3600):
        raise ValueError(f"grace_s must be a number of seconds in [0, 3600]; got {grace_s!r}")
    protocol = _HeadTimeoutH11
    if head_timeout_s is not None:  # a subclass, so the default stays one constant
        protocol = type("_HeadTimeoutH11", (_HeadTimeoutH11,), {"head_timeout_s": float(head_timeout_s)})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=protocol,
                            limit_concurrency=max_connections, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            timeout_keep_alive=KEEP_ALIVE_S,
                            timeout_graceful_shutdown=int(grace_s + SHUTDOWN_MARGIN_S + 0.999))
