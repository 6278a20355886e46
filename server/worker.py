"""One model, one device, one generation at a time: the worker thread and its FIFO queue.

A Generator owns one KV cache per model, so generations cannot overlap; running
them on a single dedicated thread (not the event loop, not a pool) keeps the
loop free to accept, stream and reject while a generation runs, and makes the
order of service the order of arrival.

Bridge: the worker pushes ``(kind, value)`` events onto each job's asyncio.Queue
with ``loop.call_soon_threadsafe``, the only thread-safe way into an asyncio loop.
Events, in order: zero or more ``("delta", str)``, then exactly one
``("done", GenerationResult)`` or ``("error", Exception)``.

Cancellation: ``cancel(job)`` takes a waiting job out of the queue at once (its
slot is free for the next request), or stops a running one (``TextStream.cancel()``):
inside the forward in progress on ONNX Runtime's CPU engine (a prefill included),
else at its next block boundary; its slot keeps the tokens committed before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

from ..errors import SpecedgeError
from ..runtime.generator import GenerationConfig, Generator
from ..runtime.results import TextStream
from ..runtime.slots import common_prefix

log = logging.getLogger("specedge.server")


class QueueFull(Exception):
    """Every waiting slot is taken; the request is refused (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is shutting down: the request was refused or dropped from the queue (HTTP 503)."""


class Job:
    """One admitted request: what to generate, and the channel its events go back on."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_ids: list[int], config: GenerationConfig,
                 name: str = "", prefill: bool = False) -> None:
        self.prompt_ids = prompt_ids
        # A prefill-ahead job (POST /v1/specedge/prefill): fills a conversation slot, generates nothing.
        self.prefill = prefill
        self.config = config
        self.name = name  # the request id, for logs
        self.events: asyncio.Queue = asyncio.Queue()
        self.enqueued_at = time.perf_counter()
        self.started_at: float | None = None  # when the worker picked it up
        self.finished_at: float | None = None  # when the worker was done with it (or it left the queue)
        self.outcome: str | None = None  # the counter it landed in
        self.result = None  # its GenerationResult once it ran (the preemptive bench reads its stats)
        self._loop = loop
        self._cancelled = threading.Event()
        self._stream: TextStream | None = None
        self._answered = False  # a "done" or "error" event was handed to the loop

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def queue_s(self) -> float:
        """Seconds spent waiting behind other requests."""
        return (self.started_at or time.perf_counter()) - self.enqueued_at

    def _cancel(self) -> None:
        self._cancelled.set()
        stream = self._stream  # read once: the worker may be setting it right now
        if stream is not None:
            stream.cancel()

    def _emit(self, kind: str, value) -> bool:
        """Hand an event to the loop thread; False when the loop is gone (server shutting down)."""
        if kind != "delta":
            self._answered = True
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
            return True
        except RuntimeError:  # loop closed: nobody is listening any more
            self._cancel()
            return False


