"""What ``specedge doctor --verify`` asks of the GPU engines: whether a route can run here, every
device address an engine binds (:class:`AddressLog`), and the device's memory bandwidth.

Engine-level only (onnxruntime, TensorRT, cuda-python; imported when called): the checks that
run generations live in ``bench/device_check.py``, the tiny models they export in ``export/tiny.py``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

ROUTES = ("cpu-mode", "cuda", "ort-trt", "native")


def route_missing(route: str) -> str | None:
    """Why ``route`` cannot run on this machine, or None."""
    from .device import cuda_call, import_cudart
    from .providers import probe_provider
    from .tensorrt import import_tensorrt
    from ..errors import BackendUnavailableError

    if route == "cpu-mode":
        return None
    if route in ("cuda", "ort-trt"):
        probe = probe_provider("cuda" if route == "cuda" else "tensorrt")
        return None if probe.loadable else probe.reason
    try:
        import_tensorrt()
        if cuda_call(import_cudart().cudaGetDeviceCount(), "cudaGetDeviceCount") < 1:
            return "no CUDA device"
    except BackendUnavailableError as exc:
        return str(exc)
    return None


class _RecordingBinding:
    """Forwards to an ORT IOBinding and records each device address bound."""

    def __init__(self, binding, record: Callable[[str, str, int], None]) -> None:
        self._binding, self._record = binding, record

    def bind_input(self, name, device, device_id, dtype, shape, ptr):
        self._record(name, device, ptr)
        return self._binding.bind_input(name, device, device_id, dtype, shape, ptr)

    def bind_output(self, name, device, device_id=0, dtype=None, shape=None, ptr=None):
        if ptr is not None:
            self._record(name, device, ptr)
        return self._binding.bind_output(name, device, device_id, dtype, shape, ptr)

    def bind_cpu_input(self, name, array):
        return self._binding.bind_cpu_input(name, array)

    def __getattr__(self, attr):
        return getattr(self._binding, attr)


class _RecordingSession:
    def __init__(self, session, record) -> None:
        self._session, self._record = session, record

    def io_binding(self):
        return _RecordingBinding(self._session.io_binding(), self._record)

    def run_with_iobinding(self, binding, *args):
        inner = binding._binding if isinstance(binding, _RecordingBinding) else binding
        return self._session.run_with_iobinding(inner, *args)

    def __getattr__(self, attr):
        return getattr(self._session, attr)


class _RecordingContext:
    def __init__(self, context, record) -> None:
        self._context, self._record = context, record

    def set_tensor_address(self, name, ptr):
        self._record(name, "device", ptr)
        return self._context.set_tensor_address(name, ptr)

    def __getattr__(self, attr):
        return getattr(self._context, attr)


class AddressLog:
    """Every (tensor, address) an engine bound to device memory; host-side inputs are not device addresses."""

    def __init__(self, host_names: frozenset[str] = frozenset()) -> None:
        self.addresses: list[tuple[str, int]] = []
        self.host_names = host_names

    def record(self, name: str, device: str, ptr: int) -> None:
        if name not in self.host_names:
            self.addresses.append((name, int(ptr)))

    def watch(self, engine) -> None:
        """Route ``engine``'s bindings through this log (the device-cache ORT engine or the native one)."""
        from .ort_cuda import OrtCudaEngine
        from .tensorrt import TensorrtEngine

        if isinstance(engine, OrtCudaEngine):
            engine.session = _RecordingSession(engine.session, self.record)
        elif isinstance(engine, TensorrtEngine):  # every address, logits included, is TensorRT's to check
            engine.context = _RecordingContext(engine.context, lambda name, device, ptr: self.addresses.append(
                (name, int(ptr))))
        else:
            raise TypeError(f"not a GPU engine: {type(engine).__name__}")

    def summary(self) -> dict[str, Any]:
        from .device import ALIGNMENT

        bad = [(name, hex(ptr)) for name, ptr in self.addresses if ptr % ALIGNMENT]
        return {"bound": len(self.addresses), "misaligned": len(bad), "first_misaligned": bad[:5],
                "alignment": ALIGNMENT}


# --------------------------------------------------------------------------- device bandwidth


def device_bandwidth(device_id: int = 0, mib: int = 256, runs: int = 10) -> float:
    """Device memory bandwidth in bytes/s: copies that read and write ``mib`` MiB each.

    Through cuda-python when installed (a device-to-device memcpy), else an ORT CUDA
    session computing ``x + 0`` on device-bound buffers.
    """
    from .device import cuda_call, import_cudart
    from ..errors import BackendUnavailableError

    nbytes = mib * 2**20
    try:
        cudart = import_cudart()
    except BackendUnavailableError:
        cudart = None
    if cudart is not None:
        src, dst = (cuda_call(cudart.cudaMalloc(nbytes), "cudaMalloc") for _ in range(2))
        kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice

        def copy():
            cuda_call(cudart.cudaMemcpy(dst, src, nbytes, kind), "cudaMemcpy")
            cuda_call(cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    else:
        import onnxruntime as ort

        n = nbytes // 4
        session = ort.InferenceSession(_add_zero_graph(n), providers=[("CUDAExecutionProvider",
                                                                      {"device_id": str(device_id)})])
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_shape_and_type([n], np.float32, "cuda", device_id))
        binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_shape_and_type([n], np.float32, "cuda",
                                                                                    device_id))

        def copy():
            session.run_with_iobinding(binding)
    copy()  # warm-up: allocation, kernel selection
    start = time.perf_counter()
    for _ in range(runs):
        copy()
    elapsed = time.perf_counter() - start
    if cudart is not None:
        cudart.cudaFree(src)
        cudart.cudaFree(dst)
    return 2 * nbytes * runs / elapsed  # each copy reads and writes every byte


def _add_zero_graph(n: int) -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Add", ["x", "zero"], ["y"])], "copy",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])],
                              [helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
