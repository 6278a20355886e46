"""Which ONNX Runtime package is installed, and which execution providers actually load.

Two facts that ``onnxruntime.get_available_providers()`` does not give:

* **One package.** ``onnxruntime`` and ``onnxruntime-gpu`` (and the other ORT builds)
  all install the same ``onnxruntime`` folder. With two of them installed, the files
  of the last one installed win, partly, and pip uninstalling either breaks the other.
  :func:`check_onnxruntime_install` refuses that state with the exact fix.
* **Loadable, not compiled in.** ``get_available_providers()`` lists the providers
  compiled into the build (onnxruntime#13501): onnxruntime-gpu lists TensorRT on a
  machine without TensorRT. :func:`probe_provider` creates a session on a 1-node graph
  with the provider, runs it, and checks the answer, reporting why it could not.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import importlib.util
import io
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError

# Distributions that install the `onnxruntime` import package (PyPI names; Jetson wheels are onnxruntime-gpu).
ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino",
                     "onnxruntime-qnn", "onnxruntime-training", "ort-nightly", "ort-nightly-gpu")
INSTALL_FIX = ("pip uninstall -y {names} && pip install 'specedge[gpu]' on an NVIDIA machine, or "
               "'specedge[cpu]' elsewhere (on a Jetson, reinstall the JetPack onnxruntime-gpu wheel instead)")

# y = x + 1 on float [1] (opset 17, IR 8); the bytes onnx.helper writes for it (tests rebuild and compare).
# Embedded so the edge install (no `onnx` package) can probe providers.
PROBE_GRAPH = bytes.fromhex(
    "0808120e73706563656467652d70726f62653a4c0a100a01780a036f6e651201792203416464120570726f62652a0f0801100122"
    "040000803f42036f6e655a0f0a0178120a0a08080112040a020801620f0a0179120a0a08080112040a02080142040a001011")


def installed_onnxruntime_distributions() -> list[str]:
    """The installed distributions, of :data:`ORT_DISTRIBUTIONS`, that own the ``onnxruntime`` folder."""
    found = []
    for name in ORT_DISTRIBUTIONS:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def onnxruntime_install_problem(installed: list[str]) -> str | None:
    """Why this set of installed ORT distributions cannot work, with the fix; None when it can."""
    if not installed:
        return ("ONNX Runtime is not installed: pip install 'specedge[cpu]' (or 'specedge[gpu]' with an NVIDIA "
                "GPU; on a Jetson, the JetPack onnxruntime-gpu wheel)")
    if len(installed) > 1:
        return (f"{' and '.join(installed)} are all installed, and each writes the same `onnxruntime` folder, so "
                f"neither works reliably; fix: {INSTALL_FIX.format(names=' '.join(installed))}")
    return None


@lru_cache(maxsize=1)
def check_onnxruntime_install() -> str:
    """The one installed ORT distribution's name; raise BackendUnavailableError for none or several."""
    installed = installed_onnxruntime_distributions()
    problem = onnxruntime_install_problem(installed)
    if problem:
        raise BackendUnavailableError(problem)
    return installed[0]


def preload_tensorrt_libs(major: int) -> list[str]:
    """Load TensorRT ``major``'s libraries from NVIDIA's pip wheel (``tensorrt_libs``) with RTLD_GLOBAL.

    The wheel puts libnvinfer in ``site-packages/tensorrt_libs``, off the loader path, so
    ORT's TensorRT EP, which dlopens ``libnvinfer.so.<major>`` by name, would not find it;
    once a library with that soname is loaded, the EP's dlopen returns it. Returns the
    files loaded ([] without the wheel, or without that major's files in it).
    """
    spec = importlib.util.find_spec("tensorrt_libs")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations)))
    loaded = []
    for name in (f"libnvinfer.so.{major}", f"libnvinfer_plugin.so.{major}", f"libnvonnxparser.so.{major}"):
        path = folder / name
        if path.is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue  # the probe then reports the EP's own error, which names the missing dependency
            loaded.append(str(path))
    return loaded


@dataclass(frozen=True)
class ProviderProbe:
    """What one provider did on the probe graph."""

    provider: str  # specedge's name: cpu, cuda, tensorrt
    compiled: bool  # listed by onnxruntime.get_available_providers()
    loadable: bool  # a session ran on it and computed 1 + 1 = 2
    reason: str | None  # why not, when not loadable

    def to_json(self) -> dict:
        return {"compiled": self.compiled, "loadable": self.loadable, "reason": self.reason}


@contextlib.contextmanager
def _captured_stderr():
    """Capture file descriptor 2 (ORT's C++ logger writes there, not through sys.stderr)."""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            box: list[str] = []
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.append(tmp.read().decode(errors="replace"))


def _error_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "fail" in line.lower()]
    return (errors or lines or [None])[-1]


def probe_provider(provider: str, device_id: int = 0) -> ProviderProbe:
    """Create a session for ``provider`` on :data:`PROBE_GRAPH`, run it, and say whether it worked and why not."""
    import onnxruntime as ort

    from .ort import _ORT_PROVIDER, session_providers
    from .tensorrt import ORT_TRT_EP_TENSORRT_MAJOR, check_ort_trt_tensorrt, tensorrt_version

    ep = _ORT_PROVIDER[provider]
    if ep not in ort.get_available_providers():
        hint = " (it comes with onnxruntime-gpu)" if provider != "cpu" else ""
        return ProviderProbe(provider, False, False, f"{ep} is not built into this onnxruntime package{hint}")
    if provider == "tensorrt":
        try:
            check_ort_trt_tensorrt(tensorrt_version())
        except BackendUnavailableError as exc:
            return ProviderProbe(provider, True, False, str(exc))
        preload_tensorrt_libs(ORT_TRT_EP_TENSORRT_MAJOR)
    device = {} if provider == "cpu" else {"device_id": str(device_id)}
    so = ort.SessionOptions()
    so.log_severity_level = 3  # errors only: the reason, not ORT's warnings about the tiny graph
    reason = None
    with _captured_stderr() as log, contextlib.redirect_stdout(io.StringIO()):
        try:
            # enable_fallback=0: ORT's Python wrapper would otherwise retry on CUDA/CPU and print the error.
            session = ort.InferenceSession(PROBE_GRAPH, so, providers=session_providers(provider, device, device),
                                           enable_fallback=0)
            if ep not in session.get_providers():
                reason = f"ONNX Runtime created the session without {ep}"
            else:
                y = session.run(None, {"x": np.ones(1, np.float32)})[0]
                if not np.array_equal(y, np.full(1, 2, np.float32)):
                    reason = f"{ep} computed 1 + 1 = {y.tolist()}"
        except Exception as exc:  # ORT raises its own Fail/RuntimeException types
            reason = str(exc).strip().splitlines()[-1][:400] if str(exc).strip() else type(exc).__name__
    if reason is not None and (extra := _error_line(log[0] if log else "")):
        reason = f"{reason} ({extra[:300]})" if extra not in reason else reason
    return ProviderProbe(provider, True, reason is None, reason)
