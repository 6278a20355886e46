"""Explain where two greedy runs of the same target part ways.

Floating point is not batch-invariant: a (k+1)-token verify can pick a different
argmax than a 1-token step where the target's top two logits nearly tie. With the
default batch-invariant steps (engines/invariant.py) plain steps and verify rows
compute the same bits, so greedy outputs are identical on every precision; with 1-row
steps (``GenerationConfig(exact=False)``) a divergence occurs at such a near tie. This
module finds the first divergence and measures the target's top-2 logit gap there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .verify import NEAR_TIE_GAP


@dataclass(frozen=True)
class Divergence:
    index: int  # first position (in new tokens) where the runs differ
    tokens: tuple[int, int]  # (baseline token, other token) there
    top2_gap: float  # target's top-1 minus top-2 logit at that position, from a plain prefill
    near_tie: bool  # top2_gap < threshold
    threshold: float = NEAR_TIE_GAP

    def as_dict(self) -> dict:
        return {"index": self.index, "tokens": list(self.tokens), "top2_gap": self.top2_gap,
                "near_tie": self.near_tie, "threshold": self.threshold}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, len of the shorter if one is a prefix, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def explain(target, prompt_ids: Sequence[int], baseline: Sequence[int], other: Sequence[int],
            near_tie: float = NEAR_TIE_GAP) -> Divergence | None:
    """Measure the target's top-2 gap at the first divergence of ``other`` from ``baseline``.

    ``near_tie``: the bundle's threshold (``Generator.near_tie_gap``)."""
    i = first_divergence(baseline, other)
    if i is None or i >= min(len(baseline), len(other)):
        return None
    kv = target.new_cache()
    prefix = np.asarray(list(prompt_ids) + list(baseline[:i]), np.int64)
    logits = np.asarray(target.forward(prefix, kv, num_logits=1)[-1], np.float64)
    top2 = np.partition(logits, logits.shape[-1] - 2)[-2:]
    gap = float(top2[1] - top2[0])
    return Divergence(i, (int(baseline[i]), int(other[i])), gap, gap < near_tie, near_tie)
