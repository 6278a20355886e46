"""The Engine protocol and the KV cache it writes into.

An engine runs one compiled model. The speculation loop owns one KV cache per
model; the engine only writes K/V for the positions it computes and advances
``length``. Rollback (``rewind``) is the loop's job and is a length change:
slots past ``length`` are simply overwritten by the next forward, as in gpt-fast.

Cache layout is position-major, ``[max_context, n_kv_heads, head_dim]`` per layer
and per K/V, so the committed prefix ``[:length]`` is one contiguous block: it is
handed to ONNX Runtime without a copy, and new K/V land in place right after it.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np

from ..errors import ContextOverflowError, ForwardCancelled, InvalidParameterError, NonFiniteLogitsError

PROVIDERS = ("cpu", "cuda", "tensorrt")
GRAPH_OPT_LEVELS = ("disable", "basic", "extended", "all")


@dataclass(frozen=True)
class EngineOptions:
    """How one model's session is created."""

    provider: str = "cpu"  # one of PROVIDERS; an unavailable one raises, never falls back
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default (one per physical core)
    inter_op_threads: int = 1  # decoder graphs are a chain: parallel branches buy nothing
    graph_optimization: str = "all"  # one of GRAPH_OPT_LEVELS
    device_id: int = 0
    use_io_binding: bool = True  # bind cache slices in place instead of copying outputs
    optimized_model_path: str | None = None  # where ORT may save the optimized graph
    # ORT's worker threads spin (busy-wait) for the next parallel section instead of sleeping.
    # Within a run that is what makes small per-layer sections fast; between runs they keep
    # spinning to catch the next call, and with two sessions on the same cores that idle
    # spinning steals the other session's cores.
    allow_spinning: bool = True
    # Stop the workers' spinning the moment a run returns (ORT's session.force_spinning_stop):
    # spinning helps inside a run and costs nothing between runs. Set when a target and a
    # draft session share the cores (runtime/loading.py).
    stop_spinning_after_run: bool = False
    # ONNX Runtime's per-node profiler writes <prefix>_<date>.json (bench/opprofile.py reads it);
    # None: off (it times every node, which costs a little on every run).
    profile_prefix: str | None = None

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise InvalidParameterError(f"provider must be one of {', '.join(PROVIDERS)}; got {self.provider!r}")
        # More threads than CPUs only contend for them, and ONNX Runtime allocates per thread up
        # front: 100000 threads crashed it (rc 139) and 2**31 overflowed its binding (TypeError).
        cpus = os.cpu_count() or 1
        for name in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= cpus:
                raise InvalidParameterError(f"thread counts must be integers in [0, {cpus}] (0 = ONNX Runtime's "
                                            f"default; this machine has {cpus} CPUs); got {name}={value!r}")
        if self.graph_optimization not in GRAPH_OPT_LEVELS:
            raise InvalidParameterError(f"graph_optimization must be one of {', '.join(GRAPH_OPT_LEVELS)}; "
                                        f"got {self.graph_optimization!r}")


def check_finite_logits(logits: np.ndarray, graph: str, bundle: str) -> None:
    """Raise NonFiniteLogitsError when ``logits`` (float32 ``[rows, vocab]``) hold NaN or inf.

    Engines call this on a sequence's first forward (from an empty cache: every warm-up and
    every prefill), where it costs one pass over ``rows * vocab`` floats. NaN weights
    otherwise decode silently: greedy argmax picks token 0 (an empty reply) and sampling
    garbage. Later steps are not checked: the first one already runs every weight.
    """
    if not np.isfinite(logits).all():
        bad = int(np.size(logits) - np.count_nonzero(np.isfinite(logits)))
        raise NonFiniteLogitsError(f"bundle {bundle}: {graph} produced {bad} NaN or infinite logits on its first "
                                   "step: its weights are corrupt (or overflow their precision); re-export the "
                                   "bundle")


KV_LAYOUTS = ("position-major", "head-major")


