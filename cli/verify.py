"""``specedge doctor --verify``: check every GPU route on this machine in one command, as one JSON report.

For each route (the device-cache engine on host memory, ``cpu-mode``, which any
machine runs; then ``cuda``, ``ort-trt`` and ``native`` where they load):

1. export tiny random-weight models (a target and a different draft, standard
   attention, fp32; for ``cuda`` also the default fused-GQA graph at fp16) and
   build the route's TensorRT engines into a copy of the bundle;
2. generate with the route: plain greedy, greedy speculation (k fixed) and sampled
   speculation (fixed seed, fixed k), and compare with the CPU engine's tokens;
3. record every device address the engines bind (ORT IO binding, or TensorRT's
   ``set_tensor_address``) and check each is 256-byte aligned;
4. time a 1-token step and a (k+1)-token verify against the memory-bandwidth floor
   (weight bytes / measured device bandwidth).

Routes that cannot run here are reported as skipped, with the reason (a provider
that does not load says why). Exporting needs torch and transformers (the
``export`` extra); without them nothing is exported and the report says so.
A route fails only on a wrong token, a misaligned address or an exception.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

PROMPT_IDS = list(range(6, 26))  # 20 plain words of the tiny vocabulary
N_NEW = 24
DRAFT_TOKENS = 4  # k for the speculative runs; the verify timing uses k + 1 tokens
SEED = 1
TEMPERATURE = 0.8
VOCAB = 300
ROUTES = ("cpu-mode", "cuda", "ort-trt", "native")
# (Generator provider, engine backend) per GPU route; cpu-mode builds its engines itself.
ROUTE_PROVIDER = {"cuda": "cuda", "ort-trt": "tensorrt", "native": "tensorrt"}


# --------------------------------------------------------------------------- what can run here


def route_missing(route: str) -> str | None:
    """Why ``route`` cannot run on this machine, or None."""
    from ..engines.device import cuda_call, import_cudart
    from ..engines.providers import probe_provider
    from ..engines.tensorrt import import_tensorrt
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


def exporter_missing() -> str | None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return (f"the exporter needs torch and transformers ({exc}): pip install 'specedge[export]' "
                "(the CPU torch wheel is enough)")
    return None


# --------------------------------------------------------------------------- tiny models


def build_tiny_model(out: Path, seed: int) -> Path:
    """A 2-layer random-weight Llama (hidden 64, 4 heads, 2 KV heads, vocab 300) with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    # std 0.15 (HF's 0.02 gives logits of std ~0.15 here): far-apart top-2 logits, so fp rounding on
    # another device cannot flip a greedy argmax.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, initializer_range=0.15)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(str(out))
    words = ["<s>", "</s>", "<unk>"] + [f"w{i:03d}" for i in range(3, VOCAB)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<unk>").save_pretrained(str(out))
    return out


def export_tiny(work: Path, name: str, **options) -> Path:
    from ..export.bundle import ExportConfig, export_bundle

    out = work / name
    if not out.exists():
        export_bundle(ExportConfig(target=str(work / "target"), draft=str(work / "draft"), out=out,
                                   max_context=128, quiet=True, **options))
    return out


# --------------------------------------------------------------------------- recording bound addresses


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
        from ..engines.ort_cuda import OrtCudaEngine
        from ..engines.tensorrt import TensorrtEngine

        if isinstance(engine, OrtCudaEngine):
            engine.session = _RecordingSession(engine.session, self.record)
        elif isinstance(engine, TensorrtEngine):  # every address, logits included, is TensorRT's to check
            engine.context = _RecordingContext(engine.context, lambda name, device, ptr: self.addresses.append(
                (name, int(ptr))))
        else:
            raise TypeError(f"not a GPU engine: {type(engine).__name__}")

    def summary(self) -> dict[str, Any]:
        from ..engines.device import ALIGNMENT

        bad = [(name, hex(ptr)) for name, ptr in self.addresses if ptr % ALIGNMENT]
        return {"bound": len(self.addresses), "misaligned": len(bad), "first_misaligned": bad[:5],
                "alignment": ALIGNMENT}


# --------------------------------------------------------------------------- generation and timing


def _tokens(gen, **config) -> list[int]:
    return list(gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, chat=False, **config).token_ids)


