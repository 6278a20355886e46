"""Batch-invariant steps: every forward runs at least two rows, so a plain 1-token step and a
row of a (k+1)-token verify go through the same kernels and agree bit for bit.

Why: ONNX Runtime's CPU kernels take a different path for one row than for several. On int4
graphs the one-row MatMulNBits is a GEMV whose int8/fp32 rounding differs from the GEMM used
for M >= 2 (measured up to 1.03 logits apart on SmolLM2-135M int4); the fused attention and
fp32 MatMul differ in the low bits too (~5e-6 on fp32 graphs, AVX2 EPYC). A near tie then
flips, and speculative greedy output stops equalling plain decoding. A row of an M >= 2
forward, by contrast, was bit-identical for every M measured (2..17), logits and K/V alike
(docs/results/2026-12-03-exact-int4.md). So this wrapper never runs one row:

* a 1-token step at cache length P > 0 recomputes the previous token with it: it runs
  ``[token(P-1), token(P)]`` at positions P-1, P. Position P-1's K/V are rewritten with the
  bits they already hold (that row was itself computed in an M >= 2 forward).
* a 1-token forward into an empty cache runs the token twice (positions 0 and 1) and drops
  slot 1: the cache always has room for two positions.
* at least two logit rows are computed (the output layer is a MatMul too) and the ones asked
  for are returned.

The cost is the second row of every plain step: on int4 CPU bundles a 2-row step costs
1.3-1.5x a 1-row step (SmolLM2-135M, AVX2), on fp32 about 1.05x. Speculation's verify steps
(k >= 1) already run >= 2 rows and cost nothing extra. ``Generator`` wraps its target in this
by default; ``GenerationConfig(exact=False)`` runs the bare engine (1-row plain steps).
"""

from __future__ import annotations

import weakref

import numpy as np

from ..errors import ForwardCancelled, InvalidParameterError
from .base import Engine, KVCache

MIN_ROWS = 2  # every forward computes at least this many rows (and logit rows)


class BatchInvariantEngine:
    """An :class:`Engine` whose forwards all run >= ``MIN_ROWS`` rows; see the module docstring.

    ``inner``: the engine that computes. It remembers the token id written at each position
    of every cache it has written (to recompute the previous token), so a cache must be filled
    through this wrapper from length 0 on.
    """

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.max_context = inner.max_context
        # cache -> int64 [capacity]: the token id at each position written through this wrapper
        self._tokens: weakref.WeakKeyDictionary[KVCache, np.ndarray] = weakref.WeakKeyDictionary()

    def new_cache(self) -> KVCache:
        return self.inner.new_cache()

    def _record(self, kv: KVCache) -> np.ndarray:
        tokens = self._tokens.get(kv)
        if tokens is None:
            if kv.length:
                raise InvalidParameterError(f"a cache holding {kv.length} positions written by another engine "
                                            "cannot be continued batch-invariantly; reset it first")
            tokens = self._tokens[kv] = np.zeros(kv.capacity, np.int64)
        return tokens

    def adopt(self, kv: KVCache, tokens: np.ndarray) -> None:
        """Record that ``kv[:len(tokens)]`` holds ``tokens``' K/V, computed batch-invariantly
        elsewhere (a persisted prompt cache saved from this wrapper's cache), so it can be continued."""
        if len(tokens) != kv.length:
            raise InvalidParameterError(f"adopting {len(tokens)} tokens for a cache of length {kv.length}")
        record = self._tokens.get(kv)
        if record is None:
            record = self._tokens[kv] = np.zeros(kv.capacity, np.int64)
        record[:len(tokens)] = tokens

    def forward(self, input_ids: np.ndarray, kv: KVCache, num_logits: int = 1) -> np.ndarray:
        """``input_ids`` int64 ``[n]`` at positions ``kv.length ..``; returns float32 logits
        ``[min(num_logits, n), vocab]`` for the last of them, as :class:`Engine` does."""
        ids = np.asarray(input_ids, np.int64).reshape(-1)
        n = int(ids.shape[0])
        if n < 1:
            raise InvalidParameterError("forward needs at least one token")
        want = max(1, min(num_logits, n))
        tokens = self._record(kv)
        start = kv.length
        if n >= MIN_ROWS:
            logits = self.inner.forward(ids, kv, max(want, MIN_ROWS))
            tokens[start:start + n] = ids
            return logits[-want:]
        token = int(ids[0])
        if start > 0:
            kv.rewind(1)
            try:
                logits = self.inner.forward(np.array([tokens[start - 1], token], np.int64), kv, MIN_ROWS)
            except ForwardCancelled:
                # A cancelled forward leaves the length where the call found it (engines/base.py): row
                # start - 1 holds the same K/V whether or not this forward rewrote it (exact mode's rows
                # are bit-identical wherever they sit), so the rewound row is simply taken back.
                kv.length = start
                raise
            tokens[start] = token
            return logits[-1:]
        kv.reserve(MIN_ROWS)
        logits = self.inner.forward(np.array([token, token], np.int64), kv, MIN_ROWS)
        kv.rewind(1)
        tokens[0] = token
        return logits[:1]
