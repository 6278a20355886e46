"""Pure statistics of the bench: no engines, no I/O, numbers in and numbers out.

Definitions used in every report (and pinned by tests/integration/test_bench.py):

- **Speedup** of a configuration: the median, over rounds, of the pairwise ratio
  ``tok/s(config, round r) / tok/s(baseline, round r)`` for the same prompt. Pairing
  inside a round cancels slow drift of the machine (other tenants, thermal state),
  which a ratio of two medians would not.
- **Inter-token latency, per token**: what a streaming client sees. Tokens arrive at
  ``t_0 <= t_1 <= ...`` (``GenerationStats.token_times_s``); the gap of token i >= 1 is
  ``t_i - t_{i-1}``. The tokens of one speculative block arrive together, so every
  token but the first of a block has gap 0. p50 of this list is often 0 under
  speculation; p95 shows the stalls.
- **Inter-token latency, per block**: the gaps between consecutive *distinct* arrival
  times, i.e. between one block and the next (time per target step, as seen outside).
- **Percentiles**: linear interpolation between closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from ..runtime import costs


def median(values: Iterable[float]) -> float:
    """Median of the values; NaN for an empty input."""
    values = [float(v) for v in values]
    return float(np.median(values)) if values else math.nan


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for an empty input."""
    values = [float(v) for v in values]
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100]; got {q}")
    return float(np.percentile(values, q)) if values else math.nan


def iqr(values: Iterable[float]) -> float:
    """Interquartile range p75 - p25: the spread we report next to a median."""
    values = list(values)
    return percentile(values, 75) - percentile(values, 25) if values else math.nan


def pairwise_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """``numerators[i] / denominators[i]`` for each pair (skipping pairs with a zero denominator)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"pairwise ratios need equal lengths; got {len(numerators)} and {len(denominators)}")
    return [n / d for n, d in zip(numerators, denominators) if d]


def median_pairwise_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """Median of the paired ratios: the speedup estimate that cancels drift between rounds."""
    return median(pairwise_ratios(numerators, denominators))


# ----------------------------------------------------------------------------- latency
def token_gaps(times: Sequence[float]) -> list[float]:
    """Per-token inter-token gaps ``t_i - t_{i-1}`` for i >= 1 (0 inside a block)."""
    return [float(b - a) for a, b in zip(times, times[1:])]


def block_gaps(times: Sequence[float]) -> list[float]:
    """Gaps between consecutive distinct arrival times (one per block after the first)."""
    distinct: list[float] = []
    for t in times:
        if not distinct or t != distinct[-1]:
            distinct.append(float(t))
    return [b - a for a, b in zip(distinct, distinct[1:])]


# ----------------------------------------------------------------------------- the analytical bound
def leviathan_speedup(a: float, k: int, c: float, v: float) -> float:
    """Leviathan et al. (2023), Thm 3.8 with a measured verify cost.

    ``a``: probability that a draft token is accepted (i.i.d. per position);
    ``k``: tokens drafted per step; ``c``: one draft token's time over one target
    1-token step; ``v``: one target step on k+1 tokens over one on 1 token.
    Returns ``(1 - a^(k+1)) / ((1 - a) (k c + v))``, the expected tokens per step
    over the step's cost in target-step units. k = 0 is a plain step (1 / v).
    """
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance a must be in [0, 1]; got {a}")
    return expected_tokens(a, k) / (k * c + v)


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens committed by a step drafting k tokens at i.i.d. acceptance a:
    ``(1 - a^(k+1)) / (1 - a)`` (the runtime's per-position formula with a at every position)."""
    return costs.expected_tokens([a] * k, k)


def predicted_speedup(a: float, k_steps: dict[int, int], c: float, v: dict[int, float]) -> float:
    """Leviathan's bound for a run whose steps drafted various k (adaptive, or k capped at the end).

    ``k_steps``: k -> number of steps (``GenerationStats.k_chosen``); ``v[k]``: verify
    cost of k+1 tokens over a 1-token step (``v[0] == 1``). The prediction is total
    expected tokens over total cost, which for a single k is exactly
    :func:`leviathan_speedup`.
    """
    tokens = cost = 0.0
    for k, n in k_steps.items():
        if n <= 0:
            continue
        tokens += n * expected_tokens(a, k)
        cost += n * (k * c + (v[k] if k else 1.0))
    return tokens / cost if cost else math.nan


def fit_acceptance(drafted_per_position: Sequence[int], accepted_per_position: Sequence[int]) -> float:
    """The i.i.d. per-token acceptance ``a`` that explains the per-position counts.

    Under Leviathan's model a token at draft position i (0-based) is committed with
    probability ``a^(i+1)``, so the expected number accepted is
    ``sum_i drafted[i] a^(i+1)``; we solve that equal to ``sum_i accepted[i]`` by
    bisection. (The plain accepted/drafted ratio is biased low: tokens after the first
    rejection count as drafted but were never given a chance.)
    """
    total_accepted = float(sum(accepted_per_position))
    if not drafted_per_position or sum(drafted_per_position) == 0:
        return math.nan
    if total_accepted <= 0:
        return 0.0
    if total_accepted >= sum(drafted_per_position):
        return 1.0

    def expected(a: float) -> float:
        return sum(d * a ** (i + 1) for i, d in enumerate(drafted_per_position))

    lo, hi = 0.0, 1.0
    for _ in range(60):  # 2^-60: far below any noise in a measured rate
        mid = (lo + hi) / 2
        if expected(mid) < total_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