RUNS = {  # name -> Generator overrides; k fixed and adaptive off, so rng use is the same on every device
    "greedy_plain": {"speculation": False, "temperature": 0.0},
    "greedy_speculative": {"drafter": "model", "draft_tokens": DRAFT_TOKENS, "adaptive": False, "temperature": 0.0},
    "sampled_speculative": {"drafter": "model", "draft_tokens": DRAFT_TOKENS, "adaptive": False,
                            "temperature": TEMPERATURE, "seed": SEED},
}


def compare_runs(gen, reference: dict[str, list[int]]) -> dict[str, Any]:
    """Each run's tokens against the CPU engine's; greedy speculation must equal greedy plain decoding."""
    out = {}
    for name, config in RUNS.items():
        got = _tokens(gen, **config)
        want = reference["greedy_plain" if name == "greedy_speculative" else name]
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None and len(got) != len(want):
            first = min(len(got), len(want))
        out[name] = {"equal": first is None, "first_difference": first, "tokens": len(got)}
    return out


def median_forward_s(engine, n: int, repeats: int = 30) -> float:
    """Median wall time of an n-token forward after PROMPT_IDS, rewound each time (fixed past)."""
    kv = engine.new_cache()
    engine.forward(np.asarray(PROMPT_IDS, np.int64), kv)
    ids = np.asarray(PROMPT_IDS[:n], np.int64)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        engine.forward(ids, kv, num_logits=n)
        times.append(time.perf_counter() - start)
        kv.rewind(n)
    return float(np.median(times[3:]))  # the first calls pay lazy allocations and kernel selection


def device_bandwidth(device_id: int = 0, mib: int = 256, runs: int = 10) -> float:
    """Device memory bandwidth in bytes/s: copies that read and write ``mib`` MiB each.

    Through cuda-python when installed (a device-to-device memcpy), else an ORT CUDA
    session computing ``x + 0`` on device-bound buffers.
    """
    from ..engines.device import cuda_call, import_cudart
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


def weight_bytes(bundle: Path, role: str = "target") -> int:
    from ..manifest import load_manifest

    entry = load_manifest(bundle, verify_checksums=False).models()[role]
    return sum((bundle / rel).stat().st_size for rel in (entry.graph, *entry.data_files))


def timing(engine, bundle: Path, bandwidth: float | None) -> dict[str, Any]:
    step, verify = median_forward_s(engine, 1), median_forward_s(engine, DRAFT_TOKENS + 1)
    out: dict[str, Any] = {"step_us": round(step * 1e6, 1), "verify_us": round(verify * 1e6, 1),
                           "verify_tokens": DRAFT_TOKENS + 1, "verify_over_step": round(verify / step, 2)}
    if bandwidth:
        floor = weight_bytes(bundle) / bandwidth  # a step reads every weight once, at best
        out.update(weight_bytes=weight_bytes(bundle), bandwidth_gb_s=round(bandwidth / 1e9, 1),
                   floor_us=round(floor * 1e6, 2), step_over_floor=round(step / floor, 1),
                   note="a tiny model: launch overhead, not bandwidth, bounds its step")
    return out


# --------------------------------------------------------------------------- routes