class GenerationWorker:
    """The single thread that runs generations, first come first served, from a bounded queue.

    ``queue_size``: requests that may wait while one runs; the next one gets QueueFull.
    """

    def __init__(self, generator: Generator, queue_size: int) -> None:
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 0:
            raise ValueError(f"queue_size must be an integer >= 0; got {queue_size!r}")
        self.generator = generator
        self.queue_size = queue_size
        self._pending: deque[Job] = deque()
        # Prefill-ahead jobs wait apart and run only when no generation waits: a real request always
        # goes first. Bounded like the queue; a newer partial transcript pushes out the oldest.
        self._prefills: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False  # shutting down: refuse new jobs, finish (or cut) the running one
        # The latest prefill-ahead per cache namespace, until a generation runs under that namespace:
        # (its name, its prompt). Only the worker thread reads and writes it.
        self._prefilled: dict[str | None, tuple[str, list[int]]] = {}
        # The latest finished jobs, newest last (their times and outcomes: the preemptive bench reads them).
        self.finished: deque[Job] = deque(maxlen=256)
        # Counters for /health; only ever incremented, under _cond.
        self.counters = {"admitted": 0, "completed": 0, "cancelled": 0, "rejected": 0, "failed": 0}

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._serve, name="specedge-worker", daemon=True)
            self._thread.start()

    def drain(self) -> None:
        """Begin a graceful shutdown: refuse new jobs, answer every waiting one with ShuttingDown.

        The running job keeps going; ``cut_running()`` stops it (inside its forward on CPU).
        """
        with self._cond:
            self._draining = True
            waiting = list(self._pending)
            self._pending.clear()
            self.counters["cancelled"] += len(waiting)
        for job in waiting:
            job._cancel()
            job._emit("error", ShuttingDown("the server is shutting down; this request was not started"))

    def cut_running(self) -> None:
        """Stop the running job now (the end of the shutdown grace period): inside its forward on CPU.

        Its client still gets what was generated, with finish_reason "length".
        """
        with self._cond:
            job = self._running
        if job is not None:
            job._cancel()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is running, refuse what waits, and join the thread."""
        with self._cond:
            self._stopping = True
            waiting = list(self._pending)
            self._pending.clear()
            if self._running is not None:
                self._running._cancel()
            self._cond.notify_all()
            thread = self._thread
        for job in waiting:
            job._cancel()
            job._emit("error", ShuttingDown("the server is shutting down; this request was not started"))
        if thread is not None:
            thread.join(timeout)

    # ----------------------------------------------------------------- requests
    def submit(self, job: Job) -> None:
        """Queue a job behind the ones already waiting; raise QueueFull when every slot is taken."""
        self.start()
        with self._cond:
            if self._draining or self._stopping:
                raise ShuttingDown("the server is shutting down")
            # Count the running job too, so the moment the worker takes a job from the
            # queue (under this lock) never changes whether the next request fits.
            admitted = len(self._pending) + (self._running is not None)
            if admitted >= self.queue_size + 1:
                self.counters["rejected"] += 1
                raise QueueFull(f"{len(self._pending)} requests are already waiting (queue size {self.queue_size})")
            self.counters["admitted"] += 1
            self._pending.append(job)
            self._cond.notify()

    def submit_prefill(self, job: Job) -> None:
        """Queue a prefill-ahead job behind every generation; the oldest waiting prefill is dropped
        when ``queue_size`` of them wait (it would only fill a slot a newer one refills)."""
        self.start()
        with self._cond:
            if self._draining or self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._prefills) >= max(self.queue_size, 1):
                self._prefills.popleft()
                self.counters["cancelled"] += 1
            self._prefills.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client left: free its slot now if it waits, stop its forward in progress if it runs.

        A no-op for a job that already finished.
        """
        with self._cond:
            try:
                self._pending.remove(job)
                self.counters["cancelled"] += 1
                self._finished(job, "cancelled")
            except ValueError:
                pass  # running or finished: the worker counts it
        job._cancel()

    def status(self) -> dict:
        with self._cond:
            return {"busy": self._running is not None, "waiting": len(self._pending),
                    "waiting_prefills": len(self._prefills), "draining": self._draining,
                    "queue_size": self.queue_size, **self.counters}

    # ----------------------------------------------------------------- the thread
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._prefills and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._pending.popleft() if self._pending else self._prefills.popleft()
                self._running = job
            outcome = "failed"
            try:
                outcome = self._run(job)
            except BaseException as exc:  # noqa: BLE001 - escaped _run's own handling: answer it, serve the next
                # The thread must outlive any one job: were it to end here, every queued and later
                # request would wait forever. Its client gets a 500 unless it was already answered.
                log.exception("job %s failed outside its handler", job.name)
                if not job._answered:
                    job._emit("error", exc)
            finally:
                with self._cond:
                    self._running = None
                    self.counters[outcome] += 1
                    self._finished(job, outcome)

    def _finished(self, job: Job, outcome: str) -> None:
        """Record a job the worker is done with (under _cond)."""
        job.finished_at, job.outcome = time.perf_counter(), outcome
        self.finished.append(job)

    def _run(self, job: Job) -> str:
        """Generate one job, streaming its deltas; return the counter it lands in."""
        job.started_at = time.perf_counter()
        if job.cancelled:
            if self._draining:  # cut by a shutdown before its first step: its client is still waiting
                job._emit("error", ShuttingDown("the server is shutting down; this request was not started"))
            return "cancelled"
        if job.prefill:
            return self._run_prefill(job)
        self._check_prefill(job)
        try:
            stream = self.generator.stream(input_ids=job.prompt_ids, config=job.config)
            job._stream = stream
            if job.cancelled:  # cancel() ran between the check above and the assignment
                stream.cancel()
            for delta in stream:
                if not job._emit("delta", delta):
                    stream.cancel()
            result = job.result = stream.result
        except Exception as exc:  # reported to its client; the worker serves the next job
            if isinstance(exc, SpecedgeError):  # a typed failure (corrupt weights...): one line, no traceback
                log.error("generation %s failed: %s", job.name, exc)
            else:
                log.exception("generation %s failed", job.name)
            job._emit("error", exc)
            return "failed"
        job._emit("done", result)
        if result.finish_reason == "cancelled":
            log.info("%s cancelled after %d tokens (client disconnected)", job.name, len(result.token_ids))
            return "cancelled"
        s = result.stats
        log.info("%s: %d+%d tokens, queue %.0f ms, TTFT %.0f ms, %.1f tok/s, drafter %s, acceptance %.2f",
                 job.name, len(result.prompt_ids), len(result.token_ids), job.queue_s * 1e3,
                 s.time_to_first_token_s * 1e3, s.tokens_per_s, s.drafter, s.acceptance)
        return "completed"

    def _run_prefill(self, job: Job) -> str:
        try:
            report = self.generator.prefill(input_ids=job.prompt_ids, config=job.config)
        except Exception as exc:  # nobody waits on a prefill: log it, serve the next job
            log.error("prefill %s failed: %s", job.name, exc)
            job._emit("error", exc)
            return "failed"
        log.info("%s: prefilled %d tokens (%d reused) in %.0f ms", job.name, report["computed_tokens"],
                 report["reused_tokens"], report["seconds"] * 1e3)
        if job.config.reuse_prefix:
            self._prefilled[job.config.cache_salt] = (job.name, job.prompt_ids)
        job._emit("done", report)
        return "completed"

    def _check_prefill(self, job: Job) -> None:
        """Warn when the namespace's latest prefill shares less than half its tokens with this request.

        A prefill pays only for what the request then shares with it; a recipe that prefills other
        messages than the framework sends (no system prompt, another model id's template...) shares a
        few tokens, fills a slot for nothing and leaves TTFT unchanged, silently. With several
        conversations under one namespace (one key, no cache_salt), another caller's request can
        come between a prefill and its own request and draw this warning too.
        """
        latest = self._prefilled.pop(job.config.cache_salt, None)
        if latest is None or not job.config.reuse_prefix:
            return
        name, prefilled = latest
        shared = common_prefix(prefilled, job.prompt_ids)
        if 2 * shared < len(prefilled):
            log.warning("prefill %s shared only %d of its %d tokens with the next request %s (%d prompt tokens), "
                        "so it saved that request nothing: does the prefill send the same messages as the "
                        "request, system prompt included (specedge.client builds them from the framework's "
                        "own context)?", name, shared, len(prefilled), job.name, len(job.prompt_ids))
