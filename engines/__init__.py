"""Backends that run one compiled model behind the Engine protocol.

Backends come from a registry; a missing backend or execution provider raises
:class:`specedge.errors.BackendUnavailableError` (tests turn it into a skip).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import BackendUnavailableError
from ..bundle.manifest import ModelEntry
from .base import Engine, EngineOptions, KVCache


def _ort(entry: ModelEntry, graph: Path, options: EngineOptions) -> Engine:
    from .ort import OrtEngine

    return OrtEngine(entry, graph, options)


def _ort_gpu(entry: ModelEntry, graph: Path, options: EngineOptions) -> Engine:
    from .ort_cuda import create_ort_gpu_engine

    return create_ort_gpu_engine(entry, graph, options)


def _tensorrt(entry: ModelEntry, graph: Path, options: EngineOptions) -> Engine:
    from .tensorrt import create_tensorrt_engine

    return create_tensorrt_engine(entry, graph, options)


BACKENDS: dict[str, Callable[[ModelEntry, Path, EngineOptions], Engine]] = {
    "onnxruntime": _ort,
    "onnxruntime-gpu": _ort_gpu,  # CUDA / TensorRT EP with a device-resident KV cache
    "tensorrt": _tensorrt,  # a native TensorRT plan the bundle records
}


def backend_for(entry: ModelEntry, graph: Path, provider: str) -> str:
    """The backend that runs ``entry`` on ``provider``: the bundle's engine record decides TensorRT.

    cpu: ``onnxruntime``. cuda: ``onnxruntime-gpu``. tensorrt: ``tensorrt`` when the bundle
    records a native plan for this model (``export --trt-route native``), else the TensorRT
    EP through ``onnxruntime-gpu``.
    """
    if provider == "cpu":
        return "onnxruntime"
    if provider == "tensorrt":
        from .tensorrt import bundle_engine_record

        record = bundle_engine_record(entry, graph)[2]
        if record is not None and record.route == "native":
            return "tensorrt"
    return "onnxruntime-gpu"


def create_engine(entry: ModelEntry, graph: Path, options: EngineOptions = EngineOptions(),
                  backend: str = "onnxruntime") -> Engine:
    """Build the engine for one bundle model. ``graph`` is the resolved .onnx path.

    Refuses (BackendUnavailableError, with the fix) an environment with no ONNX Runtime
    or with two ORT packages writing the same folder (onnxruntime and onnxruntime-gpu).
    """
    from .providers import check_onnxruntime_install

    check_onnxruntime_install()
    try:
        factory = BACKENDS[backend]
    except KeyError:
        raise BackendUnavailableError(f"unknown engine backend {backend!r}; known: {', '.join(BACKENDS)}") from None
    return factory(entry, graph, options)


def runtime_description(backend: str, provider: str) -> str:
    """What computes a model's numbers, for keys that must change when the kernels may
    (a persisted prompt cache): ``"<backend> <onnxruntime version> <provider>"``."""
    import onnxruntime

    return f"{backend} {onnxruntime.__version__} {provider}"


__all__ = ["BACKENDS", "backend_for", "runtime_description", "Engine", "EngineOptions", "KVCache", "create_engine"]
