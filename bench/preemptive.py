"""The preemptive-generation benchmark: a voice-agent call whose every turn sends cancelled requests first.

LiveKit's preemptive generation (on by default) and Pipecat's eager end of turn start an LLM
request on an interim transcript and cancel it when the transcript grows; the final request
follows. This bench replays ``bench/prompts/conversation.json`` that way, through the server, as
its users meet it: each configuration is its own Generator behind its own ``create_app`` on a
loopback port (uvicorn on a thread, the real worker, streaming over HTTP), and a cancel is the
client closing the connection.

Configurations, interleaved turn by turn (so machine noise hits each alike):
- ``cold``: the final request alone, ``reuse_prefix`` off (every turn prefills the whole history);
- ``single``: the final request alone (the conversation's slot reused);
- ``preemptive``: up to ``attempts`` requests, the i-th with the first i/(attempts+1) of the
  user's words, each cancelled ``cancel_after_s`` (uniform, seeded) after it was sent, or after
  ``cancel_after_blocks`` streamed deltas; then the final request.

Reported per turn: the final request's time to first token (send to first content byte), its
reused prompt tokens (``usage.prompt_tokens_details.cached_tokens``); per cancelled attempt, the
time from the close to the worker being done with it (0 for one still queued: it never ran) and
the worker seconds it took (wasted compute). A cancel stops the forward in progress (engines/base.py
Interrupt), a prefill included, so the worker is free within about one graph node of the close.

The final request's goal is one target step plus the prefill of its new (uncached) tokens: a
cancelled attempt may hold the worker for at most a step, and what the attempts prefilled is reused.
:class:`BoundTimer` times both on the preemptive server's own target session right after each turn
(the same machine load), and the report gives TTFT / bound with the final request's queue wait and
in-worker prefill.

Replies: fast mode (the default) may part ways only at a near tie, and a prefix reused from a slot is
computed in other splits than a cold prefill. Where a configuration's final reply differs from the cold
one's on the same prompt, the report gives the target's top-2 logit gap at the first differing token
against the bundle's near-tie bound (runtime/divergence.py); one that is not a near tie is a wrong reply.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidParameterError
from ..runtime.divergence import Divergence, explain
from ..runtime.slots import common_prefix
from .conversation import Conversation

CONFIGS = ("cold", "single", "preemptive")
MAX_ATTEMPTS = 3  # LiveKit's retries per user turn
MODEL = "bench"  # the model id the bench's servers answer to


@dataclass(frozen=True)
class CancelPlan:
    """When each preemptive attempt is cancelled."""

    attempts: int = 3  # cancelled requests before the final one (0..MAX_ATTEMPTS)
    after_s: tuple[float, float] = (0.15, 0.40)  # cancel this long after sending (uniform in the range)
    after_blocks: int | None = None  # instead: after this many streamed deltas (deterministic)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.attempts <= MAX_ATTEMPTS:
            raise InvalidParameterError(f"attempts must be in 0..{MAX_ATTEMPTS}; got {self.attempts}")
        if not 0 <= self.after_s[0] <= self.after_s[1]:
            raise InvalidParameterError(f"cancel_after_s must be a range low <= high; got {self.after_s}")
        if self.after_blocks is not None and self.after_blocks < 0:
            raise InvalidParameterError(f"cancel_after_blocks must be >= 0; got {self.after_blocks}")


def attempt_texts(final: str, attempts: int) -> list[str]:
    """The interim transcripts of ``final``: the i-th keeps the first i/(attempts+1) of its words (>= 1)."""
    words = final.split()
    return [" ".join(words[:max(1, len(words) * i // (attempts + 1))]) for i in range(1, attempts + 1)]


# ----------------------------------------------------------------------------- the server and its client
class LocalServer:
    """``create_app(generator)`` behind uvicorn on a free loopback port, on a background thread."""

    def __init__(self, generator) -> None:
        import uvicorn

        from ..server.app import create_app

        self.generator = generator
        self.app = create_app(generator, warmup=False, max_tokens=None, model_name=MODEL)
        self.worker = self.app.state.worker
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the bench's uvicorn server did not start")
            time.sleep(0.01)

    def job(self, messages: list[dict], since: float, timeout: float = 5.0):
        """The worker's finished job for ``messages`` enqueued after ``since`` (perf_counter), or None
        when none reaches the worker within ``timeout`` (a client that left before the server had read
        and parsed its request: the request id never came back, so jobs are found by prompt)."""
        ids = self.generator.encode_prompt(messages=messages)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for job in reversed(self.worker.finished):
                if job.prompt_ids == ids and job.enqueued_at >= since:
                    return job
            time.sleep(0.001)
        return None

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@dataclass
class StreamRun:
    """One streamed chat request as its client saw it (perf_counter times)."""

    request_id: str = ""
    sent_at: float = 0.0
    first_token_at: float | None = None
    closed_at: float | None = None  # when the client closed it early (a cancel)
    deltas: int = 0
    text: str = ""
    usage: dict = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


def stream_chat(port: int, body: dict, *, cancel_at: float | None = None,
                cancel_after_deltas: int | None = None) -> StreamRun:
    """POST /v1/chat/completions with ``stream`` on, reading server-sent events; close the connection
    at ``cancel_at`` (perf_counter) or after ``cancel_after_deltas`` content deltas (0: at once,
    once the response has started)."""
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    run = StreamRun()
    sock = socket.create_connection(("127.0.0.1", port))
    run.sent_at = time.perf_counter()
    sock.sendall(head + payload)
    raw, events, headers_done, cancelled = b"", b"", False, True
    try:
        while True:
            if cancel_at is not None:
                left = cancel_at - time.perf_counter()
                if left <= 0:
                    break
                sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except socket.timeout:
                break
            if not data:
                cancelled = False
                return run
            raw += data
            if not headers_done:
                if b"\r\n\r\n" not in raw:
                    continue
                header, raw = raw.split(b"\r\n\r\n", 1)
                headers_done = True
                status = header.split(b"\r\n", 1)[0].decode("latin-1")
                if status.split()[1] != "200":
                    raise RuntimeError(f"the server answered {status}: {raw[:300]!r}")
                for line in header.split(b"\r\n")[1:]:
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "x-request-id":
                        run.request_id = value.strip()
                if cancel_after_deltas == 0:
                    break
            while b"\r\n" in raw:  # chunked transfer encoding: size line, data, CRLF
                size_line, rest = raw.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                if len(rest) < size + 2:
                    break
                events += rest[:size]
                raw = rest[size + 2:]
                if size == 0:  # the end of the body: its events are parsed below
                    break
            while b"\n\n" in events:
                event, events = events.split(b"\n\n", 1)
                data_line = event.decode("utf-8").removeprefix("data: ")
                if data_line == "[DONE]":
                    cancelled = False
                    return run
                chunk = json.loads(data_line)
                if "error" in chunk:
                    raise RuntimeError(f"the server answered an error: {chunk['error']}")
                if chunk.get("usage"):
                    run.usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        run.first_token_at = run.first_token_at or time.perf_counter()
                        run.text += text
                        run.deltas += 1
                if cancel_after_deltas is not None and run.deltas >= cancel_after_deltas:
                    return run
        return run
    finally:
        sock.close()  # before [DONE]: the client cancels (the server sees the disconnect)
        if cancelled:
            run.closed_at = time.perf_counter()


# ----------------------------------------------------------------------------- the call
@dataclass
class AttemptRecord:
    ran: bool  # the worker started it (else it was cancelled while queued)
    free_s: float  # from the client's close to the worker being done with it (0 if it never ran)
    worker_s: float  # worker seconds it took (wasted compute; 0 if it never ran)


@dataclass
class TurnBound:
    """The final request's TTFT goal, from quantities measured in the same run (:class:`BoundTimer`):
    one target step at the turn's context plus the prefill of its new (uncached) tokens."""

    new_tokens: int  # prompt tokens the final request did not find cached
    step_s: float  # the target's 1-row step at the prompt's length (median of STEP_REPEATS)
    prefill_s: float  # the target's forward of those new tokens on the cached prefix (median of STEP_REPEATS)

    @property
    def bound_s(self) -> float:
        return self.step_s + self.prefill_s


