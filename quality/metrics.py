"""Perplexity, top-1 agreement and KL divergence from logits: the arithmetic of ``specedge eval``.

A chunk of n token ids is scored teacher-forced: the logits row i (the model's prediction after
tokens 0..i) is scored against token i + 1, for i in 0..n-2; the chunk's first token is context,
never predicted. Perplexity = exp(mean negative log-likelihood) over every predicted position,
computed in float64 from a log-softmax of the logits. Top-1 agreement = the share of predicted
positions where the bundle's argmax equals the source's (both scored on the same chunks). KL
divergence = the mean over predicted positions of KL(source || bundle) in nats, the whole
next-token distributions compared (llama.cpp's ``perplexity --kl-divergence`` reports the same):
it is 0 only for the source's own distributions and grows with any departure from them, whichever way
the text's likelihood moves (a perplexity ratio below 1 is a departure too), and unlike top-1 it sees
every probability, not only the first.

numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..bundle.extra import QualityScore
from ..errors import InvalidParameterError

# Rows converted to float64 at once: bounds the temporary to ROW_BLOCK x vocab doubles
# (a 512-row chunk of a 152k vocabulary would otherwise take 620 MB).
ROW_BLOCK = 64


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    """float64 log-softmax of each row (shifted by the row's max for range)."""
    rows = np.asarray(rows, np.float64)
    shifted = rows - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def kl_divergence(source_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per-position KL(source || bundle) in nats, float64 ``[n]`` (>= 0), from two logits arrays ``[n, vocab]``.

    A token the source gives probability 0 (a -inf logit) contributes nothing; one the bundle gives 0 where the
    source does not makes the divergence infinite, as it is."""
    source_logits, logits = np.asarray(source_logits), np.asarray(logits)
    if source_logits.shape != logits.shape or logits.ndim != 2:
        raise InvalidParameterError(f"kl_divergence needs two logits arrays [n, vocab] of one shape; got "
                                    f"{source_logits.shape} and {logits.shape}")
    out = np.empty(len(logits), np.float64)
    for lo in range(0, len(logits), ROW_BLOCK):
        p_log = _log_softmax(source_logits[lo:lo + ROW_BLOCK])
        q_log = _log_softmax(logits[lo:lo + ROW_BLOCK])
        p = np.exp(p_log)
        with np.errstate(invalid="ignore"):  # 0 * (-inf - x): a token the source never emits
            terms = p * (p_log - q_log)
        out[lo:lo + ROW_BLOCK] = np.where(p > 0, terms, 0.0).sum(axis=1)
    return np.maximum(out, 0.0)  # rounding can leave -1e-17 where the two agree


def token_scores(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position negative log-likelihood and argmax.

    ``logits``: float ``[n, vocab]``, row i predicting ``targets[i]``; ``targets``: int ``[n]``.
    Returns ``(nll, top1)``: float64 ``[n]`` (-log softmax(row)[target], >= 0) and int64 ``[n]``
    (the row's argmax; the lowest id on a tie).
    """
    logits = np.asarray(logits)
    targets = np.asarray(targets, np.int64)
    if logits.ndim != 2 or targets.shape != (logits.shape[0],):
        raise InvalidParameterError(f"token_scores needs logits [n, vocab] and targets [n]; got {logits.shape} "
                                    f"and {targets.shape}")
    if targets.size and (targets.min() < 0 or targets.max() >= logits.shape[1]):
        raise InvalidParameterError(f"a target id is outside the vocabulary of {logits.shape[1]}")
    nll = np.empty(len(targets), np.float64)
    for lo in range(0, len(targets), ROW_BLOCK):
        rows = logits[lo:lo + ROW_BLOCK].astype(np.float64)
        peak = rows.max(axis=1)
        log_total = peak + np.log(np.exp(rows - peak[:, None]).sum(axis=1))  # log-sum-exp, shifted for range
        nll[lo:lo + ROW_BLOCK] = log_total - rows[np.arange(len(rows)), targets[lo:lo + ROW_BLOCK]]
    return nll, logits.argmax(axis=1).astype(np.int64)


@dataclass
class Tally:
    """Running sums over predicted positions; :meth:`score` turns them into a QualityScore."""

    positions: int = 0
    nll: float = 0.0  # sum of the bundle's negative log-likelihoods (float64)
    source_nll: float = 0.0  # the source's, on the same positions
    agreed: int = 0  # positions whose argmax equals the source's
    with_source: bool | None = None  # None until the first add
    kl: float = 0.0  # sum of KL(source || bundle) over the positions (nats)

    def add(self, nll: np.ndarray, top1: np.ndarray, source_nll: np.ndarray | None = None,
            source_top1: np.ndarray | None = None, kl: np.ndarray | None = None) -> None:
        """One chunk's scores (arrays from :func:`token_scores`; the source's for the same positions, or None;
        ``kl`` from :func:`kl_divergence`, with the source's)."""
        has_source = source_nll is not None
        if self.with_source is not None and self.with_source != has_source:
            raise InvalidParameterError("every chunk of a tally is scored with the source, or none is")
        self.with_source = has_source
        self.positions += len(nll)
        self.nll += float(np.sum(nll, dtype=np.float64))
        if has_source:
            if len(source_nll) != len(nll) or source_top1 is None or len(source_top1) != len(top1):
                raise InvalidParameterError("the source must be scored on the same positions as the bundle")
            if kl is None or len(kl) != len(nll):
                raise InvalidParameterError("a chunk scored with the source needs its KL divergence per position")
            self.source_nll += float(np.sum(source_nll, dtype=np.float64))
            self.agreed += int(np.count_nonzero(np.asarray(top1) == np.asarray(source_top1)))
            self.kl += float(np.sum(kl, dtype=np.float64))

    def merged(self, other: "Tally") -> "Tally":
        if None not in (self.with_source, other.with_source) and self.with_source != other.with_source:
            raise InvalidParameterError("cannot merge a tally scored with the source and one scored without")
        with_source = self.with_source if self.with_source is not None else other.with_source
        return Tally(self.positions + other.positions, self.nll + other.nll, self.source_nll + other.source_nll,
                     self.agreed + other.agreed, with_source, self.kl + other.kl)

    def score(self) -> QualityScore:
        if self.positions < 1:
            raise InvalidParameterError("no predicted positions to score")
        source = math.exp(self.source_nll / self.positions) if self.with_source else None
        return QualityScore(positions=self.positions, perplexity=math.exp(self.nll / self.positions),
                            source_perplexity=source,
                            top1_agreement=self.agreed / self.positions if self.with_source else None,
                            kl_divergence=self.kl / self.positions if self.with_source else None)
