"""Step-cost profiles: how long a target step of n tokens and a draft step take here.

``specedge export --tune`` (or ``specedge tune BUNDLE``) measures them on the
machine that will run the bundle and records them in the manifest, so the
adaptive controller's first steps already run with the right k. A profile
records the machine it was taken on (CPU model, core count, thread setting);
on another machine it is ignored and re-measured.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from ..manifest import COST_PROFILE_KEY, MANIFEST_FILE

PROFILE_KEY = COST_PROFILE_KEY  # defined once, with the manifest schema that validates it
# 10 timed repeats after 2 warm-up runs: medians over 10 settle within a few % on a noisy
# 2-core box, and the whole profile stays under ~30 s for a 1.5B int4 target.
_REPEATS = 10
_WARMUP = 2
CATCHUP_PROBE_TOKENS = 64  # the default draft window: the catch-up a long prompt actually costs


def machine_fingerprint(threads: int) -> dict:
    """What makes step timings transferable: the CPU model, its core count, the thread setting."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 0, "threads": threads}


def _median_step(engine, kv, ids: np.ndarray, n: int) -> float:
    times = []
    for i in range(_WARMUP + _REPEATS):
        t = time.perf_counter()
        engine.forward(ids[:n], kv, num_logits=n)
        elapsed = time.perf_counter() - t
        kv.rewind(n)
        if i >= _WARMUP:
            times.append(elapsed)
    return float(np.median(times))


def measure(target, draft=None, *, max_verify: int = 9, context: int = 128, threads: int = 0) -> dict:
    """Time target steps of 1..max_verify tokens and a 1-token draft step on a cache of
    ``context`` positions. Returns the JSON-ready profile (seconds)."""
    rng = np.random.default_rng(0)
    out: dict = {"machine": machine_fingerprint(threads), "context": context, "target_s": {}}
    for name, engine in (("target", target), ("draft", draft)):
        if engine is None:
            continue
        kv = engine.new_cache()
        ctx = min(context, kv.capacity - max_verify - 1)
        ids = rng.integers(0, engine.vocab_size, size=ctx + max(max_verify, CATCHUP_PROBE_TOKENS)).astype(np.int64)
        engine.forward(ids[:ctx], kv, num_logits=1)
        if name == "target":
            for n in range(1, max_verify + 1):
                out["target_s"][str(n)] = _median_step(engine, kv, ids[ctx:], n)
        else:
            out["draft_token_s"] = _median_step(engine, kv, ids[ctx:], 1)
            # A catch-up feed (the draft's deferred prefill, bounded by the draft window) costs
            # per token far less than a step: the adaptive controller weighs it against the
            # expected reply length before the first speculative step.
            n = max(min(CATCHUP_PROBE_TOKENS, kv.capacity - ctx - 1), 1)
            out["draft_catchup_token_s"] = _median_step(engine, kv, ids[ctx:], n) / n
    return out


def usable(profile: dict | None, threads: int) -> bool:
    """A profile applies when it was measured on this CPU with the same thread setting."""
    return bool(profile) and profile.get("machine") == machine_fingerprint(threads)


def save(bundle: Path, profile: dict) -> None:
    """Record the profile in manifest.json (atomically: write a sibling, then rename).

    manifest.json carries no checksum of its own, so adding a field keeps the bundle valid.
    """
    path = Path(bundle) / MANIFEST_FILE
    obj = json.loads(path.read_text(encoding="utf-8"))
    obj.setdefault("extra", {})[PROFILE_KEY] = profile
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def summary(profile: dict) -> dict:
    """c and v(n) ratios, the numbers Leviathan's formula needs."""
    t = {int(n): s for n, s in profile.get("target_s", {}).items()}
    step = t.get(1)
    if not step:
        return {}
    out = {"target_step_ms": step * 1e3, "v": {n: s / step for n, s in sorted(t.items())}}
    if profile.get("draft_token_s"):
        out["draft_step_ms"] = profile["draft_token_s"] * 1e3
        out["c"] = profile["draft_token_s"] / step
    return out