@dataclass
class PreemptiveTurn:
    config: str
    turn: int
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float
    reply: str
    attempts: list[AttemptRecord] = field(default_factory=list)
    queue_s: float | None = None  # the final request's wait for the worker (a cancelled attempt still running)
    server_prefill_s: float | None = None  # the final request's prefill inside the worker (its stats)
    bound: TurnBound | None = None  # preemptive turns: timed right after the turn (BoundTimer)
    prompt_ids: list[int] = field(default_factory=list, repr=False)  # the final request's (not reported)
    reply_ids: list[int] = field(default_factory=list, repr=False)  # its reply's tokens (not reported)


@dataclass(frozen=True)
class ReplyDivergence:
    """A turn whose final reply in ``config`` differs from the cold configuration's, on the same prompt.
    Fast mode (the default) may part ways at a near tie: a prefix reused from a slot is computed in other
    splits than a cold prefill, and the target's top-2 logits there are within the bundle's bound."""

    turn: int
    config: str
    divergence: Divergence

    def as_dict(self) -> dict:
        return {"turn": self.turn, "config": self.config, **self.divergence.as_dict()}


@dataclass
class PreemptiveReport:
    turns: list[PreemptiveTurn] = field(default_factory=list)
    identical: bool = True  # the final replies are the same text in every configuration
    # Where they are not, on the same prompt as the cold configuration's: the top-2 gap there.
    divergences: list[ReplyDivergence] = field(default_factory=list)
    # Turns whose prompt already differs from the cold one's (an earlier reply differed): not compared.
    uncompared: int = 0

    @property
    def near_ties_only(self) -> bool:
        """Every difference from the cold replies is a near tie (none is a wrong reply)."""
        return all(d.divergence.near_tie for d in self.divergences)

    def summary(self) -> dict:
        out = {}
        for config in dict.fromkeys(t.config for t in self.turns):
            rows = [t for t in self.turns if t.config == config]
            attempts = [a for t in rows for a in t.attempts]
            ran = [a for a in attempts if a.ran]
            out[config] = {
                "ttft_p50_s": statistics.median(t.ttft_s for t in rows),
                "ttft_later_p50_s": statistics.median([t.ttft_s for t in rows if t.turn > 0] or [rows[0].ttft_s]),
                "reused_tokens": sum(t.reused_tokens for t in rows),
                "prompt_tokens": sum(t.prompt_tokens for t in rows),
                "min_reused_fraction": min(t.reused_tokens / t.prompt_tokens for t in rows),
                "attempts": len(attempts), "attempts_run": len(ran),
                "cancel_to_free_p50_s": statistics.median(a.free_s for a in ran) if ran else None,
                "cancel_to_free_p90_s": _quantile([a.free_s for a in ran], 0.9) if ran else None,
                "cancel_to_free_max_s": max(a.free_s for a in ran) if ran else None,
                "wasted_worker_s": sum(a.worker_s for a in ran),
                "wasted_worker_per_turn_p50_s": statistics.median(sum(a.worker_s for a in t.attempts) for t in rows),
            }
            bounded = [t for t in rows if t.bound is not None]
            if bounded:
                out[config].update({
                    "target_step_p50_s": statistics.median(t.bound.step_s for t in bounded),
                    "turns_within_bound": sum(t.ttft_s <= t.bound.bound_s for t in bounded),
                    "turns_bounded": len(bounded),
                    "ttft_over_bound_p50": statistics.median(t.ttft_s / t.bound.bound_s for t in bounded),
                    "ttft_over_bound_max": max(t.ttft_s / t.bound.bound_s for t in bounded)})
        return out

    def to_json(self) -> dict:
        def turn(t: PreemptiveTurn) -> dict:
            row = {k: v for k, v in t.__dict__.items() if k not in ("prompt_ids", "bound")}
            row["attempts"] = [a.__dict__ for a in t.attempts]
            if t.bound is not None:
                row["bound"] = {**t.bound.__dict__, "bound_s": t.bound.bound_s}
            return row

        return {"identical": self.identical, "near_ties_only": self.near_ties_only,
                "divergences": [d.as_dict() for d in self.divergences], "uncompared_turns": self.uncompared,
                "summary": self.summary(), "turns": [turn(t) for t in self.turns]}


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


