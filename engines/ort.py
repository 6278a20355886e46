"""ONNX Runtime engine: CPU, CUDA or TensorRT execution provider.

On CPU the KV prefix and the new-K/V outputs are bound by pointer through IO
binding: ORT reads ``cache[:length]`` in place and writes the new tokens' K/V
straight into ``cache[length:length+n]``, so no cache bytes are copied in Python.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, ForwardCancelled, InvalidParameterError, ModelLoadError
from ..bundle.manifest import ModelEntry
from .base import EngineOptions, Interrupt, KVCache, check_finite_logits

_ORT_PROVIDER = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                 "tensorrt": "TensorrtExecutionProvider"}
_OPT_LEVEL = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}
# What ONNX Runtime 1.32 says when RunOptions.terminate stopped a run (a RuntimeError from
# run_with_iobinding, its own Fail from run): only this failure, on a run we stopped, is a cancel.
_TERMINATED = "Exiting due to terminate flag being set to true"


def available_providers() -> list[str]:
    """specedge provider names whose ORT execution provider this install has."""
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    return [name for name, ep in _ORT_PROVIDER.items() if ep in have]


def check_provider(provider: str) -> None:
    """Raise BackendUnavailableError instead of letting ORT fall back to CPU silently."""
    have = available_providers()
    if provider not in have:
        hint = (" (install onnxruntime-gpu instead of onnxruntime: `pip uninstall -y onnxruntime && pip install "
                "'specedge[gpu]'`; `specedge doctor` says which providers load)") if provider != "cpu" else ""
        raise BackendUnavailableError(f"execution provider {provider!r} is not available in this onnxruntime "
                                      f"install; available: {', '.join(have)}{hint}")


def session_providers(provider: str, provider_options: dict | None = None,
                      cuda_options: dict | None = None) -> list:
    """ORT's provider list for one session, in precedence order.

    The chosen EP first. Under TensorRT, CUDA comes next: a node TensorRT declines then
    runs on the device, next to the device-resident cache, instead of on the CPU (which
    would copy its inputs across PCIe every step). CPU last, for host-side shape ops.
    ``cuda_options`` (device_id, user_compute_stream) go to the CUDA EP in both GPU cases.
    """
    chosen = (_ORT_PROVIDER[provider], dict(provider_options or {}))
    if provider == "cpu":
        return [chosen]
    if provider == "tensorrt":
        return [chosen, ("CUDAExecutionProvider", dict(cuda_options or {})), "CPUExecutionProvider"]
    return [chosen, "CPUExecutionProvider"]


def bundle_folder(graph_path: Path, graph_rel: str) -> Path:
    """The bundle folder: ``graph_path`` minus the manifest's relative ``graph_rel``."""
    folder = Path(graph_path)
    for _ in Path(graph_rel).parts:
        folder = folder.parent
    return folder


