"""Native TensorRT engine, and the runtime half of the TensorRT contract.

A TensorRT engine is compiled for one TensorRT version and one GPU model, so a
bundle records how each engine was built (:class:`EngineRecord`, stored under
manifest ``extra["engines"][role]``) and :func:`check_engine_compatible`
refuses an engine this machine cannot run *before* TensorRT is asked to.

:class:`TensorrtEngine` implements the Engine protocol on a deserialized plan:
one execution context on its own CUDA stream, the optimization profile chosen
per call from (new tokens, cached positions), and a device-resident KV cache
(:class:`CudaKVCache`) whose prefix is bound as the past input while the new
K/V outputs are bound at the address of position ``length``, so the engine
writes them in place and rollback stays a length change.

``tensorrt`` and ``cuda-python`` are imported lazily; when either is missing
the engine raises :class:`BackendUnavailableError`. The pure parts (profiles,
records, the compatibility check, profile selection, chunking) need neither
and are tested on CPU. Everything that touches a GPU is unverified on hardware
(see docs/GPU.md).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import numpy as np

from ..bundle.extra import EngineRecord, Profile, ShapeRange
from ..errors import BackendUnavailableError, ChecksumError, InvalidParameterError, ModelLoadError
from ..bundle.manifest import ModelEntry, ModelIO, load_manifest, resolve_inside, sha256_file
from .base import EngineOptions, Interrupt, KVCache
from .device import ALIGNMENT, BlockAddresses, CacheBlock, CudartCopier, NewRows, cuda_call, import_cudart, is_aligned

REBUILD_HINT = "rebuild with `specedge export --engine tensorrt`"
# specedge graphs take int64 ids/positions; TensorRT accepts int64 network inputs from 10.0.
MIN_TENSORRT_MAJOR = 10
# ONNX Runtime's TensorRT EP links libnvinfer.so.10 in every onnxruntime-gpu release this was written
# against (1.18 .. 1.31); `pip install tensorrt` now gives TensorRT 11, which the EP cannot load.
ORT_TRT_EP_TENSORRT_MAJOR = 10


# --------------------------------------------------------------------------- profiles


def select_profile(profiles: list[Profile] | tuple[Profile, ...], io: ModelIO, n: int, past: int) -> int:
    """Index of the profile for a call with ``n`` new tokens after ``past`` cached positions.

    Of the profiles that fit, the one with the smallest new-token maximum wins: the
    decode/verify profile was tuned for k+1 tokens, the prefill profile for long prompts.
    """
    fitting = []
    for i, p in enumerate(profiles):
        (n_lo, n_hi), (past_lo, past_hi) = p.new_tokens(io), p.past_length(io)
        if n_lo <= n <= n_hi and past_lo <= past <= past_hi:
            fitting.append((n_hi, i))
    if not fitting:
        ranges = ", ".join(f"{p.name}: tokens {p.new_tokens(io)}, past {p.past_length(io)}" for p in profiles)
        raise InvalidParameterError(f"no TensorRT profile covers {n} new tokens after {past} cached ({ranges})")
    return min(fitting)[1]


def split_tokens(n: int, num_logits: int, max_tokens: int) -> list[int]:
    """Chunk sizes for a forward of ``n`` tokens through profiles that take at most ``max_tokens``.

    Chunked prefill is exact (the graph takes any past length); the last chunk must hold
    the ``num_logits`` positions whose logits are returned.
    """
    if not 1 <= num_logits <= max_tokens:
        raise InvalidParameterError(f"{num_logits} logits rows exceed the engine's {max_tokens}-token profiles")
    if n <= max_tokens:
        return [n]
    sizes = [max_tokens] * (n // max_tokens) + ([n % max_tokens] if n % max_tokens else [])
    if sizes[-1] < num_logits:  # move tokens from the chunk before so the last one holds every logits row
        deficit = num_logits - sizes[-1]
        sizes[-2] -= deficit
        sizes[-1] += deficit
    return sizes


def forward_in_chunks(run: Callable[[np.ndarray, KVCache, int], np.ndarray], input_ids: np.ndarray, kv: KVCache,
                      num_logits: int, max_tokens: int | None) -> np.ndarray:
    """Call ``run(ids, kv, num_logits)`` (which advances kv.length) on chunks of at most ``max_tokens``."""
    n = int(input_ids.shape[0])
    if n < 1:
        raise InvalidParameterError("forward needs at least one token")
    num_logits = max(1, min(num_logits, n))
    kv.reserve(n)
    sizes = [n] if max_tokens is None else split_tokens(n, num_logits, max_tokens)
    offset = 0
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        logits = run(input_ids[offset:offset + size], kv, num_logits if last else 1)
        offset += size
    return logits


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RuntimeFacts:
    """What this machine offers an engine; None where it cannot be determined."""

    tensorrt_version: str | None
    gpu_name: str | None
    compute_capability: str | None
    onnxruntime_version: str | None = None  # compared for the ort-trt route only


def tensorrt_graph_problem(attention: str, precision: str, role: str = "model") -> str | None:
    """Why TensorRT cannot take a graph whole (ORT contrib ops would leave it, to run on the CPU), or None."""
    if attention == "gqa":
        return (f"the {role} graph uses ONNX Runtime's fused GroupQueryAttention, which TensorRT cannot parse; "
                "export with --attention standard for TensorRT")
    if precision in ("int4", "int8"):
        return (f"the {role} model is {precision}: MatMulNBits, an ONNX Runtime operator TensorRT cannot parse; "
                "run it on the CUDA EP (backend onnxruntime-gpu, provider cuda), or export it at fp16 for TensorRT")
    return None


def check_tensorrt_graph(entry: ModelEntry, role: str = "model") -> None:
    problem = tensorrt_graph_problem(entry.attention, entry.precision, role)
    if problem:
        raise InvalidParameterError(problem)


def major_minor_patch(version: str) -> str:
    """'10.3.0.26' -> '10.3.0': plans carry major.minor.patch; the build number does not change the format."""
    return ".".join(version.split(".")[:3])


def major_minor(version: str) -> str:
    """'1.31.1' -> '1.31': ONNX Runtime's patch releases keep the TensorRT EP's cache layout."""
    return ".".join(version.split(".")[:2])


def check_engine_compatible(record: EngineRecord, facts: RuntimeFacts, role: str = "model") -> None:
    """Raise BackendUnavailableError when this machine cannot run the recorded engine.

    TensorRT plans are tied to the exact TensorRT version and, unless built
    hardware-compatible (specedge does not), to one GPU model. A fact this machine
    cannot determine (None) or the builder did not record ("") is not compared.
    """
    checks = [
        ("TensorRT", record.tensorrt_version and major_minor_patch(record.tensorrt_version),
         facts.tensorrt_version and major_minor_patch(facts.tensorrt_version)),
        ("compute capability", record.compute_capability, facts.compute_capability),
        ("GPU", record.gpu_name, facts.gpu_name),
    ]
    if record.route == "ort-trt":
        # The EP names and validates its cache files its own way, which has changed between ONNX Runtime
        # releases; another release may ignore the cache and rebuild for minutes inside the bundle.
        checks.append(("ONNX Runtime", record.onnxruntime_version and major_minor(record.onnxruntime_version),
                       facts.onnxruntime_version and major_minor(facts.onnxruntime_version)))
    for what, built, here in checks:
        if built and here and built != here:
            raise BackendUnavailableError(
                f"the {role} TensorRT engine was built for {what} {built} but this machine has {what} {here}; "
                f"{REBUILD_HINT}")


# --------------------------------------------------------------------------- machine facts


def import_tensorrt():
    """The ``tensorrt`` module, or BackendUnavailableError saying how to install it."""
    try:
        import tensorrt as trt
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but libnvinfer is not
        raise BackendUnavailableError(
            f"TensorRT's Python package is not usable here ({exc}); install it from NVIDIA's index "
            "(pip install --extra-index-url https://pypi.nvidia.com 'tensorrt-cu13==10.*', or tensorrt-cu12 for a "
            "CUDA 12 machine; docs/GPU.md)") from None
    major = int(trt.__version__.split(".")[0])
    if major < MIN_TENSORRT_MAJOR:
        raise BackendUnavailableError(f"TensorRT {trt.__version__} is too old: specedge graphs take int64 inputs, "
                                      f"which TensorRT supports from {MIN_TENSORRT_MAJOR}.0")
    return trt


def _libnvinfer_version() -> str | None:
    """TensorRT's version from libnvinfer itself, for machines without the tensorrt module."""
    names = ["libnvinfer.so.11", "libnvinfer.so.10", "libnvinfer.so"]
    spec = importlib.util.find_spec("tensorrt_libs")  # where NVIDIA's wheel puts the libraries
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
        names = [str(folder / n) for n in names] + names
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.getInferLibVersion.restype = ctypes.c_int32
        v = int(lib.getInferLibVersion())
        # NvInferVersion.h: major*10000 + minor*100 + patch from TensorRT 10 (8.x used major*1000).
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 100000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    return None


