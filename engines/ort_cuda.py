"""ONNX Runtime on the GPU (CUDA or TensorRT execution provider), KV cache on the device.

The CPU engine (engines/ort.py) copies the cache every step when the provider is
a GPU; this one never moves cache bytes across PCIe:

* :class:`DeviceKVCache` is one preallocated device block (engines/device.py's
  :class:`CacheBlock`): per layer and per K/V a 256-byte aligned segment,
  ``[max_context, n_kv_heads, head_dim]`` (position-major) or
  ``[1, n_kv_heads, max_context, head_dim]`` (head-major, fused GQA).
* Each forward binds ``past_key.i`` to the segment's base with shape
  ``[P, kvh, hd]`` and ``new_key.i`` to position ``P``: the graph reads the prefix
  in place and writes the new tokens' K/V right after it. When ``P * row_bytes``
  is not a multiple of 256 (TensorRT's address rule, which ORT's TensorRT EP
  passes through), the new rows are bound to an aligned staging block and moved
  into the cache with one strided device copy (cuda-python) on the engine's stream.
  Rollback is the loop's length change.
* Fused-GQA graphs (``attention == "gqa"``) bind each head-major segment whole as
  both ``past_*`` and ``present_*``; GQA writes the new positions in place from
  ``seqlens_k`` (ORT GenAI's past_present_share_buffer). ORT's CUDA GQA kernel is
  fp16/bf16 only, so fp32 GQA graphs are refused on the GPU rather than silently
  run on the CPU EP.
* The n ids, n positions and ``num_logits`` are bound from CPU memory; ORT
  copies those few bytes in. Logits are bound to a preallocated host buffer: the
  graph emits only the ``num_logits`` rows the loop asked for, and ORT copies
  exactly those. With an engine built from the TensorRT rewrite
  (export/trt_graph.py) ``num_logits_to_keep`` is bound as a device tensor whose
  *length* is the row count, so the TensorRT EP reads no shape tensor back.
* Under the TensorRT EP the session's providers are TensorRT, CUDA, CPU: a node
  TensorRT declines stays on the device. The explicit profiles recorded in the
  bundle bound n; a longer forward runs in chunks.
* Provider "cpu" runs the very same binding, staging and copy code on host
  buffers: that is how CI exercises it without a GPU.
* When cuda-python is installed each engine gets its own non-blocking CUDA
  stream (``user_compute_stream`` for every GPU EP of the session), so a draft
  and a target session do not serialise on one stream.

Not verified on hardware (no GPU has run it); see docs/GPU.md.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, ChecksumError, InvalidParameterError
from ..bundle.manifest import ModelEntry, resolve_inside
from .base import EngineOptions, KVCache, check_finite_logits
from .device import ALIGNMENT, BlockAddresses, CacheBlock, CudartCopier, HostCopier, NewRows, RowCopier, align_up, is_aligned
from .ort import OrtEngine, check_provider
from .providers import preload_tensorrt_libs
from .tensorrt import (ORT_TRT_EP_TENSORRT_MAJOR, REBUILD_HINT, EngineRecord, bundle_engine_record, check_engine_compatible,
                       check_tensorrt_graph, cuda_call, forward_in_chunks, import_cudart, runtime_facts,
                       verify_record_file)

# Provider options that name folders; the bundle records them relative to its root.
_PATH_OPTIONS = ("trt_engine_cache_path", "trt_timing_cache_path")


class DeviceBuffer:
    """One ORT-allocated block on ``device`` whose usable start is 256-byte aligned.

    ORT's CUDA allocator aligns to 256 already; its CPU allocator (the CI mode) to 64,
    so the block carries ALIGNMENT bytes of slack and ``ptr`` is rounded up.
    """

    def __init__(self, nbytes: int, device: str, device_id: int) -> None:
        import onnxruntime as ort

        self.nbytes = int(nbytes)
        self.value = ort.OrtValue.ortvalue_from_shape_and_type([self.nbytes + ALIGNMENT], np.uint8, device,
                                                               device_id)
        self.ptr = align_up(self.value.data_ptr())

    def host_bytes(self) -> np.ndarray:
        """A host copy of the usable bytes (the whole block: tests and debugging only)."""
        raw = self.value.numpy()
        skip = self.ptr - self.value.data_ptr()
        return raw[skip:skip + self.nbytes]


class DeviceKVCache(BlockAddresses, KVCache):
    """KVCache interface over one aligned device block (see :class:`specedge.engines.device.CacheBlock`).

    ``keys[i]`` / ``values[i]``: the device address (int) of layer i's K / V segment on
    ``device:device_id`` ("cuda"; "cpu" runs the same code on host memory, which is how
    CI tests it). Each segment is shaped like :class:`KVCache` for its layout:
    ``[capacity, n_kv_heads, head_dim]`` (position-major) or
    ``[1, n_kv_heads, capacity, head_dim]`` (head-major, fused GQA). Allocated once;
    ``length`` is the committed prefix.
    """

    copies_prefix = False  # a device block: a prefix another slot holds is recomputed, not copied

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: np.dtype,
                 device: str = "cuda", device_id: int = 0, layout: str = "position-major") -> None:
        self.dtype = np.dtype(dtype)
        self.device = device
        self.device_id = device_id
        self.layout = layout
        self.shape = (capacity, n_kv_heads, head_dim) if layout == "position-major" else \
            (1, n_kv_heads, capacity, head_dim)
        self.row_bytes = n_kv_heads * head_dim * self.dtype.itemsize  # position-major: bytes per position
        self.capacity = capacity
        self.length = 0
        self.block = CacheBlock(n_layers, self.row_bytes, capacity)
        self.buffer = DeviceBuffer(self.block.nbytes, device, device_id)
        self.place(self.buffer.ptr)

    def to_host(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of one layer's committed K and V (copies the whole block; tests only)."""
        raw = self.buffer.host_bytes()
        out = []
        for offset in (self.block.key_offset(layer), self.block.value_offset(layer)):
            size = self.capacity * self.row_bytes
            out.append(self.committed(raw[offset:offset + size].view(self.dtype).reshape(self.shape)).copy())
        return out[0], out[1]

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


