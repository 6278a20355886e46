"""Backends that run one compiled model behind the Engine protocol.

Backends come from a registry; a missing backend or execution provider raises
:class:`specedge.errors.BackendUnavailableError` (tests turn it into a skip).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import BackendUnavailableError
from ..manifest import ModelEntry
from .base import Engine, EngineOptions, KVCache


def _ort(entry: ModelEntry, graph: Path, options: EngineOptions) -> Engine:
    from .ort import OrtEngine

    return OrtEngine(entry, graph, options)


BACKENDS: dict[str, Callable[[ModelEntry, Path, EngineOptions], Engine]] = {"onnxruntime": _ort}


def create_engine(entry: ModelEntry, graph: Path, options: EngineOptions = EngineOptions(),
                  backend: str = "onnxruntime") -> Engine:
    """Build the engine for one bundle model. ``graph`` is the resolved .onnx path."""
    try:
        factory = BACKENDS[backend]
    except KeyError:
        raise BackendUnavailableError(f"unknown engine backend {backend!r}; known: {', '.join(BACKENDS)}") from None
    return factory(entry, graph, options)


__all__ = ["BACKENDS", "Engine", "EngineOptions", "KVCache", "create_engine"]
