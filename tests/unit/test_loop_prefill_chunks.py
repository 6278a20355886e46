"""Invariant: a prefill runs in PREFILL_CHUNK-token forwards, in order, covering the prompt exactly once,
and only the last one's logits are returned (runtime/loop.py ``prefill``)."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.engines.base import KVCache
from specedge.runtime import loop


class _Recorder:
    """An engine that records each forward's ids and returns a logits row naming the last position."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def forward(self, ids, kv, num_logits=1):
        kv.reserve(len(ids))
        self.calls.append([int(i) for i in ids])
        kv.length += len(ids)
        return np.full((1, 4), float(kv.length - 1), np.float32)


@pytest.mark.parametrize("n, sizes", [(1, [1]), (4, [4]), (5, [4, 1]), (8, [4, 4]), (9, [4, 4, 1]), (11, [4, 4, 3])])
def test_a_prefill_runs_whole_chunks_then_the_rest(n, sizes, monkeypatch):
    monkeypatch.setattr(loop, "PREFILL_CHUNK", 4)
    engine, kv = _Recorder(), KVCache(1, 1, 2, 32)
    kv.length = 3  # a reused prefix: chunks start where the cache ends
    logits = loop.prefill(engine, kv, np.arange(100, 100 + n))
    assert [len(c) for c in engine.calls] == sizes
    assert sum(engine.calls, []) == list(range(100, 100 + n))
    assert kv.length == 3 + n and logits[0, 0] == 3 + n - 1
