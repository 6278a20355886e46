"""One peer runtime in its own process: ``python -m specedge.bench.peer_worker``.

The parent (bench/peers.py, :class:`PeerProcess`) writes JSON lines to stdin and reads one
JSON line back per request:

1. ``{"peer", "bundle", "threads", "peer_options", "warmup"}`` -> ``{"configs", "info", "notes"}``
   once the peer is loaded and warmed up, or ``{"skipped": why}`` / ``{"error": what}``;
2. ``{"job", "config", "n"}`` -> ``{"tokens", "times"}`` (token ids and their arrival times);
3. end of input: exit.

The protocol owns the real stdout; the peer libraries' own prints go to stderr, which the
parent keeps to explain a crash. Nothing here changes the peer's environment.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _job(obj: dict):
    from .peers import Job

    return Job(obj["workload"], obj["category"], [int(t) for t in obj["prompt_ids"]], int(obj["max_new_tokens"]),
               [int(t) for t in obj["reference"]])


class _StderrLog:
    enabled = False

    def note(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)


def main() -> int:
    # Keep the protocol channel to ourselves: fd 1 now writes to stderr for any library print.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    from ..bundle.manifest import load_manifest
    from .peers import SETUPS, PeerContext, PeerSkipped

    first = sys.stdin.readline()
    if not first:
        return 0
    init = json.loads(first)
    try:
        ctx = PeerContext(int(init["threads"]), init["peer_options"],
                          load_manifest(Path(init["bundle"]), verify_checksums=False))
        session = SETUPS[init["peer"]](ctx, _StderrLog())
        warmup = _job(init["warmup"])
        for config in session.configs:  # first-call allocations, thread pools
            session.generate(warmup, config, min(8, warmup.max_new_tokens))
    except PeerSkipped as exc:
        reply({"skipped": str(exc)})
        return 0
    except Exception as exc:  # reported by the parent as a failed peer
        reply({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        return 0
    reply({"configs": session.configs, "info": session.info, "notes": session.notes})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            run = session.generate(_job(request["job"]), request["config"], int(request["n"]))
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        reply({"tokens": [int(t) for t in run.tokens], "times": [float(t) for t in run.token_times_s]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
