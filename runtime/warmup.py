"""Warm-up and tuning: what a Generator does once, before serving, so the first request pays no
session setup and the draft-length policies price steps with this machine's measured costs.

Both run under the Generator's lock (it calls them); neither generates text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..bundle.extra import CostProfile
from ..engines.base import Engine, KVCache
from ..engines.invariant import BatchInvariantEngine
from . import costs as step_costs
from .memory import SpeculationMemory
from .profile import save as save_profile


def warm_ids(vocab_size: int, max_context: int, max_draft_tokens: int) -> list[int]:
    """The token ids warm-up feeds: k+1 ids (k = ``max_draft_tokens``), fewer when max_context is
    too small for k+1 more positions after them."""
    k = max_draft_tokens
    return [int(t) % vocab_size for t in range(min(k + 1, max_context - k - 2))]


def warm_sessions(target: BatchInvariantEngine, draft: Engine | None, target_kv: KVCache, draft_kv: KVCache | None,
                  ids: list[int], max_draft_tokens: int) -> None:
    """Run every session shape once on the given caches (reset first; their contents are scratch
    afterwards): the prefill of ``ids``, a 1-token step, fast mode's 1-row plain step on the bare
    target, and a k+1-row verify."""
    k = max_draft_tokens
    for engine, cache in ((target, target_kv), (draft, draft_kv)):
        if engine is None:
            continue
        cache.reset()
        engine.forward(np.asarray(ids, np.int64), cache, 1)
        engine.forward(np.asarray(ids[:1], np.int64), cache, 1)
        if engine is target:  # fast mode's plain step: the bare engine's 1-row shape
            target.inner.forward(np.asarray(ids[:1], np.int64), cache, 1)
        engine.forward(np.asarray(ids[: k + 1], np.int64), cache, k + 1)


def tune(target: BatchInvariantEngine, draft: Engine | None, memory: SpeculationMemory, *, threads: int,
         context: int, max_draft_tokens: int, bundle: Path | None = None) -> CostProfile:
    """Measure the step costs (target 1..max_draft_tokens+1 rows, draft 1) at ``context`` positions
    and make ``memory`` use them; with ``bundle``, also record them in its manifest."""
    profile = step_costs.measure(target, draft, threads=threads, context=context, max_verify=max_draft_tokens + 1)
    memory.use_profile(profile)
    if bundle is not None:
        save_profile(bundle, profile)
    return profile
