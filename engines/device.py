"""Device memory for the GPU engines: one aligned block per KV cache, and the copies into it.

TensorRT requires every address given to ``IExecutionContext.setTensorAddress`` to
be 256-byte aligned, and ORT's TensorRT EP hands IO-bound buffers to it as they
are. A position-major cache row is ``n_kv_heads * head_dim * itemsize`` bytes
(128 B on the tiny test model, 384 B for SmolLM2 at fp16), so binding new K/V at
``base + P * row_bytes`` is misaligned for some P. The rule here: **every
address an engine binds is a multiple of** :data:`ALIGNMENT`.

* A cache is one allocation (:class:`CacheBlock`): ``2 * n_layers`` segments (K and
  V of each layer), each rounded up to :data:`ALIGNMENT`, so every layer's base
  (the past input, and the head-major cache bound whole) is aligned.
* New K/V rows are bound in place when ``P * row_bytes`` is aligned. Otherwise
  they are bound to an aligned staging block of the same segment shape and moved
  into the cache with **one** strided copy (``cudaMemcpy2DAsync``: 2 * n_layers
  rows of ``n * row_bytes`` bytes) on the engine's stream, before its sync. The
  copy is n rows per layer, a few KB, against a step that reads the whole prefix.
  Models whose rows are a multiple of 256 B (Qwen2.5-1.5B fp16: 512 B; Llama-3-8B:
  2 KB) never stage.

A :class:`RowCopier` does the strided copy: :class:`HostCopier` on host memory (the
engines' CPU mode, which is how CI runs this code) and :class:`CudartCopier`
through cuda-python.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import BackendUnavailableError

# TensorRT's documented requirement for every tensor address (IExecutionContext::setTensorAddress);
# cudaMalloc and ORT's CUDA allocator return 256-byte aligned blocks, so offsets are what can break it.
ALIGNMENT = 256


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-int(nbytes) // alignment) * alignment


def is_aligned(ptr: int) -> bool:
    return int(ptr) % ALIGNMENT == 0


def import_cudart():
    """cuda-python's runtime module (new and old import paths), or BackendUnavailableError."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            raise BackendUnavailableError("cuda-python is not installed (pip install cuda-python); the native "
                                          "TensorRT engine allocates its device buffers through it") from None
    return cudart


def cuda_call(result: tuple, what: str) -> Any:
    """Unwrap a cuda-python ``(error, *values)`` result; raise on any error."""
    err, *values = result
    if int(err) != 0:  # cudaSuccess
        raise BackendUnavailableError(f"{what} failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True)
class CacheBlock:
    """Where each layer's K and V live inside one allocation.

    ``segments``: 2 * n_layers (K of layer i at 2i, V at 2i + 1). ``segment_bytes``:
    one segment's stride, ``capacity * row_bytes`` rounded up to ALIGNMENT.
    """

    n_layers: int
    row_bytes: int  # bytes per position, position-major (n_kv_heads * head_dim * itemsize)
    capacity: int  # positions per segment

    @property
    def segments(self) -> int:
        return 2 * self.n_layers

    @property
    def segment_bytes(self) -> int:
        return align_up(self.capacity * self.row_bytes)

    @property
    def nbytes(self) -> int:
        return self.segments * self.segment_bytes

    def key_offset(self, layer: int, position: int = 0) -> int:
        return 2 * layer * self.segment_bytes + position * self.row_bytes

    def value_offset(self, layer: int, position: int = 0) -> int:
        return (2 * layer + 1) * self.segment_bytes + position * self.row_bytes


class BlockAddresses:
    """The device addresses of a KV cache held as one :class:`CacheBlock` allocation at ``base``
    (the ORT CUDA cache and the TensorRT one): each layer's K and V segment (``keys``, ``values``)
    and the address of a position in it."""

    block: CacheBlock
    base: int

    def place(self, base: int) -> None:
        """Record the allocation's address; ``block`` must be set."""
        self.base = base
        self.keys = [self.key_ptr(i) for i in range(self.block.n_layers)]
        self.values = [self.value_ptr(i) for i in range(self.block.n_layers)]

    def key_ptr(self, layer: int, position: int = 0) -> int:
        """Address of ``position`` (position-major; head-major segments are bound whole, at position 0)."""
        return self.base + self.block.key_offset(layer, position)

    def value_ptr(self, layer: int, position: int = 0) -> int:
        return self.base + self.block.value_offset(layer, position)


class RowCopier(Protocol):
    """One strided copy: ``height`` rows of ``width`` bytes, row i from ``src + i*spitch`` to ``dst + i*dpitch``."""

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None: ...


class HostCopier:
    """The strided copy on host memory (engines' CPU mode)."""

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        for i in range(height):
            ctypes.memmove(dst + i * dpitch, src + i * spitch, width)


class CudartCopier:
    """The strided copy as one ``cudaMemcpy2DAsync`` device-to-device on ``stream`` (0: the legacy stream)."""

    def __init__(self, cudart, stream: int | None) -> None:
        self._cudart = cudart
        self._stream = stream or 0

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        kind = self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        cuda_call(self._cudart.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, self._stream),
                  "cudaMemcpy2DAsync(new K/V rows)")


class NewRows:
    """Where one forward's new K/V rows are bound, and the copy that lands them when staged.

    ``bind_key(layer)`` / ``bind_value(layer)``: the address to bind ``new_key.i`` /
    ``new_value.i`` to (the cache at ``start`` when aligned, else the staging block).
    ``land()`` moves staged rows into the cache; call it after the run is queued and
    before the stream is synchronised (a no-op when nothing was staged).
    """

    def __init__(self, block: CacheBlock, cache_base: int, start: int, n: int,
                 staging: tuple[CacheBlock, int] | None, copier: RowCopier) -> None:
        self.block, self.cache_base, self.start, self.n, self.copier = block, cache_base, start, n, copier
        self.staged = not is_aligned(cache_base + block.key_offset(0, start))
        if self.staged:
            if staging is None or staging[0].capacity < n:
                raise BackendUnavailableError(f"{n} new K/V rows at position {start} need a staging block")
            self.stage_block, self.stage_base = staging

    def bind_key(self, layer: int) -> int:
        if self.staged:
            return self.stage_base + self.stage_block.key_offset(layer)
        return self.cache_base + self.block.key_offset(layer, self.start)

    def bind_value(self, layer: int) -> int:
        if self.staged:
            return self.stage_base + self.stage_block.value_offset(layer)
        return self.cache_base + self.block.value_offset(layer, self.start)

    def land(self) -> None:
        if self.staged:
            self.copier.copy_2d(self.cache_base + self.block.key_offset(0, self.start), self.block.segment_bytes,
                                self.stage_base, self.stage_block.segment_bytes, self.n * self.block.row_bytes,
                                self.block.segments)