class OrtEngine:
    """Runs one bundle model through an ``onnxruntime.InferenceSession``."""

    def __init__(self, entry: ModelEntry, graph_path: Path, options: EngineOptions = EngineOptions(),
                 provider_options: dict | None = None, cuda_options: dict | None = None) -> None:
        import onnxruntime as ort

        check_provider(options.provider)
        self.entry = entry
        self._bundle = str(bundle_folder(graph_path, entry.graph))
        self.options = options
        self.vocab_size = entry.vocab_size
        self.max_context = entry.max_context
        self._kv_dtype = np.dtype(entry.kv_dtype)
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVEL[options.graph_optimization])
        so.intra_op_num_threads = options.intra_op_threads
        so.inter_op_num_threads = options.inter_op_threads
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3  # ORT's warnings about unused initializers are noise to users
        if not options.allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if options.stop_spinning_after_run:
            so.add_session_config_entry("session.force_spinning_stop", "1")
        if options.optimized_model_path:
            so.optimized_model_filepath = options.optimized_model_path
        if options.profile_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = options.profile_prefix
        providers = session_providers(options.provider, provider_options, cuda_options)
        try:
            self.session = ort.InferenceSession(str(graph_path), so, providers=providers)
        except Exception as exc:  # ORT raises its own Fail/InvalidProtobuf/... types
            raise ModelLoadError(f"ONNX Runtime could not load {graph_path.name} ({entry.source or 'model'}): "
                                 f"{str(exc).splitlines()[0][:300]} — the file is truncated, corrupt or not a "
                                 "specedge graph; re-export the bundle") from None
        if _ORT_PROVIDER[options.provider] not in self.session.get_providers():
            raise BackendUnavailableError(f"ONNX Runtime did not enable {options.provider!r} for this model")
        self._check_io()
        io = entry.io
        self._gqa = entry.attention == "gqa"
        self._past_names = [(io.past_key % i, io.past_value % i) for i in range(entry.n_layers)]
        self._new_names = [((io.present_key if self._gqa else io.new_key) % i,
                            (io.present_value if self._gqa else io.new_value) % i) for i in range(entry.n_layers)]
        self._device = "cpu" if options.provider == "cpu" else "cuda"
        # Logits buffer for the largest call we make per step; prefill asks for 1 row.
        self._logits = np.empty((1, 1, entry.output_size), np.float32)
        # GQA binds each cache at its full capacity (one buffer is both past and present), so a cache's
        # 4 x n_layers K/V bindings never change: they are made once per cache and kept, and a step binds
        # only its five small inputs and the logits. Re-binding them all took ~2.5 ms of a 140 ms step
        # in a profile of SmolLM2's 30 layers on a loaded 2-core EPYC (bind_input/bind_output in cProfile).
        self._kv_bindings: weakref.WeakKeyDictionary[KVCache, object] = weakref.WeakKeyDictionary()
        self._run_options = ort.RunOptions
        self.interrupt: Interrupt | None = None  # the running generation's cancel (engines/base.py Engine)

    def _check_io(self) -> None:
        io = self.entry.io
        have_in = {i.name for i in self.session.get_inputs()}
        have_out = {o.name for o in self.session.get_outputs()}
        need_in = set(io.inputs(self.entry.n_layers, self.entry.attention))
        need_out = set(io.outputs(self.entry.n_layers, self.entry.attention))
        gqa = self.entry.attention == "gqa"
        missing = sorted(need_in - have_in) + sorted(need_out - have_out)
        if missing:
            raise ModelLoadError(f"graph {self.entry.graph} lacks tensors the manifest names: {missing[:6]}; "
                                 "the manifest does not describe this graph")
        # The manifest's sizes and dtypes shape every buffer bound to the session: a manifest that
        # disagrees with the graph would otherwise surface as an ORT shape error mid-generation.
        e = self.entry
        if io.past_key % e.n_layers in have_in:
            raise ModelLoadError(f"graph {e.graph} has more layers than the manifest's n_layers={e.n_layers}; "
                                 "the manifest does not describe this graph")
        cache = [1, e.n_kv_heads, None, e.head_dim] if gqa else [None, e.n_kv_heads, e.head_dim]
        kv_type = {"float32": "tensor(float)", "float16": "tensor(float16)"}[e.kv_dtype]
        args = {a.name: a for a in (*self.session.get_inputs(), *self.session.get_outputs())}
        checks = [(io.logits, "tensor(float)", [1, None, e.output_size])]
        checks += [(name % i, kv_type, cache) for i in range(e.n_layers) for name in (io.past_key, io.past_value)]
        for name, want_type, want_shape in checks:
            arg = args[name]
            shape = list(arg.shape or [])
            if arg.type != want_type or len(shape) != len(want_shape) or any(
                    isinstance(got, int) and want is not None and got != want for got, want in zip(shape, want_shape)):
                raise ModelLoadError(f"graph {e.graph} tensor {name!r} is {arg.type} {shape}, but the manifest "
                                     f"implies {want_type} {['*' if w is None else w for w in want_shape]} (n_kv_heads, "
                                     "head_dim, vocab_size, kv_dtype); the manifest does not describe this graph")

    def new_cache(self) -> KVCache:
        e = self.entry
        return KVCache(e.n_layers, e.n_kv_heads, e.head_dim, e.max_context, self._kv_dtype,
                       layout="head-major" if self._gqa else "position-major")

    def forward(self, input_ids: np.ndarray, kv: KVCache, num_logits: int = 1) -> np.ndarray:
        """Run n new tokens; see :class:`specedge.engines.base.Engine`. Returns a view valid until the next call."""
        ids, positions, keep, start, n = self._step_inputs(input_ids, kv, num_logits)
        if self.options.use_io_binding and self._device == "cpu":
            logits = self._run_bound(ids, positions, keep, kv, start, n, int(keep[0]))
        else:
            logits = self._run_plain(ids, positions, keep, kv, start, n)[0]
        kv.length = start + n
        if start == 0:  # a sequence's first step (warm-up, prefill): corrupt weights surface here
            check_finite_logits(logits[0], self.entry.graph, self._bundle)
        return logits[0]

    def outputs(self, input_ids: np.ndarray, kv: KVCache, names: list[str]) -> list[np.ndarray]:
        """Run n new tokens as :meth:`forward` does (the cache advances) and return the graph outputs
        ``names`` beside the logits: a graph given extra outputs for an export-time measurement
        (export/importance.py reads each MatMul's input this way). Every position's logits are kept, so
        the output layer's input covers every position too. No IO binding: fresh arrays."""
        ids, positions, keep, start, n = self._step_inputs(input_ids, kv, len(input_ids))
        outs = self._run_plain(ids, positions, keep, kv, start, n, extra=names)
        kv.length = start + n
        return outs[1:]

    def _step_inputs(self, input_ids: np.ndarray, kv: KVCache, num_logits: int):
        """(ids [1, n], positions [1, n], logits kept [1], cache start, n) for a forward of ``input_ids``."""
        n = int(input_ids.shape[0])
        if n < 1:
            raise InvalidParameterError("forward needs at least one token")
        kv.reserve(n)
        start = kv.length
        ids = np.ascontiguousarray(input_ids, dtype=np.int64).reshape(1, n)
        positions = np.arange(start, start + n, dtype=np.int64).reshape(1, n)
        return ids, positions, np.array([max(1, min(num_logits, n))], np.int64), start, n

    def _cache_binding(self, kv: KVCache):
        """The IO binding that holds ``kv``'s K/V buffers (GQA: full capacity, bound once per cache)."""
        binding = self._kv_bindings.get(kv)
        if binding is None:
            binding = self.session.io_binding()
            dtype = self._kv_dtype.type
            shape = list(kv.keys[0].shape)
            # One buffer is both past and present: GQA reads [0, start) and writes [start, start+n).
            for layer, ((pk, pv), (nk, nv)) in enumerate(zip(self._past_names, self._new_names)):
                for past_name, new_name, buf in ((pk, nk, kv.keys[layer]), (pv, nv, kv.values[layer])):
                    binding.bind_input(past_name, "cpu", 0, dtype, shape, buf.ctypes.data)
                    binding.bind_output(new_name, "cpu", 0, dtype, shape, buf.ctypes.data)
            self._kv_bindings[kv] = binding
        return binding

    def _run_bound(self, ids, positions, keep, kv: KVCache, start: int, n: int, num_logits: int) -> np.ndarray:
        io = self.entry.io
        binding = self._cache_binding(kv) if self._gqa else self.session.io_binding()
        binding.bind_cpu_input(io.input_ids, ids)
        binding.bind_cpu_input(io.positions, positions)
        binding.bind_cpu_input(io.num_logits, keep)
        e = self.entry
        dtype = self._kv_dtype.type
        if self._gqa:
            binding.bind_cpu_input(io.seqlens_k, np.array([start + n - 1], np.int32))
            binding.bind_cpu_input(io.total_sequence_length, np.array(start + n, np.int32))
        else:
            row = e.n_kv_heads * e.head_dim * self._kv_dtype.itemsize  # bytes per cached position
            past_shape = [start, e.n_kv_heads, e.head_dim]
            new_shape = [n, e.n_kv_heads, e.head_dim]
            for layer, ((pk, pv), (nk, nv)) in enumerate(zip(self._past_names, self._new_names)):
                for past_name, new_name, buf in ((pk, nk, kv.keys[layer]), (pv, nv, kv.values[layer])):
                    base = buf.ctypes.data
                    binding.bind_input(past_name, "cpu", 0, dtype, past_shape, base)
                    binding.bind_output(new_name, "cpu", 0, dtype, new_shape, base + start * row)
        if self._logits.shape[1] != num_logits:
            self._logits = np.empty((1, num_logits, e.output_size), np.float32)
        binding.bind_output(io.logits, "cpu", 0, np.float32, list(self._logits.shape), self._logits.ctypes.data)
        self._run(lambda options: self.session.run_with_iobinding(binding, options))
        return self._logits

    def _run(self, call):
        """``call(run_options)``, stoppable midway by :attr:`interrupt` (between graph nodes).

        A fresh RunOptions per run: one whose ``terminate`` was set fails every later run it is
        passed to. A stopped run raises ForwardCancelled; the caller has not advanced ``kv.length``,
        so the K/V it may have written past ``length`` is never read as held.
        """
        interrupt = self.interrupt
        if interrupt is None:
            return call(None)
        options = self._run_options()

        def stop() -> None:
            options.terminate = True

        try:
            with interrupt.running(stop):
                return call(options)
        except Exception as exc:
            if options.terminate and _TERMINATED in str(exc):
                raise ForwardCancelled("the generation was cancelled during a forward; ONNX Runtime stopped "
                                       "the run") from None
            raise

    def _run_plain(self, ids, positions, keep, kv: KVCache, start: int, n: int,
                   extra: list[str] = ()) -> list[np.ndarray]:
        """Run without IO binding; returns [logits, *the ``extra`` outputs]."""
        io = self.entry.io
        feed = {io.input_ids: ids, io.positions: positions, io.num_logits: keep}
        if self._gqa:
            feed[io.seqlens_k] = np.array([start + n - 1], np.int32)
            feed[io.total_sequence_length] = np.array(start + n, np.int32)
            for layer, (pk, pv) in enumerate(self._past_names):
                feed[pk], feed[pv] = kv.keys[layer], kv.values[layer]
            names = [io.logits] + [name for pair in self._new_names for name in pair] + list(extra)
            outs = self._run(lambda options: self.session.run(names, feed, options))
            for layer in range(self.entry.n_layers):  # without binding ORT returns fresh copies
                kv.keys[layer][...] = outs[1 + 2 * layer]
                kv.values[layer][...] = outs[2 + 2 * layer]
            return [outs[0]] + outs[1 + 2 * self.entry.n_layers:]
        for layer, (pk, pv) in enumerate(self._past_names):
            feed[pk] = kv.keys[layer][:start]
            feed[pv] = kv.values[layer][:start]
        names = [io.logits] + [name for pair in self._new_names for name in pair] + list(extra)
        outs = self._run(lambda options: self.session.run(names, feed, options))
        for layer in range(self.entry.n_layers):
            kv.keys[layer][start:start + n] = outs[1 + 2 * layer]
            kv.values[layer][start:start + n] = outs[2 + 2 * layer]
        return [outs[0]] + outs[1 + 2 * self.entry.n_layers:]
