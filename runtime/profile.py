"""Step-cost profiles on disk: which machine a profile belongs to, and where it is kept.

The measurement itself is :func:`specedge.runtime.costs.measure`; the profile's schema (and its one
parser) is :class:`specedge.bundle.extra.CostProfile`, stored under manifest ``extra["cost_profile"]``.

``specedge export --tune`` (or ``specedge tune BUNDLE``) measures them on the
machine that will run the bundle and records them in the manifest, so the
adaptive controller's first steps already run with the right k. A profile
records the machine it was taken on (CPU model, core count, thread setting);
on another machine it is ignored and re-measured.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from ..bundle.extra import CostProfile
from ..bundle.manifest import MANIFEST_FILE, parse_manifest


def save(bundle: Path, profile: CostProfile) -> None:
    """Record the profile in manifest.json (atomically: write a sibling, then rename).

    manifest.json carries no checksum of its own, so adding a field keeps the bundle valid.
    """
    path = Path(bundle) / MANIFEST_FILE
    manifest = parse_manifest(json.loads(path.read_text(encoding="utf-8")))
    updated = replace(manifest, extra=replace(manifest.extra, cost_profile=profile))
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(updated.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def summary(profile: CostProfile) -> dict:
    """c and v(n) ratios, the numbers Leviathan's formula needs."""
    step = profile.target_s[1]  # every profile has the plain step (CostProfile.from_dict checks it)
    out = {"target_step_ms": step * 1e3, "v": {n: s / step for n, s in sorted(profile.target_s.items())}}
    if profile.draft_token_s:
        out["draft_step_ms"] = profile.draft_token_s * 1e3
        out["c"] = profile.draft_token_s / step
    return out