def row_copier(device: str, stream: int | None, row_bytes: int) -> RowCopier | None:
    """How staged K/V rows reach the cache on ``device``; None when rows never need staging.

    Raises BackendUnavailableError on a GPU without cuda-python when rows do need it.
    """
    if row_bytes % ALIGNMENT == 0:
        return None
    if device == "cpu":
        return HostCopier()
    try:
        cudart = import_cudart()
    except BackendUnavailableError:
        raise BackendUnavailableError(
            f"this model's cache rows are {row_bytes} bytes, not a multiple of {ALIGNMENT}: new K/V rows at some "
            "positions must be staged and copied into the cache, which needs cuda-python "
            "(pip install cuda-python), or export with --attention gqa for the cuda provider") from None
    return CudartCopier(cudart, stream)


class OrtCudaEngine(OrtEngine):
    """One bundle model on ORT's CUDA or TensorRT EP with a :class:`DeviceKVCache`.

    ``provider_options``: options for the chosen EP (for TensorRT, the explicit
    profiles and engine cache the bundle records). ``max_tokens``: the largest n
    one session run may take (the TensorRT profiles' maximum); None = unbounded.
    ``stream``: a CUDA stream handle for every GPU EP of this session, or None.
    ``logits_rows_from_shape``: the graph is the TensorRT rewrite, whose
    ``num_logits_to_keep`` carries the row count as its length (export/trt_graph.py).
    """

    def __init__(self, entry: ModelEntry, graph_path: Path, options: EngineOptions = EngineOptions(provider="cuda"),
                 provider_options: dict | None = None, *, max_tokens: int | None = None,
                 stream: int | None = None, logits_rows_from_shape: bool = False, static_steps: int = 0,
                 cuda_graph: bool = False) -> None:
        if options.provider == "tensorrt":
            check_tensorrt_graph(entry)
        elif options.provider == "cuda" and entry.attention == "gqa" and entry.kv_dtype == "float32":
            # ORT's CUDA GroupQueryAttention is fp16/bf16 only: fp32 GQA would run on the CPU EP and
            # copy the whole cache across PCIe every step.
            raise BackendUnavailableError(f"{entry.graph} is an fp32 GroupQueryAttention graph, which ONNX "
                                          "Runtime's CUDA EP cannot run; export with --precision fp16 or "
                                          "--attention standard for the GPU")
        if options.provider == "tensorrt":
            preload_tensorrt_libs(ORT_TRT_EP_TENSORRT_MAJOR)  # NVIDIA's wheel keeps libnvinfer off the loader path
        if static_steps and entry.attention != "gqa":
            raise InvalidParameterError("fixed-address steps need the fused-GQA graph, whose cache is bound whole; "
                                        "the standard graph binds new K/V at a moving position")
        if cuda_graph and (options.provider != "cuda" or not static_steps):
            raise InvalidParameterError("CUDA graph capture needs provider cuda and static_steps >= 1")
        gpu = {} if options.provider == "cpu" else {"device_id": str(options.device_id)}
        if stream is not None:
            gpu["user_compute_stream"] = str(stream)
        chosen = dict(gpu)
        if cuda_graph:
            chosen["enable_cuda_graph"] = "1"  # one graph per gpu_graph_id run option: per token count here
        device = "cpu" if options.provider == "cpu" else "cuda"
        row_bytes = entry.n_kv_heads * entry.head_dim * np.dtype(entry.kv_dtype).itemsize
        # Fused GQA binds whole segments (always aligned); only position-major new rows may need staging.
        self._copier = None if entry.attention == "gqa" else row_copier(device, stream, row_bytes)
        super().__init__(entry, graph_path, options, {**chosen, **(provider_options or {})}, cuda_options=gpu)
        self.static_steps = static_steps
        self.cuda_graph = cuda_graph
        self._static: dict[int, StaticStep] = {}
        self.max_tokens = max_tokens
        self.stream = stream
        self.logits_rows_from_shape = logits_rows_from_shape
        self._staging: tuple[CacheBlock, DeviceBuffer] | None = None
        self._rows: DeviceBuffer | None = None  # the rewrite's row-count tensor (its bytes are never read)
        self._logits_host = np.empty((1, entry.output_size), np.float32)  # grows to the largest num_logits seen

    def new_cache(self) -> DeviceKVCache:
        e = self.entry
        return DeviceKVCache(e.n_layers, e.n_kv_heads, e.head_dim, e.max_context, self._kv_dtype, self._device,
                             self.options.device_id, "head-major" if self._gqa else "position-major")

    def forward(self, input_ids: np.ndarray, kv: DeviceKVCache, num_logits: int = 1) -> np.ndarray:
        """Run n new tokens; returns float32 ``[num_logits, output_size]``, a view valid until the next call."""
        if not isinstance(kv, DeviceKVCache) or kv.device != self._device:
            raise InvalidParameterError("OrtCudaEngine.forward needs the cache from its own new_cache()")
        if self.interrupt is not None:  # a GPU step is short: a cancel refuses the next one, not this one
            self.interrupt.check()
        ids = np.ascontiguousarray(input_ids, dtype=np.int64).reshape(-1)
        first = kv.length == 0
        if 0 < ids.shape[0] <= self.static_steps:  # decode, draft and verify steps; prefill stays dynamic
            kv.reserve(int(ids.shape[0]))
            logits = self._run_static(ids, kv, max(1, min(num_logits, int(ids.shape[0]))))
        else:
            logits = forward_in_chunks(self._run_device, ids, kv, num_logits, self.max_tokens)
        if first:  # a sequence's first step (warm-up, prefill): corrupt weights surface here
            check_finite_logits(logits, self.entry.graph, self._bundle)
        return logits

    def _staging_for(self, n: int) -> tuple[CacheBlock, int] | None:
        """The staging block, grown to ``n`` rows per layer (once per new largest n; prefill sizes it)."""
        if self._copier is None:
            return None
        if self._staging is None or self._staging[0].capacity < n:
            e = self.entry
            block = CacheBlock(e.n_layers, e.n_kv_heads * e.head_dim * self._kv_dtype.itemsize, n)
            self._staging = (block, DeviceBuffer(block.nbytes, self._device, self.options.device_id))
        return self._staging[0], self._staging[1].ptr

    def _bind(self, binding, name: str, shape: list[int], ptr: int, output: bool = False, dtype=None) -> None:
        """Bind a device tensor (dtype: the cache's unless given); every address is 256-byte aligned."""
        if not is_aligned(ptr):
            raise BackendUnavailableError(f"{name} would be bound at {ptr:#x}, not {ALIGNMENT}-byte aligned")
        bind = binding.bind_output if output else binding.bind_input
        if dtype is None:
            dtype = np.int64 if name == self.entry.io.num_logits else self._kv_dtype.type
        bind(name, self._device, self.options.device_id, dtype, shape, ptr)

    # ----------------------------------------------------------------- fixed-address steps (CUDA-graph ready)

    def _static_step(self, n: int, kv: DeviceKVCache) -> "StaticStep":
        step = self._static.get(n)
        if step is None or step.kv is not kv:
            step = self._static[n] = StaticStep(self, n, kv)
        return step

    def _run_static(self, ids: np.ndarray, kv: DeviceKVCache, num_logits: int) -> np.ndarray:
        """An n-token GQA forward on the binding made once for n: only values change, never an address."""
        n, start = int(ids.shape[0]), kv.length
        step = self._static_step(n, kv)
        step.write(ids, np.arange(start, start + n, dtype=np.int64), np.array([start + n - 1], np.int32))
        self.session.run_with_iobinding(step.binding, step.run_options)
        kv.length = start + n
        return step.logits(num_logits)

    def _run_device(self, ids: np.ndarray, kv: DeviceKVCache, num_logits: int) -> np.ndarray:
        e, io = self.entry, self.entry.io
        n, start = int(ids.shape[0]), kv.length
        binding = self.session.io_binding()
        binding.bind_cpu_input(io.input_ids, ids.reshape(1, n))
        binding.bind_cpu_input(io.positions, np.arange(start, start + n, dtype=np.int64).reshape(1, n))
        if self.logits_rows_from_shape:  # the row count is the tensor's length: nothing to read back
            if self._rows is None or self._rows.nbytes < 8 * num_logits:
                self._rows = DeviceBuffer(8 * max(num_logits, self.max_tokens or 1), self._device,
                                          self.options.device_id)
            self._bind(binding, io.num_logits, [num_logits], self._rows.ptr)
        else:
            binding.bind_cpu_input(io.num_logits, np.array([num_logits], np.int64))
        rows = None
        if self._gqa:
            # One buffer is both past and present: GQA reads [0, start) and writes [start, start+n).
            binding.bind_cpu_input(io.seqlens_k, np.array([start + n - 1], np.int32))
            binding.bind_cpu_input(io.total_sequence_length, np.array(start + n, np.int32))
            for layer, ((pk, pv), (nk, nv)) in enumerate(zip(self._past_names, self._new_names)):
                for past, new, ptr in ((pk, nk, kv.key_ptr(layer)), (pv, nv, kv.value_ptr(layer))):
                    self._bind(binding, past, list(kv.shape), ptr)
                    self._bind(binding, new, list(kv.shape), ptr, output=True)
        else:
            past_shape, new_shape = [start, e.n_kv_heads, e.head_dim], [n, e.n_kv_heads, e.head_dim]
            rows = NewRows(kv.block, kv.base, start, n, self._staging_for(n), self._copier or HostCopier())
            for layer, ((pk, pv), (nk, nv)) in enumerate(zip(self._past_names, self._new_names)):
                self._bind(binding, pk, past_shape, kv.key_ptr(layer))  # the committed prefix, read in place
                self._bind(binding, pv, past_shape, kv.value_ptr(layer))
                self._bind(binding, nk, new_shape, rows.bind_key(layer), output=True)  # right after it, or staged
                self._bind(binding, nv, new_shape, rows.bind_value(layer), output=True)
        if self._logits_host.shape[0] < num_logits:
            self._logits_host = np.empty((num_logits, e.output_size), np.float32)
        # The first num_logits rows of the host buffer are contiguous: ORT copies just those rows out.
        binding.bind_output(io.logits, "cpu", 0, np.float32, [1, num_logits, e.output_size],
                            self._logits_host.ctypes.data)
        self.session.run_with_iobinding(binding)
        if rows is not None:
            rows.land()  # on the session's stream (user_compute_stream), so the next run reads the landed rows
        kv.length = start + n
        return self._logits_host[:num_logits]


