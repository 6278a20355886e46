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

This module runs the routes and writes the report; the engine-level probes (can a route run,
the bound addresses, the device bandwidth) are ``engines/gpu_probe.py``, the tiny models
``export/tiny.py``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..engines.gpu_probe import ROUTES, AddressLog, device_bandwidth, route_missing
from ..export.tiny import build_tiny_model, export_tiny, exporter_missing
from ..runtime.costs import median_forward

PROMPT_IDS = list(range(6, 26))  # 20 plain words of the tiny vocabulary
N_NEW = 24
DRAFT_TOKENS = 4  # k for the speculative runs; the verify timing uses k + 1 tokens
SEED = 1
TEMPERATURE = 0.8
# (Generator provider, engine backend) per GPU route; cpu-mode builds its engines itself.
ROUTE_PROVIDER = {"cuda": "cuda", "ort-trt": "tensorrt", "native": "tensorrt"}


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
    # 3 untimed calls first: they pay lazy allocations and kernel selection.
    return median_forward(engine, kv, np.asarray(PROMPT_IDS[:n], np.int64), repeats=repeats, warmup=3)


def weight_bytes(bundle: Path, role: str = "target") -> int:
    from ..bundle.manifest import load_manifest

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
    from ..bundle.manifest import load_manifest
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
    from ..bundle.manifest import load_manifest
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
    from ..bundle.manifest import load_manifest
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


def run_verify(device_id: int = 0, workdir: Path | None = None, routes: tuple[str, ...] = ROUTES, *,
               machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every check this machine allows; return the report (``ok`` is False only when a check failed).
    ``machine``: the facts to report it under (``specedge doctor`` passes what it collected)."""
    started = time.perf_counter()
    report: dict[str, Any] = {"machine": machine or {}, "routes": {}, "not_checked": []}
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
