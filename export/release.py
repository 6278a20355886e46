"""Give memory freed by one export phase back to the system before the next phase starts.

An ONNX Runtime session, a dequantized tensor or a streamed module's weights are freed by the
collector (sessions sit in reference cycles), but glibc's allocator keeps freed heap pages for
reuse, so the resident set a phase leaves behind is the next phase's floor. ``malloc_trim(0)``
returns them: on a Qwen2.5-Coder-0.5B GGUF export it lowered the RSS at the start of the GGUF
import from 0.86 to 0.65 GB (docs/results/2026-12-06-export-memory-2.md). Other C libraries
(musl, macOS) have no such call; there the collector alone runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_memory() -> None:
    """Collect unreachable objects (an ORT session's cycle) and hand freed heap pages back to the system."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