def check_ort_trt_tensorrt(version: str | None) -> None:
    """Refuse a TensorRT whose major ORT's TensorRT EP does not load (None: unknown, not refused)."""
    if version and int(version.split(".")[0]) != ORT_TRT_EP_TENSORRT_MAJOR:
        raise BackendUnavailableError(
            f"ONNX Runtime's TensorRT EP needs TensorRT {ORT_TRT_EP_TENSORRT_MAJOR}.x but this machine has TensorRT "
            f"{version}; install TensorRT {ORT_TRT_EP_TENSORRT_MAJOR} next to it (docs/GPU.md), or use "
            "--trt-route native, which runs on TensorRT 10 and 11")


def tensorrt_version() -> str | None:
    try:
        import tensorrt as trt

        return str(trt.__version__)
    except (ImportError, OSError):
        return _libnvinfer_version()


def nvidia_smi_gpus() -> list[dict[str, Any]]:
    """GPUs as nvidia-smi lists them (PCI order); [] when nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    fields = ["index", "name", "compute_cap", "memory.total", "driver_version"]
    for query in (fields, [f for f in fields if f != "compute_cap"]):  # compute_cap needs driver >= 510
        try:
            out = subprocess.run([exe, f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return []
        if out.returncode == 0:
            break
    else:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        row = dict(zip(query, (cell.strip() for cell in line.split(","))))
        gpus.append({"index": int(row["index"]), "name": row["name"],
                     "compute_capability": row.get("compute_cap"),
                     "memory_mib": int(row["memory.total"]) if row["memory.total"].isdigit() else None,
                     "driver": row["driver_version"]})
    return gpus


def _gpu_facts(device_id: int) -> tuple[str | None, str | None]:
    try:
        cudart = import_cudart()
        prop = cuda_call(cudart.cudaGetDeviceProperties(device_id), "cudaGetDeviceProperties")
        name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
        return name.rstrip("\x00").strip(), f"{prop.major}.{prop.minor}"
    except BackendUnavailableError:
        pass
    # nvidia-smi counts in PCI order; a numeric CUDA_VISIBLE_DEVICES renumbers what CUDA sees.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [int(v) for v in visible.split(",") if v.strip().isdigit()]
    physical = ids[device_id] if device_id < len(ids) else device_id
    for gpu in nvidia_smi_gpus():
        if gpu["index"] == physical:
            return gpu["name"], gpu["compute_capability"]
    return None, None


def runtime_facts(device_id: int = 0) -> RuntimeFacts:
    name, capability = _gpu_facts(device_id)
    try:
        import onnxruntime as ort

        ort_version: str | None = str(ort.__version__)
    except ImportError:
        ort_version = None
    return RuntimeFacts(tensorrt_version=tensorrt_version(), gpu_name=name, compute_capability=capability,
                        onnxruntime_version=ort_version)


def bundle_engine_record(entry: ModelEntry, graph: Path) -> tuple[Path, str, EngineRecord | None]:
    """(bundle root, role, the role's engine record or None) for a model whose graph is ``graph``."""
    root = Path(graph)
    for _ in PurePosixPath(entry.graph).parts:
        root = root.parent
    manifest = load_manifest(root, verify_checksums=False)  # checksums are the loader's job (Generator.from_bundle)
    role = next((r for r, m in manifest.models().items() if m.graph == entry.graph), "model")
    return root, role, manifest.extra.engines.get(role)


# --------------------------------------------------------------------------- native engine


class CudaKVCache(BlockAddresses, KVCache):
    """KVCache interface over one ``cudaMalloc`` block, ``[capacity, n_kv_heads, head_dim]`` per layer and K/V.

    ``keys[i]`` / ``values[i]`` are device pointers (int), each 256-byte aligned (the
    block's layout is :class:`specedge.engines.device.CacheBlock`). Position-major, so
    the committed prefix is contiguous and position p starts ``p * row_bytes`` in.
    """

    copies_prefix = False  # a device block: a prefix another slot holds is recomputed, not copied

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: np.dtype,
                 cudart) -> None:
        self._cudart = cudart
        self.layout = "position-major"  # the only layout TensorRT graphs have (no fused GQA)
        self.dtype = np.dtype(dtype)
        self.shape = (capacity, n_kv_heads, head_dim)
        self.row_bytes = n_kv_heads * head_dim * self.dtype.itemsize
        self.capacity = capacity
        self.length = 0
        self.block = CacheBlock(n_layers, self.row_bytes, capacity)
        self.place(int(cuda_call(cudart.cudaMalloc(self.block.nbytes), "cudaMalloc(KV cache)")))

    def to_host(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the committed ``[:length]`` K and V of one layer (for tests and debugging)."""
        out = []
        for ptr in (self.key_ptr(layer), self.value_ptr(layer)):
            host = np.empty((self.length,) + self.shape[1:], self.dtype)
            if host.nbytes:
                cuda_call(self._cudart.cudaMemcpy(host.ctypes.data, ptr, host.nbytes,
                                                  self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
            out.append(host)
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        return 2 * len(self.keys) * self.capacity * self.row_bytes

    def close(self) -> None:
        if self.base:
            self._cudart.cudaFree(self.base)
        self.base, self.keys, self.values = 0, [], []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown may have torn cuda-python down already
            pass


class _Pinned:
    """Page-locked host memory seen as a numpy array, so H2D/D2H copies are truly async."""

    def __init__(self, cudart, count: int, dtype: np.dtype) -> None:
        self._cudart = cudart
        dtype = np.dtype(dtype)
        self.ptr = int(cuda_call(cudart.cudaMallocHost(max(1, count) * dtype.itemsize), "cudaMallocHost"))
        ctype = np.ctypeslib.as_ctypes_type(dtype)
        self.array = np.ctypeslib.as_array(ctypes.cast(self.ptr, ctypes.POINTER(ctype)), shape=(max(1, count),))

    def __del__(self) -> None:
        try:
            self._cudart.cudaFreeHost(self.ptr)
        except Exception:
            pass


def trt_check(ok: Any, what: str) -> None:
    """TensorRT's setters report failure by returning False (and logging why): make that an error."""
    if ok is False:
        raise BackendUnavailableError(f"TensorRT refused {what} (see the TensorRT log above)")


class TensorrtEngine:
    """Runs a serialized TensorRT plan of one bundle model; see :class:`specedge.engines.base.Engine`.

    Every address set with ``set_tensor_address`` is 256-byte aligned (TensorRT's
    requirement): device buffers come from cudaMalloc, the cache from one aligned
    block, and new K/V rows at a misaligned position are staged (engines/device.py).
    ``num_logits_to_keep`` is either a host shape tensor (graphs as exported: its value
    feeds a Slice; TensorRT reads it from pinned host memory at enqueue, no stream sync)
    or, in plans built from :func:`specedge.export.trt_graph.logits_rows_from_shape`'s
    rewrite, an execution tensor whose *length* is the row count (nothing is read back).
    """

    def __init__(self, entry: ModelEntry, plan_path: Path, options: EngineOptions = EngineOptions(),
                 record: EngineRecord | None = None, role: str = "model") -> None:
        check_tensorrt_graph(entry, role)
        trt = import_tensorrt()
        cudart = self._cudart = import_cudart()
        if record is not None:
            check_engine_compatible(record, runtime_facts(options.device_id), role)
        self.entry = entry
        self.options = options
        self.vocab_size = entry.vocab_size
        self.output_size = entry.output_size
        self.max_context = entry.max_context
        self._kv_dtype = np.dtype(entry.kv_dtype)
        cuda_call(cudart.cudaSetDevice(options.device_id), "cudaSetDevice")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise ModelLoadError(f"TensorRT could not deserialize {Path(plan_path).name} (see the TensorRT log "
                                 f"above): corrupt, or built by another TensorRT; {REBUILD_HINT}")
        self._check_io(trt)
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise BackendUnavailableError(f"TensorRT could not create an execution context for {entry.graph} "
                                          "(out of device memory?)")
        # Each engine owns a stream, so a draft and a target engine can run concurrently on one GPU.
        self.stream = int(cuda_call(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                                    "cudaStreamCreateWithFlags"))
        io = entry.io
        self.profiles = tuple(self._read_profile(i) for i in range(self.engine.num_optimization_profiles))
        self.interrupt: Interrupt | None = None  # the running generation's cancel (engines/base.py Engine)
        self.max_tokens = max(p.new_tokens(io)[1] for p in self.profiles)
        self._active_profile = -1
        # As exported, num_logits_to_keep feeds a Slice start: a shape tensor TensorRT reads from host memory.
        self._keep_on_host = bool(self.engine.is_shape_inference_io(io.num_logits))
        self._ids = _Pinned(cudart, self.max_tokens, np.int64)
        self._positions = _Pinned(cudart, self.max_tokens, np.int64)
        self._keep = _Pinned(cudart, 1, np.int64)
        self._ids_dev = int(cuda_call(cudart.cudaMalloc(self.max_tokens * 8), "cudaMalloc"))
        self._positions_dev = int(cuda_call(cudart.cudaMalloc(self.max_tokens * 8), "cudaMalloc"))
        # The rewritten graph's row-count tensor: only its length matters, its bytes are never read.
        self._rows_dev = int(cuda_call(cudart.cudaMalloc(self.max_tokens * 8), "cudaMalloc"))
        row_bytes = entry.n_kv_heads * entry.head_dim * self._kv_dtype.itemsize
        self._staging = None
        if row_bytes % ALIGNMENT:  # some positions' rows start misaligned: stage new rows there
            block = CacheBlock(entry.n_layers, row_bytes, self.max_tokens)
            self._staging = (block, int(cuda_call(cudart.cudaMalloc(block.nbytes), "cudaMalloc(staging)")))
        self._copier = CudartCopier(cudart, self.stream)
        # Logits rows for the largest verify; a caller asking for more rows grows them once. Sizing for
        # the prefill limit instead would hold 512 x vocab floats (300 MB at a 150k vocab) twice.
        self._logits_rows = 0
        self._grow_logits(min(p.new_tokens(io)[1] for p in self.profiles))
        self._layers = [(io.past_key % i, io.past_value % i, io.new_key % i, io.new_value % i)
                        for i in range(entry.n_layers)]

    def _grow_logits(self, rows: int) -> None:
        if rows <= self._logits_rows:
            return
        if self._logits_rows:
            self._cudart.cudaFree(self._logits_dev)
        self._logits = _Pinned(self._cudart, rows * self.output_size, np.float32)
        self._logits_dev = int(cuda_call(self._cudart.cudaMalloc(rows * self.output_size * 4), "cudaMalloc"))
        self._logits_rows = rows

    def _check_io(self, trt) -> None:
        io, e = self.entry.io, self.entry
        have = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        need = {*io.inputs(e.n_layers, e.attention), *io.outputs(e.n_layers, e.attention)}
        missing = sorted(need - have)
        if missing:
            raise ModelLoadError(f"TensorRT engine for {e.graph} lacks tensors the manifest names: {missing[:6]}; "
                                 f"{REBUILD_HINT}")
        kv_type = np.dtype(trt.nptype(self.engine.get_tensor_dtype(io.past_key % 0)))
        if kv_type != self._kv_dtype:
            raise ModelLoadError(f"TensorRT engine for {e.graph} takes {kv_type} K/V but the manifest says "
                                 f"{self._kv_dtype}; {REBUILD_HINT}")

    def _read_profile(self, index: int) -> Profile:
        """The new-token and past-length ranges of one profile, as the plan itself records them."""
        io = self.entry.io
        shapes = {}
        for name in (io.input_ids, io.past_key % 0):
            lo, mid, hi = self.engine.get_tensor_profile_shape(name, index)
            shapes[name] = ShapeRange(tuple(lo), tuple(mid), tuple(hi))
        return Profile(name=f"profile{index}", shapes=shapes)

    def new_cache(self) -> CudaKVCache:
        e = self.entry
        return CudaKVCache(e.n_layers, e.n_kv_heads, e.head_dim, e.max_context, self._kv_dtype, self._cudart)

    def forward(self, input_ids: np.ndarray, kv: CudaKVCache, num_logits: int = 1) -> np.ndarray:
        """Run n new tokens; returns float32 ``[num_logits, output_size]``, a view valid until the next call."""
        if not isinstance(kv, CudaKVCache):
            raise InvalidParameterError("TensorrtEngine.forward needs the cache from its own new_cache()")
        if self.interrupt is not None:  # a GPU step is short: a cancel refuses the next one, not this one
            self.interrupt.check()
        ids = np.ascontiguousarray(input_ids, dtype=np.int64).reshape(-1)
        return forward_in_chunks(self._run, ids, kv, num_logits, self.max_tokens)

    def _bind(self, name: str, ptr: int) -> None:
        if not is_aligned(ptr):  # TensorRT's rule; the buffers above are built to keep it
            raise BackendUnavailableError(f"{name} would be bound at {ptr:#x}, not {ALIGNMENT}-byte aligned")
        trt_check(self.context.set_tensor_address(name, ptr), f"the address of {name}")

    def _shape(self, name: str, shape: tuple[int, ...]) -> None:
        trt_check(self.context.set_input_shape(name, shape), f"shape {shape} for {name}")

    def _run(self, ids: np.ndarray, kv: CudaKVCache, num_logits: int) -> np.ndarray:
        cudart, ctx, io, e = self._cudart, self.context, self.entry.io, self.entry
        n, start = int(ids.shape[0]), kv.length
        # The loop's pipelined mode calls the target from a worker thread, whose current device is 0.
        cuda_call(cudart.cudaSetDevice(self.options.device_id), "cudaSetDevice")
        profile = select_profile(self.profiles, io, n, start)
        self._grow_logits(num_logits)
        if profile != self._active_profile:
            try:  # the Python binding raises where the C++ API returns false
                ok = ctx.set_optimization_profile_async(profile, self.stream)
            except RuntimeError as exc:
                raise BackendUnavailableError(f"TensorRT refused optimization profile {profile}: {exc}") from None
            trt_check(ok, f"optimization profile {profile}")
            self._active_profile = profile
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._ids.array[:n] = ids
        self._positions.array[:n] = np.arange(start, start + n, dtype=np.int64)
        self._keep.array[0] = num_logits
        cuda_call(cudart.cudaMemcpyAsync(self._ids_dev, self._ids.ptr, n * 8, h2d, self.stream), "cudaMemcpyAsync")
        cuda_call(cudart.cudaMemcpyAsync(self._positions_dev, self._positions.ptr, n * 8, h2d, self.stream),
                  "cudaMemcpyAsync")

        self._shape(io.input_ids, (1, n))
        self._shape(io.positions, (1, n))
        self._bind(io.input_ids, self._ids_dev)
        self._bind(io.positions, self._positions_dev)
        if self._keep_on_host:  # a host shape tensor: TensorRT reads its value at enqueue
            trt_check(ctx.set_tensor_address(io.num_logits, self._keep.ptr), f"the address of {io.num_logits}")
        else:  # the rewritten graph: the row count is this tensor's length
            self._shape(io.num_logits, (num_logits,))
            self._bind(io.num_logits, self._rows_dev)
        past_shape = (start, e.n_kv_heads, e.head_dim)
        rows = NewRows(kv.block, kv.base, start, n, self._staging, self._copier)
        for layer, (pk, pv, nk, nv) in enumerate(self._layers):
            self._shape(pk, past_shape)
            self._shape(pv, past_shape)
            self._bind(pk, kv.key_ptr(layer))  # the committed prefix, read in place
            self._bind(pv, kv.value_ptr(layer))
            self._bind(nk, rows.bind_key(layer))  # new K/V: in place right after it, or staged when misaligned
            self._bind(nv, rows.bind_value(layer))
        self._bind(io.logits, self._logits_dev)
        if not ctx.execute_async_v3(self.stream):
            raise BackendUnavailableError(f"TensorRT failed to run {e.graph} on {n} tokens after {start} cached "
                                          "(see the TensorRT log above)")
        rows.land()  # queued on the same stream, so it follows the run
        count = num_logits * e.output_size
        cuda_call(cudart.cudaMemcpyAsync(self._logits.ptr, self._logits_dev, count * 4,
                                         cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream),
                  "cudaMemcpyAsync")
        cuda_call(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        kv.length = start + n
        # The graph's logits are output_size wide: a truncated draft head scores head_size tokens.
        return self._logits.array[:count].reshape(num_logits, e.output_size)


def create_tensorrt_engine(entry: ModelEntry, graph: Path, options: EngineOptions) -> TensorrtEngine:
    """The ``tensorrt`` backend: the plan the bundle's engine record names for this model."""
    root, role, record = bundle_engine_record(entry, graph)
    if record is None or record.route != "native":
        raise BackendUnavailableError(f"the bundle has no native TensorRT engine for its {role} model; build one "
                                      "with `specedge export --engine tensorrt --trt-route native`")
    plan = resolve_inside(root, record.file)
    if not plan.is_file():
        raise BackendUnavailableError(f"the {role} TensorRT plan {record.file} is missing; {REBUILD_HINT}")
    return TensorrtEngine(entry, plan, options, record, role)


def verify_record_file(root: Path, record: EngineRecord, path: Path, role: str) -> None:
    """Refuse an engine file whose sha256 differs from the record (corrupt or replaced)."""
    if record.sha256 and path.is_file() and sha256_file(path) != record.sha256:
        raise ChecksumError(f"the {role} TensorRT engine {path.relative_to(root)} differs from the one the "
                            f"manifest records (corrupt or replaced); {REBUILD_HINT}")
