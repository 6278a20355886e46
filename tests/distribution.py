"""Shared helpers for distribution tests: sample many seeded runs, compare token histograms."""

from __future__ import annotations

import numpy as np

# chi-square critical values at p = 0.001 for dof 1..15 (a false alarm 1 run in 1000).
CHI2_CRITICAL_P001 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53,
                      36.12, 37.70]


def chi2_homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom for "counts a and b share one distribution"."""
    keep = (a + b) >= 10  # pool sparse bins: the chi-square approximation needs expected counts >= 5
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    if a[-1] + b[-1] == 0:
        a, b = a[:-1], b[:-1]
    table = np.stack([a, b]).astype(float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), len(a) - 1


def token_counts(gen, prompt: list[int], runs: int, vocab: int, positions: int = 3, **kw) -> np.ndarray:
    """int ``[positions, vocab]``: how often each token came at new-token positions 1..positions
    over ``runs`` seeded samples at temperature 1 (position 0 comes from the prefill alone)."""
    counts = np.zeros((positions, vocab), int)
    for seed in range(runs):
        tokens = gen.generate(input_ids=prompt, max_new_tokens=positions + 1, temperature=1.0, seed=seed,
                              **kw).token_ids
        for pos in range(1, positions + 1):
            if pos < len(tokens):
                counts[pos - 1, tokens[pos]] += 1
    return counts


def assert_same_distribution(plain: np.ndarray, other: np.ndarray) -> None:
    """Every position's histogram passes the chi-square homogeneity test at p = 0.001."""
    for pos in range(len(plain)):
        stat, dof = chi2_homogeneity(plain[pos], other[pos])
        assert stat < CHI2_CRITICAL_P001[dof - 1], (pos, stat, dof, plain[pos], other[pos])
