"""ONNX Runtime on the GPU (CUDA or TensorRT execution provider), KV cache on the device.

The CPU engine (engines/ort.py) copies the cache every step when the provider is
a GPU; this one never moves cache bytes across PCIe:

* :class:`DeviceKVCache` holds one preallocated device buffer per layer and per
  K/V (``OrtValue.ortvalue_from_shape_and_type(..., "cuda", device_id)``),
  ``[max_context, n_kv_heads, head_dim]``, position-major like the CPU cache.
* Each forward binds ``past_key.i`` to the buffer's base pointer with shape
  ``[P, kvh, hd]`` and ``new_key.i`` to ``base + P * row_bytes`` with shape
  ``[n, kvh, hd]``: the graph reads the prefix in place and writes the new
  tokens' K/V right after it. Rollback is the loop's length change.
* Fused-GQA graphs (``attention == "gqa"``) keep a head-major cache that is bound
  whole as both ``past_*`` and ``present_*``; GQA writes the new positions in place
  from ``seqlens_k``. ORT's CUDA GQA kernel is fp16/bf16 only, so fp32 GQA graphs
  are refused on the GPU rather than silently run on the CPU EP.
* The n ids, n positions and ``num_logits`` are bound from CPU memory; ORT
  copies those few bytes in (its Python IO binding does not take pinned host
  memory). Logits are bound to a preallocated host buffer: the graph emits only
  the ``num_logits`` rows the loop asked for, and ORT copies exactly those.
* With the TensorRT EP the explicit profiles recorded in the bundle bound n;
  a longer forward (a long prompt, a draft catching up) runs in chunks. The
  session is built by OrtEngine (TensorRT, then CPU for host-side shape ops),
  so only graphs TensorRT parses whole (fp32/fp16, not MatMulNBits) belong here.
* Provider "cpu" runs the very same binding code on host buffers: that is how
  CI exercises it without a GPU.
* When cuda-python is installed each engine gets its own non-blocking CUDA
  stream (provider option ``user_compute_stream``), so a draft and a target
  session do not serialise on one stream; without it ORT picks the stream.

Not verified on hardware here (no GPU in CI); see docs/GPU.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, InvalidParameterError
from ..manifest import ModelEntry, resolve_inside
from .base import EngineOptions, KVCache
from .ort import OrtEngine, check_provider
from .tensorrt import (REBUILD_HINT, bundle_engine_record, check_engine_compatible, check_tensorrt_graph, cuda_call,
                       forward_in_chunks, import_cudart, runtime_facts, verify_record_file)

# Provider options that name folders; the bundle records them relative to its root.
_PATH_OPTIONS = ("trt_engine_cache_path", "trt_timing_cache_path")


class DeviceKVCache(KVCache):
    """KVCache interface over ORT-allocated device buffers.

    ``keys[i]`` / ``values[i]``: OrtValue on ``device:device_id`` ("cuda"; "cpu" runs
    the same code on host buffers, which is how CI tests it without a GPU), shaped
    like :class:`KVCache` for its layout: ``[capacity, n_kv_heads, head_dim]``
    (position-major) or ``[1, n_kv_heads, capacity, head_dim]`` (head-major, fused GQA).
    Allocated once; ``length`` is the committed prefix.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: np.dtype,
                 device: str = "cuda", device_id: int = 0, layout: str = "position-major") -> None:
        import onnxruntime as ort

        self.dtype = np.dtype(dtype)
        self.device = device
        self.device_id = device_id
        self.layout = layout
        self.shape = (capacity, n_kv_heads, head_dim) if layout == "position-major" else \
            (1, n_kv_heads, capacity, head_dim)
        self.row_bytes = n_kv_heads * head_dim * self.dtype.itemsize  # position-major: bytes per position
        self.capacity = capacity
        self.length = 0

        def alloc():
            return ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), self.dtype.type, device, device_id)

        self.keys = [alloc() for _ in range(n_layers)]
        self.values = [alloc() for _ in range(n_layers)]

    def key_ptr(self, layer: int, position: int = 0) -> int:
        """Address of ``position`` (position-major; head-major buffers are bound whole, at position 0)."""
        return self.keys[layer].data_ptr() + position * self.row_bytes

    def value_ptr(self, layer: int, position: int = 0) -> int:
        return self.values[layer].data_ptr() + position * self.row_bytes

    def to_host(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of one layer's committed K and V (copies the whole buffer; tests only)."""
        committed = np.s_[:self.length] if self.layout == "position-major" else np.s_[:, :, :self.length]
        return self.keys[layer].numpy()[committed].copy(), self.values[layer].numpy()[committed].copy()

    @property
    def nbytes(self) -> int:
        return 2 * len(self.keys) * self.capacity * self.row_bytes


def _require_gpu_provider(options: EngineOptions) -> None:
    if options.provider == "cpu":
        raise InvalidParameterError("the onnxruntime-gpu backend runs on provider cuda or tensorrt; the cpu "
                                    "provider is served by the onnxruntime backend")
    check_provider(options.provider)


def own_stream(device_id: int) -> int | None:
    """A new non-blocking CUDA stream on ``device_id``, or None without cuda-python."""
    try:
        cudart = import_cudart()
    except BackendUnavailableError:
        return None
    cuda_call(cudart.cudaSetDevice(device_id), "cudaSetDevice")
    return int(cuda_call(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"))


class OrtCudaEngine(OrtEngine):
    """One bundle model on ORT's CUDA or TensorRT EP with a :class:`DeviceKVCache`.

    ``provider_options``: options for the chosen EP (for TensorRT, the explicit
    profiles and engine cache the bundle records). ``max_tokens``: the largest n
    one session run may take (the TensorRT profiles' maximum); None = unbounded.
    ``stream``: a CUDA stream handle for both GPU EPs of this session, or None.
    """

    def __init__(self, entry: ModelEntry, graph_path: Path, options: EngineOptions = EngineOptions(provider="cuda"),
                 provider_options: dict | None = None, *, max_tokens: int | None = None,
                 stream: int | None = None) -> None:
        if options.provider == "tensorrt":
            check_tensorrt_graph(entry)
        elif options.provider == "cuda" and entry.attention == "gqa" and entry.kv_dtype == "float32":
            # ORT's CUDA GroupQueryAttention is fp16/bf16 only: fp32 GQA would run on the CPU EP and
            # copy the whole cache across PCIe every step.
            raise BackendUnavailableError(f"{entry.graph} is an fp32 GroupQueryAttention graph, which ONNX "
                                          "Runtime's CUDA EP cannot run; export with --precision fp16 or "
                                          "--attention standard for the GPU")
        gpu = {} if options.provider == "cpu" else {"device_id": str(options.device_id)}
        if stream is not None:
            gpu["user_compute_stream"] = str(stream)
        super().__init__(entry, graph_path, options, {**gpu, **(provider_options or {})})
        self.max_tokens = max_tokens
        self.stream = stream
        self._logits_host = np.empty((1, entry.output_size), np.float32)  # grows to the largest num_logits seen

    def new_cache(self) -> DeviceKVCache:
        e = self.entry
        return DeviceKVCache(e.n_layers, e.n_kv_heads, e.head_dim, e.max_context, self._kv_dtype, self._device,
                             self.options.device_id, "head-major" if self._gqa else "position-major")

    def forward(self, input_ids: np.ndarray, kv: DeviceKVCache, num_logits: int = 1) -> np.ndarray:
        """Run n new tokens; returns float32 ``[num_logits, vocab]``, a view valid until the next call."""
        if not isinstance(kv, DeviceKVCache) or kv.device != self._device:
            raise InvalidParameterError("OrtCudaEngine.forward needs the cache from its own new_cache()")
        ids = np.ascontiguousarray(input_ids, dtype=np.int64).reshape(-1)
        return forward_in_chunks(self._run_device, ids, kv, num_logits, self.max_tokens)

    def _run_device(self, ids: np.ndarray, kv: DeviceKVCache, num_logits: int) -> np.ndarray:
        e, io, device, dev = self.entry, self.entry.io, self._device, self.options.device_id
        n, start = int(ids.shape[0]), kv.length
        binding = self.session.io_binding()
        binding.bind_cpu_input(io.input_ids, ids.reshape(1, n))
        binding.bind_cpu_input(io.positions, np.arange(start, start + n, dtype=np.int64).reshape(1, n))
        binding.bind_cpu_input(io.num_logits, np.array([num_logits], np.int64))
        kv_type = self._kv_dtype.type
        if self._gqa:
            # One buffer is both past and present: GQA reads [0, start) and writes [start, start+n).
            binding.bind_cpu_input(io.seqlens_k, np.array([start + n - 1], np.int32))
            binding.bind_cpu_input(io.total_sequence_length, np.array(start + n, np.int32))
            past_shape = new_shape = list(kv.shape)
            new_at = 0
        else:
            past_shape, new_shape, new_at = [start, e.n_kv_heads, e.head_dim], [n, e.n_kv_heads, e.head_dim], start
        for layer, ((pk, pv), (nk, nv)) in enumerate(zip(self._past_names, self._new_names)):
            binding.bind_input(pk, device, dev, kv_type, past_shape, kv.key_ptr(layer))
            binding.bind_input(pv, device, dev, kv_type, past_shape, kv.value_ptr(layer))
            binding.bind_output(nk, device, dev, kv_type, new_shape, kv.key_ptr(layer, new_at))
            binding.bind_output(nv, device, dev, kv_type, new_shape, kv.value_ptr(layer, new_at))
        if self._logits_host.shape[0] < num_logits:
            self._logits_host = np.empty((num_logits, e.output_size), np.float32)
        # The first num_logits rows of the host buffer are contiguous: ORT copies just those rows out.
        binding.bind_output(io.logits, "cpu", 0, np.float32, [1, num_logits, e.output_size],
                            self._logits_host.ctypes.data)
        self.session.run_with_iobinding(binding)
        kv.length = start + n
        return self._logits_host[:num_logits]


def resolve_provider_options(options: dict[str, str], root: Path) -> dict[str, str]:
    """The recorded EP options with their bundle-relative cache folders made absolute."""
    out = dict(options)
    for key in _PATH_OPTIONS:
        if key in out:
            out[key] = str(resolve_inside(root, out[key]))
    return out


def create_ort_gpu_engine(entry: ModelEntry, graph: Path, options: EngineOptions) -> OrtCudaEngine:
    """The ``onnxruntime-gpu`` backend. TensorRT needs the engine the bundle records for this model."""
    _require_gpu_provider(options)
    if options.provider != "tensorrt":
        return OrtCudaEngine(entry, graph, options, stream=own_stream(options.device_id))
    root, role, record = bundle_engine_record(entry, graph)
    if record is None or record.route != "ort-trt":
        raise BackendUnavailableError(f"the bundle has no TensorRT EP engine for its {role} model; without explicit "
                                      f"profiles ORT would rebuild the engine as shapes grow; {REBUILD_HINT}")
    check_engine_compatible(record, runtime_facts(options.device_id), role)
    cache = resolve_inside(root, record.file)
    engine_files = sorted(cache.glob(f"{record.cache_key}*.engine"))
    if len(engine_files) == 1:
        verify_record_file(root, record, engine_files[0], role)
    return OrtCudaEngine(entry, graph, options, resolve_provider_options(record.provider_options, root),
                         max_tokens=record.max_new_tokens(entry.io), stream=own_stream(options.device_id))