class KVCache:
    """Preallocated per-layer K/V buffers with a committed ``length``.

    ``keys[i]`` and ``values[i]``: ndarray ``[capacity, n_kv_heads, head_dim]``
    ("position-major", the standard graph) or ``[1, n_kv_heads, capacity, head_dim]``
    ("head-major", the fused GQA graph, which writes in place at the length it is
    given). dtype float32 or float16. Allocated once and reused across generations.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: np.dtype = np.float32, layout: str = "position-major") -> None:
        if layout not in KV_LAYOUTS:
            raise InvalidParameterError(f"KV layout must be one of {KV_LAYOUTS}; got {layout!r}")
        self.layout = layout
        shape = (capacity, n_kv_heads, head_dim) if layout == "position-major" else (1, n_kv_heads, capacity, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(n_layers)]
        self.capacity = capacity
        self.length = 0

    # Whether :meth:`copy_prefix` can fill this cache from another (host buffers can; the GPU caches'
    # device blocks do not implement it, so a slot there recomputes a prefix another slot holds).
    copies_prefix = True

    def reset(self) -> None:
        self.length = 0

    def copy_prefix(self, source: "KVCache", n: int) -> None:
        """Make this cache hold ``source``'s first ``n`` positions, replacing what it held (``length``
        becomes n). ``source`` must be a cache of the same graph (layers, heads, head size, layout and
        dtype alike; its capacity may differ). One copy per layer's K and V, where computing the same
        positions again is a forward."""
        if not 0 <= n <= min(source.length, self.capacity):
            raise InvalidParameterError(f"cannot copy {n} positions from a cache of length {source.length} "
                                        f"into one of capacity {self.capacity}")
        mine, theirs = self.keys + self.values, source.keys + source.values
        if self.layout != source.layout or len(mine) != len(theirs) or any(
                a.dtype != b.dtype or self.committed(a, 0).shape != source.committed(b, 0).shape
                for a, b in zip(mine, theirs)):
            raise InvalidParameterError("cannot copy a KV prefix between caches of different models or layouts")
        for dst, src in zip(mine, theirs):
            self.committed(dst, n)[...] = source.committed(src, n)
        self.length = n

    def rewind(self, n: int) -> None:
        """Drop the last ``n`` positions (rejected draft tokens). The only way a cache shrinks."""
        if not 0 <= n <= self.length:
            raise InvalidParameterError(f"cannot rewind {n} positions from a cache of length {self.length}")
        self.length -= n

    def reserve(self, n: int) -> None:
        """Check that ``n`` more positions fit; raise ContextOverflowError otherwise."""
        if self.length + n > self.capacity:
            raise ContextOverflowError(
                f"{self.length} cached + {n} new positions exceed max_context {self.capacity}")

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def committed(self, array: np.ndarray, n: int | None = None) -> np.ndarray:
        """A view of the first ``n`` (default ``length``) positions of one of this cache's buffers."""
        n = self.length if n is None else n
        return array[:n] if self.layout == "position-major" else array[:, :, :n]


class Interrupt:
    """One generation's cancel, reaching into the forward in progress.

    Another thread calls :meth:`set` (a client left). An engine wraps each session run in
    :meth:`running` with a ``stop`` callable that makes that run give up midway (ONNX Runtime's
    ``RunOptions.terminate``); :meth:`set` calls it for the run in progress, and a run that would
    start after :meth:`set` raises :class:`~specedge.errors.ForwardCancelled` without starting.
    Usable where a ``threading.Event`` is (``set``, ``is_set``): the loop still checks it after every
    block, which is all an engine that cannot stop a run midway offers.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._stops: list[Callable[[], None]] = []  # the runs in progress (a pipelined step runs two)

    def set(self) -> None:
        with self._lock:
            self._set = True
            stops = list(self._stops)
        for stop in stops:
            stop()

    def is_set(self) -> bool:
        return self._set

    def check(self) -> None:
        """Raise ForwardCancelled when the generation was cancelled (before a run starts)."""
        if self._set:
            raise ForwardCancelled("the generation was cancelled before this forward started")

    @contextmanager
    def running(self, stop: Callable[[], None]) -> Iterator[None]:
        """Hold ``stop`` as the way to end the run inside this block; refuse to start once set."""
        with self._lock:
            if self._set:
                raise ForwardCancelled("the generation was cancelled before this forward started")
            self._stops.append(stop)
        try:
            yield
        finally:
            with self._lock:
                self._stops.remove(stop)


@contextmanager
def interrupting(engines, interrupt: Interrupt | None) -> Iterator[None]:
    """Give each of ``engines`` (None entries skipped, repeats fine) ``interrupt`` for the block, then None.

    The caller holds the engines for one generation (the Generator's lock), so no other run reads it.
    """
    held = [engine for engine in dict.fromkeys(engines) if engine is not None]
    for engine in held:
        engine.interrupt = interrupt
    try:
        yield
    finally:
        for engine in held:
            engine.interrupt = None


class Engine(Protocol):
    """One compiled decoder.

    ``forward(input_ids, kv, num_logits)``: ``input_ids`` int64 ``[n]`` are the
    tokens at positions ``kv.length .. kv.length + n - 1``. The engine writes
    their K/V into ``kv`` at those positions, advances ``kv.length`` by n, and
    returns float32 logits ``[num_logits, vocab]`` for the last ``num_logits`` of them.

    ``interrupt``: the cancel of the generation using the engine now (set by the Generator around
    a run of the loop; None otherwise). A forward it stops raises ForwardCancelled and leaves
    ``kv.length`` unchanged. The ORT CPU engine stops a session run midway (between graph nodes);
    the CUDA and TensorRT engines refuse only a forward not yet started (a GPU step is short);
    an engine without the attribute (a test's reference engine) ignores it, and the cancel is
    seen at the next block, as before.
    """

    vocab_size: int
    max_context: int
    interrupt: Interrupt | None

    def new_cache(self) -> KVCache: ...

    def forward(self, input_ids: np.ndarray, kv: KVCache, num_logits: int = 1) -> np.ndarray: ...
