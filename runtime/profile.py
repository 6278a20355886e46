"""Step-cost profiles on disk: which machine a profile belongs to, and where it is kept.

The measurement itself is :func:`specedge.runtime.costs.measure`.

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
from pathlib import Path

from ..manifest import COST_PROFILE_KEY, MANIFEST_FILE

PROFILE_KEY = COST_PROFILE_KEY  # defined once, with the manifest schema that validates it


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