STEP_REPEATS = 5  # timings per quantity; the median is kept (the box is shared: one run can be slowed)
# A prefill this long (a cold turn's) is timed once: noise is a small part of it, and repeating it would
# cost the bench seconds per turn.
LONG_PREFILL_S = 1.0


class BoundTimer:
    """Times a final request's bound on ``generator``'s own target session (fast mode, as the server
    runs it): the prefill of its new tokens onto its cached prefix, and one 1-row step at its prompt's
    length (medians of STEP_REPEATS). Call it between turns, when the worker is idle (every job of the
    turn has finished), so the timings meet the same machine load as the turn just measured. A scratch
    cache holds the conversation: nothing of a slot changes."""

    def __init__(self, generator) -> None:
        self.engine = generator.target.inner
        self.kv = self.engine.new_cache()
        self.held: list[int] = []

    def __call__(self, ids: list[int], reused: int) -> TurnBound:
        engine, kv = self.engine, self.kv
        reused = min(reused, len(ids) - 1)
        keep = min(common_prefix(self.held, ids), reused, kv.length)
        kv.rewind(kv.length - keep)
        if keep < reused:  # the cached prefix itself: untimed
            engine.forward(np.asarray(ids[keep:reused], np.int64), kv)
        new = np.asarray(ids[reused:], np.int64)
        prefill, step = [], []
        for repeat in range(STEP_REPEATS):
            if repeat == 0 or prefill[0] < LONG_PREFILL_S:
                kv.rewind(kv.length - reused)
                start = time.perf_counter()
                engine.forward(new, kv)
                prefill.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.forward(new[-1:], kv)  # any token: a step's cost is its context's
            step.append(time.perf_counter() - start)
            kv.rewind(1)
        self.held = list(ids)
        return TurnBound(len(ids) - reused, statistics.median(step), statistics.median(prefill))


