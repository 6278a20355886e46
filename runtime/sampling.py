"""Logit warping shared by the drafter, the verifier and plain decoding.

The same warp (temperature, then top-k, then top-p) is applied to the draft's
and the target's logits, so speculative sampling reproduces exactly the warped
target distribution that plain sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples from softmax(logits / temperature)
    top_k: int = 0  # keep the k most likely tokens; 0 = no limit
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 = no limit
    seed: int | None = None  # None = fresh entropy per generation

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature)
                and self.temperature >= 0):
            raise InvalidParameterError(f"temperature must be a finite number >= 0 (0 = greedy); "
                                        f"got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParameterError(f"top_k must be an integer >= 0 (0 = off); got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidParameterError(f"top_p must be in (0, 1] (1 = off); got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise InvalidParameterError(f"seed must be an integer >= 0 or None; got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Turn logits ``[..., V]`` (any float dtype) into float64 probabilities ``[..., V]``.

    Greedy configs return the point mass on the argmax (ties to the lowest id, like np.argmax).
    float64 keeps the rejection ratios p_target/p_draft exact enough for chi-square tests.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if config.greedy:
        probs = np.zeros_like(logits)
        np.put_along_axis(probs, np.argmax(logits, axis=-1)[..., None], 1.0, axis=-1)
        return probs
    # Shift by the row max *before* dividing: with a tiny temperature logits / temperature overflows
    # to inf, and inf - inf is NaN. Shifted entries are <= 0, so the quotient is at worst -inf (p = 0).
    with np.errstate(over="ignore"):
        z = (logits - np.max(logits, axis=-1, keepdims=True)) / config.temperature
    vocab = z.shape[-1]
    if 0 < config.top_k < vocab:
        kth = np.partition(z, vocab - config.top_k, axis=-1)[..., vocab - config.top_k: vocab - config.top_k + 1]
        z = np.where(z < kth, -np.inf, z)
    z = z - np.max(z, axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if config.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        cumulative = np.cumsum(sorted_p, axis=-1)
        # Keep a token while the mass *before* it is below top_p: the smallest set reaching top_p.
        keep_sorted = (cumulative - sorted_p) < config.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a float64 distribution ``[V]`` (inverse CDF, one uniform)."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[-1] - 1))