class StaticStep:
    """One token count's fixed binding for a fused-GQA graph: what a captured CUDA graph replays.

    Bound once, at fixed, 256-byte aligned device addresses: ids ``[1, n]``, positions
    ``[1, n]``, ``seqlens_k`` ``[1]`` (written in place before each run), the whole
    head-major cache as past and present, and logits ``[1, n, output_size]``. The two host
    scalars are constants: ``num_logits_to_keep = n`` (a verify needs every row; a
    1-token step has one) and ``total_sequence_length = capacity``: with the shared
    buffer GQA takes each sequence's length from ``seqlens_k``, so the capacity gives
    the same logits (checked bit for bit on ORT CPU) and never changes between replays.
    Only the rows the caller asks for are copied back.
    """

    def __init__(self, engine: "OrtCudaEngine", n: int, kv: DeviceKVCache) -> None:
        import onnxruntime as ort

        e, io = engine.entry, engine.entry.io
        self.engine, self.n, self.kv = engine, n, kv
        device, dev = engine._device, engine.options.device_id
        self._inputs = DeviceBuffer(align_up(8 * n) * 2 + ALIGNMENT, device, dev)
        self.ids_ptr, self.positions_ptr = self._inputs.ptr, self._inputs.ptr + align_up(8 * n)
        self.seqlens_ptr = self._inputs.ptr + 2 * align_up(8 * n)
        self.row_floats = e.output_size
        self._logits = DeviceBuffer(4 * n * e.output_size, device, dev)
        self._host_logits = np.empty((n, e.output_size), np.float32)
        self._copy = _host_device_copier(device)
        b = self.binding = engine.session.io_binding()
        engine._bind(b, io.input_ids, [1, n], self.ids_ptr, dtype=np.int64)
        engine._bind(b, io.positions, [1, n], self.positions_ptr, dtype=np.int64)
        engine._bind(b, io.seqlens_k, [1], self.seqlens_ptr, dtype=np.int32)
        b.bind_cpu_input(io.num_logits, np.array([n], np.int64))
        b.bind_cpu_input(io.total_sequence_length, np.array(kv.capacity, np.int32))
        for layer, ((pk, pv), (nk, nv)) in enumerate(zip(engine._past_names, engine._new_names)):
            for past, new, ptr in ((pk, nk, kv.key_ptr(layer)), (pv, nv, kv.value_ptr(layer))):
                engine._bind(b, past, list(kv.shape), ptr)
                engine._bind(b, new, list(kv.shape), ptr, output=True)
        engine._bind(b, io.logits, [1, n, e.output_size], self._logits.ptr, output=True, dtype=np.float32)
        self.run_options = ort.RunOptions()
        if engine.cuda_graph:
            self.run_options.add_run_config_entry("gpu_graph_id", str(n))  # 1 = decode/draft, k+1 = a verify

    def write(self, ids: np.ndarray, positions: np.ndarray, seqlens: np.ndarray) -> None:
        """Values in place, before the run: the addresses the graph was bound (or captured) with stay."""
        for ptr, array in ((self.ids_ptr, ids), (self.positions_ptr, positions), (self.seqlens_ptr, seqlens)):
            self._copy.to_device(ptr, np.ascontiguousarray(array))

    def logits(self, rows: int) -> np.ndarray:
        """The last ``rows`` logits rows, copied back (only those)."""
        first = self.n - rows
        out = self._host_logits[:rows]
        self._copy.to_host(out, self._logits.ptr + 4 * first * self.row_floats)
        return out


