"""How long a streamed delta takes from the server's worker to its client, per interpreter switch interval.

    python docs/results/2026-12-08-stream-handoff.py BUNDLE [ROUNDS] [INTERVALS_MS...]
    python docs/results/2026-12-08-stream-handoff.py /work/bundles/smollm2-self-int4 3 5 1 0.5 0.2

One process, as the preemptive bench runs it: the bundle behind ``create_app`` on a loopback uvicorn
(bench/preemptive.py LocalServer), the bench's 10-turn voice call (bench/prompts/conversation.json) sent
turn by turn with its reused prefix, streamed, 48 tokens a reply. Each round runs the call once per
switch interval (interleaved, so machine noise hits each alike; a ``cache_salt`` per call keeps every
call's first turn cold, and the prompts, so the replies, are the same for every interval; reply memory
is off, so no call drafts from an earlier call's replies). Per interval,
medians over every later turn (reused prefix): the worker's emit of the first delta to the client
reading it, time to first token, and the time per reply token after the first, at the client. The server sets HANDOFF_SWITCH_INTERVAL_S while it serves; this script overrides it
after the server has started.
"""
import statistics
import sys
import time

from specedge.bench.conversation import load_conversation
from specedge.bench.preemptive import MODEL, LocalServer, stream_chat
from specedge.runtime.generator import Generator
from specedge.server import worker

bundle = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
intervals = [float(x) / 1e3 for x in sys.argv[3:]] or [0.005, 0.001, 0.0005, 0.0002]

first_emit: dict[int, float] = {}
emit = worker.Job._emit


def timed_emit(job, kind, value):
    if kind == "delta":
        first_emit.setdefault(id(job), time.perf_counter())
    return emit(job, kind, value)


worker.Job._emit = timed_emit
gen = Generator.from_bundle(bundle, threads=2)
gen.warmup()
server = LocalServer(gen)
conversation = load_conversation()
rows: dict[float, list[tuple[float, float, float]]] = {s: [] for s in intervals}
for rnd in range(rounds):
    for interval in intervals:
        sys.setswitchinterval(interval)
        history = [{"role": "system", "content": conversation.system}]
        for turn, text in enumerate(conversation.turns):
            messages = history + [{"role": "user", "content": text}]
            sent = time.perf_counter()
            run = stream_chat(server.port, {"model": MODEL, "max_tokens": 48, "temperature": 0,
                                            "messages": messages, "cache_salt": f"{rnd}-{interval}",
                                            "specedge": {"reply_memory": False}})
            done = time.perf_counter()
            job = server.job(messages, sent)
            tokens = len(job.result.token_ids)
            if turn and tokens > 1:
                rows[interval].append(((run.first_token_at - first_emit[id(job)]) * 1e3, run.ttft_s * 1e3,
                                       (done - run.first_token_at) * 1e3 / (tokens - 1)))
            history = messages + [{"role": "assistant", "content": run.text}]
server.close()
print(f"{bundle}: {rounds} rounds x {len(conversation.turns) - 1} reused-prefix turns per interval (medians)")
print("switch interval | worker emit -> client | time to first token | per later token at the client")
for interval, values in rows.items():
    emit_ms, ttft_ms, token_ms = (statistics.median(v[i] for v in values) for i in range(3))
    print(f"{interval * 1e3:13.1f} ms | {emit_ms:18.1f} ms | {ttft_ms:16.1f} ms | {token_ms:26.2f} ms")