def run_preemptive(servers: dict, conversation: Conversation, *, plan: CancelPlan = CancelPlan(),
                   max_new_tokens: int = 48, progress=None, bounds: bool = True) -> PreemptiveReport:
    """Replay ``conversation`` on each configuration's server (``{config: LocalServer}``), turn by turn.
    ``bounds``: time each preemptive turn's final-TTFT bound (:class:`BoundTimer`) right after it."""
    unknown = set(servers) - set(CONFIGS)
    if unknown:
        raise InvalidParameterError(f"unknown preemptive configuration(s) {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    rng = random.Random(plan.seed)
    report = PreemptiveReport()
    histories = {c: [{"role": "system", "content": conversation.system}] for c in servers}
    timer = BoundTimer(servers["preemptive"].generator) if bounds and "preemptive" in servers else None
    for turn, text in enumerate(conversation.turns):
        replies = set()
        for config, server in servers.items():
            body = {"model": MODEL, "max_tokens": max_new_tokens, "temperature": 0,
                    "specedge": {"reuse_prefix": config != "cold"}}
            cancelled = []
            if config == "preemptive":
                for partial in attempt_texts(text, plan.attempts):
                    sent = time.perf_counter()
                    tried = histories[config] + [{"role": "user", "content": partial}]
                    run = stream_chat(server.port, {**body, "messages": tried},
                                      cancel_at=None if plan.after_blocks is not None else sent + rng.uniform(*plan.after_s),
                                      cancel_after_deltas=plan.after_blocks)
                    cancelled.append((tried, sent, run))
            messages = histories[config] + [{"role": "user", "content": text}]
            final_sent = time.perf_counter()
            final = stream_chat(server.port, {**body, "messages": messages})
            final_job = server.job(messages, final_sent)
            attempts = []
            for tried, sent, run in cancelled:
                job = server.job(tried, sent)
                ran = job is not None and job.started_at is not None
                closed = run.closed_at if run.closed_at is not None else (job.finished_at if ran else 0.0)
                attempts.append(AttemptRecord(ran, max(0.0, job.finished_at - closed) if ran else 0.0,
                                              job.finished_at - job.started_at if ran else 0.0))
            usage = final.usage
            stats = final_job.result.stats if final_job is not None and final_job.result is not None else None
            report.turns.append(PreemptiveTurn(config, turn, usage.get("prompt_tokens", 0),
                                               (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                               final.ttft_s if final.ttft_s is not None else float("nan"),
                                               final.text, attempts,
                                               queue_s=final_job.queue_s if final_job is not None else None,
                                               server_prefill_s=stats.prefill_s if stats is not None else None,
                                               prompt_ids=list(final_job.prompt_ids) if final_job is not None else [],
                                               reply_ids=list(final_job.result.token_ids)
                                               if final_job is not None and final_job.result is not None else []))
            if config == "preemptive" and timer is not None and final_job is not None:  # the worker is idle now
                report.turns[-1].bound = timer(report.turns[-1].prompt_ids, report.turns[-1].reused_tokens)
            replies.add(final.text)
            histories[config] = messages + [{"role": "assistant", "content": final.text}]
            if progress is not None:
                progress(config, turn)
        report.identical &= len(replies) == 1
        if len(replies) > 1:
            _explain_turn(report, servers, turn)
    return report


def _explain_turn(report: PreemptiveReport, servers: dict, turn: int) -> None:
    """Measure where each configuration's reply leaves the cold one's (or, without a cold configuration,
    the first one's), when their prompts are the same: the target's top-2 gap there, against the
    bundle's near-tie bound (runtime/divergence.explain, a plain prefill on the 1-row target)."""
    rows = {t.config: t for t in report.turns if t.turn == turn}
    base_config = "cold" if "cold" in rows else next(iter(rows))
    base = rows[base_config]
    generator = servers[base_config].generator
    for config, row in rows.items():
        if config == base_config or row.reply_ids == base.reply_ids:
            continue
        if row.prompt_ids != base.prompt_ids or not base.prompt_ids:
            report.uncompared += 1
            continue
        found = explain(generator.target.inner, base.prompt_ids, base.reply_ids, row.reply_ids,
                        near_tie=generator.near_tie_gap)
        if found is not None:  # None: one reply is a prefix of the other (a stop or length cut)
            report.divergences.append(ReplyDivergence(turn, config, found))


def format_report(report: PreemptiveReport, plan: CancelPlan) -> str:
    when = (f"after {plan.after_blocks} streamed deltas" if plan.after_blocks is not None
            else f"{plan.after_s[0] * 1e3:.0f}-{plan.after_s[1] * 1e3:.0f} ms after sending")
    lines = [f"preemptive: {plan.attempts} cancelled request(s) per turn, each cancelled {when}, then the final one",
             "", "| config | final TTFT p50 | later turns p50 | reused / prompt tokens | worst turn reused | "
             "attempts run / sent | cancel to free p50 / p90 / max | wasted worker s (total, p50 per turn) |",
             "|---|---|---|---|---|---|---|---|"]
    for config, row in report.summary().items():
        free = ("" if row["cancel_to_free_p50_s"] is None else
                f"{row['cancel_to_free_p50_s'] * 1e3:.0f} / {row['cancel_to_free_p90_s'] * 1e3:.0f} / "
                f"{row['cancel_to_free_max_s'] * 1e3:.0f} ms")
        lines.append(f"| {config} | {row['ttft_p50_s'] * 1e3:.0f} ms | {row['ttft_later_p50_s'] * 1e3:.0f} ms | "
                     f"{row['reused_tokens']} / {row['prompt_tokens']} | {row['min_reused_fraction']:.0%} | "
                     f"{row['attempts_run']} / {row['attempts']} | {free} | "
                     f"{row['wasted_worker_s']:.2f}, {row['wasted_worker_per_turn_p50_s']:.2f} |")
    lines += ["", "per turn: final TTFT ms (reused/prompt tokens)", ""]
    configs = list(report.summary())
    lines += ["| turn | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
    for turn in sorted({t.turn for t in report.turns}):
        cells = {t.config: f"{t.ttft_s * 1e3:.0f} ({t.reused_tokens}/{t.prompt_tokens})"
                 for t in report.turns if t.turn == turn}
        lines.append(f"| {turn + 1} | " + " | ".join(cells.get(c, "") for c in configs) + " |")
    bounded = [t for t in report.turns if t.bound is not None]
    if bounded:
        met = sum(t.ttft_s <= t.bound.bound_s for t in bounded)
        lines += ["", "final-TTFT bound (1 target step + prefill of the new tokens, both timed on the same target "
                  f"session right after the turn): {met} of {len(bounded)} {bounded[0].config} turns within it", "",
                  "| turn | new tokens | step ms | prefill ms (tok/s) | bound ms | final TTFT ms | queue ms | "
                  "server prefill ms | TTFT / bound |", "|---|---|---|---|---|---|---|---|---|"]
        for t in bounded:
            b = t.bound
            rate = b.new_tokens / b.prefill_s if b.prefill_s > 0 else float("nan")
            queue = "" if t.queue_s is None else f"{t.queue_s * 1e3:.0f}"
            server = "" if t.server_prefill_s is None else f"{t.server_prefill_s * 1e3:.0f}"
            lines.append(f"| {t.turn + 1} | {b.new_tokens} | {b.step_s * 1e3:.0f} | {b.prefill_s * 1e3:.0f} "
                         f"({rate:.0f}) | {b.bound_s * 1e3:.0f} | {t.ttft_s * 1e3:.0f} | {queue} | {server} | "
                         f"{t.ttft_s / b.bound_s:.2f} |")
    lines += ["", "final replies identical across configurations: " + ("yes" if report.identical else "no")]
    for d in report.divergences:
        g = d.divergence
        lines.append(f"- turn {d.turn + 1}, {d.config}: parts from the cold reply at token {g.index}, where the "
                     f"target's top-2 logits are {g.top2_gap:.3g} apart: "
                     + (f"a near tie (bound {g.threshold:.3g})" if g.near_tie
                        else f"NOT a near tie (bound {g.threshold:.3g}): a wrong reply, please report it"))
    if report.uncompared:
        lines.append(f"- {report.uncompared} later reply(ies) not compared: their history already holds a differing reply")
    return "\n".join(lines)