class _HostCopy:
    """Host <-> "device" copies when the device is host memory (the engines' CPU mode)."""

    def to_device(self, ptr: int, array: np.ndarray) -> None:
        ctypes.memmove(ptr, array.ctypes.data, array.nbytes)

    def to_host(self, out: np.ndarray, ptr: int) -> None:
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)


class _CudartCopy:
    """Synchronous cudaMemcpy: the previous run has finished (ORT synchronises), and the next is not queued."""

    def __init__(self, cudart) -> None:
        self._cudart = cudart

    def to_device(self, ptr: int, array: np.ndarray) -> None:
        cuda_call(self._cudart.cudaMemcpy(ptr, array.ctypes.data, array.nbytes,
                                          self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy(step inputs)")

    def to_host(self, out: np.ndarray, ptr: int) -> None:
        cuda_call(self._cudart.cudaMemcpy(out.ctypes.data, ptr, out.nbytes,
                                          self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy(logits rows)")


def _host_device_copier(device: str):
    if device == "cpu":
        return _HostCopy()
    try:
        return _CudartCopy(import_cudart())
    except BackendUnavailableError:
        raise BackendUnavailableError("fixed-address steps write ids and positions into device memory in place, "
                                      "which needs cuda-python (pip install cuda-python)") from None


def resolve_provider_options(options: dict[str, str], root: Path) -> dict[str, str]:
    """The recorded EP options with their bundle-relative cache folders made absolute."""
    out = dict(options)
    for key in _PATH_OPTIONS:
        if key in out:
            out[key] = str(resolve_inside(root, out[key]))
    return out


def check_ort_trt_engine_file(root: Path, record: EngineRecord, role: str) -> None:
    """The EP's engine file must exist and match the record's sha256, whatever else lies in the cache folder.

    Records that name their file are checked against it. Older records (no ``engine_file``)
    need exactly one file with the record's key: none means the EP would rebuild for
    minutes, several mean a stale or foreign engine could be the one loaded.
    """
    if record.engine_file:
        path = resolve_inside(root, record.engine_file)
        if not path.is_file():
            raise BackendUnavailableError(f"the {role} TensorRT EP engine {record.engine_file} is missing; "
                                          f"{REBUILD_HINT}")
        verify_record_file(root, record, path, role)
        return
    found = sorted(resolve_inside(root, record.file).glob(f"{record.cache_key}*.engine"))
    if len(found) != 1:
        what = "no engine file" if not found else f"{len(found)} engine files"
        raise ChecksumError(f"the {role} TensorRT EP cache {record.file} holds {what} for key {record.cache_key}, "
                            f"so the recorded sha256 cannot be checked; {REBUILD_HINT}")
    if not record.sha256:
        raise ChecksumError(f"the {role} TensorRT EP engine has no recorded sha256; {REBUILD_HINT}")
    verify_record_file(root, record, found[0], role)


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
    check_ort_trt_engine_file(root, record, role)
    source = resolve_inside(root, record.graph) if record.graph else graph
    return OrtCudaEngine(entry, source, options, resolve_provider_options(record.provider_options, root),
                         max_tokens=record.max_new_tokens(entry.io), stream=own_stream(options.device_id),
                         logits_rows_from_shape=bool(record.graph))