def _route_cpu_mode(bundle: Path, reference: dict, bandwidth: float | None) -> dict[str, Any]:
    """The device-cache engine's binding, staging and copy code, on host memory (what CI runs)."""
    from ..engines.base import EngineOptions
    from ..engines.ort_cuda import OrtCudaEngine
    from ..manifest import load_manifest
    from ..runtime.generator import Generator

    ref = Generator.from_bundle(bundle, provider="cpu", threads=1)
    manifest = load_manifest(bundle, verify_checksums=False)
    options = EngineOptions(provider="cpu", intra_op_threads=1)
    target = OrtCudaEngine(manifest.target, bundle / manifest.target.graph, options)
    draft = OrtCudaEngine(manifest.draft, bundle / manifest.draft.graph, options)
    log = _log(manifest)
    log.watch(target)
    log.watch(draft)
    gen = Generator(replace(ref.loaded, target=target, draft=draft))  # the same bundle on these engines
    result = {"runs": compare_runs(gen, reference), "addresses": log.summary(),
              "timing": timing(target, bundle, None)}
    # Fixed-address steps (what a captured CUDA graph replays) on the default fused-GQA graph, fp32 here.
    gqa = export_tiny(bundle.parent, "bundle-fp32-gqa")
    result["fixed_address_steps"] = _fixed_address_steps(gqa, EngineOptions(provider="cpu", intra_op_threads=1),
                                                         cuda_graph=False)
    return result


def _fixed_address_steps(bundle: Path, options, cuda_graph: bool) -> dict[str, Any]:
    """Greedy speculation on StaticStep bindings (one per token count) against the same bundle's plain decoding."""
    from ..engines.ort_cuda import OrtCudaEngine, own_stream
    from ..manifest import load_manifest
    from ..runtime.generator import Generator

    reference = Generator.from_bundle(bundle, engine_options=options) if options.provider != "cpu" else \
        Generator.from_bundle(bundle, provider="cpu", threads=1)
    manifest = load_manifest(bundle, verify_checksums=False)
    stream = own_stream(options.device_id) if options.provider != "cpu" else None
    engines = [OrtCudaEngine(m, bundle / m.graph, options, stream=stream, static_steps=DRAFT_TOKENS + 1,
                             cuda_graph=cuda_graph) for m in (manifest.target, manifest.draft)]
    log = _log(manifest)
    for engine in engines:
        log.watch(engine)
    gen = Generator(replace(reference.loaded, target=engines[0], draft=engines[1]))
    plain = _tokens(reference, **RUNS["greedy_plain"])
    got = {name: _tokens(gen, **RUNS[name]) for name in ("greedy_plain", "greedy_speculative")}
    return {"cuda_graph": cuda_graph, "equal": all(tokens == plain for tokens in got.values()),
            "addresses": log.summary()}


def _log(manifest) -> AddressLog:
    # The ORT engines bind logits to a host buffer by design (ORT copies just the rows asked for);
    # ids, positions and GQA's lengths go in through bind_cpu_input, which binds no address.
    return AddressLog(frozenset({manifest.target.io.logits}))


def _route_gpu(route: str, bundle: Path, reference: dict, bandwidth: float | None, device_id: int,
               work: Path) -> dict[str, Any]:
    from ..manifest import load_manifest
    from ..runtime.generator import Generator

    if route in ("ort-trt", "native"):
        from ..export.tensorrt import build_engines_for_bundle

        bundle = Path(shutil.copytree(bundle, work / f"bundle-{route}"))
        # fp32 engines (TF32 off on the native route) so tokens can equal the CPU's; a 16-token prefill
        # profile makes the 20-token prompt run in chunks.
        build_engines_for_bundle(bundle, precision="fp32", route=route, max_prompt=16, device_id=device_id,
                                 quiet=True)
    from ..engines.base import EngineOptions

    gen = Generator.from_bundle(bundle, engine_options=EngineOptions(provider=ROUTE_PROVIDER[route],
                                                                    device_id=device_id))
    manifest = load_manifest(bundle, verify_checksums=False)
    log = _log(manifest)
    log.watch(gen.target.inner)  # the GPU engine under the batch-invariant wrapper
    log.watch(gen.draft)
    result = {"runs": compare_runs(gen, reference), "addresses": log.summary(),
              "timing": timing(gen.target, bundle, bandwidth)}
    if route == "cuda":  # the default export: fused GQA at fp16, head-major cache shared as past and present
        fp16_bundle = export_tiny(work, "bundle-fp16-gqa", precision="fp16")
        options = EngineOptions(provider="cuda", device_id=device_id)
        fp16 = Generator.from_bundle(fp16_bundle, engine_options=options)
        plain = _tokens(fp16, **RUNS["greedy_plain"])
        spec = _tokens(fp16, **RUNS["greedy_speculative"])
        result["fp16_gqa_speculative_equals_plain"] = plain == spec
        for key, graph in (("fixed_address_steps", False), ("cuda_graph", True)):
            try:
                result[key] = _fixed_address_steps(fp16_bundle, options, cuda_graph=graph)
            except Exception as exc:  # reported per check: capture may be refused where replay-free steps work
                result[key] = {"cuda_graph": graph, "equal": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return result


def _passed(result: dict[str, Any]) -> bool:
    runs_ok = all(r["equal"] for r in result["runs"].values())
    steps_ok = all(result[key]["equal"] and result[key].get("addresses", {}).get("misaligned", 0) == 0
                   for key in ("fixed_address_steps", "cuda_graph") if key in result)
    return runs_ok and steps_ok and result["addresses"]["misaligned"] == 0 and result.get(
        "fp16_gqa_speculative_equals_plain", True)


def run_verify(device_id: int = 0, workdir: Path | None = None, routes: tuple[str, ...] = ROUTES) -> dict[str, Any]:
    """Run every check this machine allows; return the report (``ok`` is False only when a check failed)."""
    from .doctor import collect

    started = time.perf_counter()
    report: dict[str, Any] = {"machine": collect(), "routes": {}, "not_checked": []}
    missing = {route: route_missing(route) for route in routes}
    exporter = exporter_missing()
    if exporter:
        for route in routes:
            report["routes"][route] = {"status": "skipped", "reason": exporter if missing[route] is None
                                       else f"{missing[route]}; and {exporter}"}
        report["not_checked"].append(exporter)
    else:
        work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="specedge-verify-"))
        try:
            _verify_routes(report, routes, missing, device_id, work)
        finally:
            if workdir is None:
                shutil.rmtree(work, ignore_errors=True)
    for route, result in report["routes"].items():
        if result["status"] == "skipped":
            report["not_checked"].append(f"{route}: {result['reason']}")
    report["ok"] = not any(r["status"] == "fail" for r in report["routes"].values())
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _verify_routes(report: dict, routes: tuple[str, ...], missing: dict, device_id: int, work: Path) -> None:
    from ..runtime.generator import Generator

    build_tiny_model(work / "target", seed=0)
    build_tiny_model(work / "draft", seed=5)  # a different draft: corrections, rollback, resampling
    bundle = export_tiny(work, "bundle-fp32-standard", attention="standard")
    cpu = Generator.from_bundle(bundle, provider="cpu", threads=1)
    reference = {name: _tokens(cpu, **config) for name, config in RUNS.items()}
    report["reference"] = {"bundle": "tiny llama, fp32, standard attention, max_context 128",
                           "greedy_speculative_equals_plain_on_cpu":
                               reference["greedy_speculative"] == reference["greedy_plain"],
                           "tokens": N_NEW, "draft_tokens": DRAFT_TOKENS}
    bandwidth = None
    if any(missing[r] is None for r in routes if r != "cpu-mode"):
        try:
            bandwidth = device_bandwidth(device_id)
        except Exception as exc:  # a diagnostic: report, keep checking the rest
            report["not_checked"].append(f"device bandwidth: {type(exc).__name__}: {exc}")
    for route in routes:
        if missing[route] is not None:
            report["routes"][route] = {"status": "skipped", "reason": missing[route]}
            continue
        try:
            result = (_route_cpu_mode(bundle, reference, bandwidth) if route == "cpu-mode"
                      else _route_gpu(route, bundle, reference, bandwidth, device_id, work))
        except Exception as exc:  # a diagnostic: one route's failure must not hide the others' results
            report["routes"][route] = {"status": "fail", "reason": f"{type(exc).__name__}: {str(exc)[:500]}"}
            continue
        report["routes"][route] = {"status": "pass" if _passed(result) else "fail", **result}
