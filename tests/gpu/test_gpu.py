"""The GPU half of the engine contract, for each GPU route:

* ``cuda``: ONNX Runtime's CUDA EP with the device-resident KV cache;
* ``ort-trt``: ONNX Runtime's TensorRT EP on the engine cache the bundle records;
* ``native``: a TensorRT plan run through the TensorRT Python API.

Invariants: greedy output on the GPU, plain or speculative, sequential or
verify-while-draft, equals the CPU engine's; rollback on the device cache is a
length change; and a decode step's latency is printed next to its
memory-bandwidth floor (weight bytes / measured device bandwidth).

Every test is marked ``gpu`` and skips, with the missing piece as the reason,
on a machine without an NVIDIA GPU and the route's packages (docs/GPU.md).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPT_IDS
from specedge.engines import EngineOptions, create_engine
from specedge.engines.ort import OrtEngine
from specedge.bench.device_check import weight_bytes
from specedge.engines.gpu_probe import AddressLog, device_bandwidth, route_missing
from specedge.engines.tensorrt import runtime_facts
from specedge.bundle.manifest import load_manifest

pytestmark = pytest.mark.gpu

N_TOKENS = 32
# (engine backend, EngineOptions.provider) per route.
BACKEND = {"cuda": ("onnxruntime-gpu", "cuda"), "ort-trt": ("onnxruntime-gpu", "tensorrt"),
           "native": ("tensorrt", "cuda")}


def _missing(route: str) -> str | None:
    """Why ``route`` cannot run here, or None: a provider counts only when a session loads and runs on it
    (onnxruntime-gpu lists TensorRT whether or not TensorRT is installed)."""
    return route_missing(route)


MISSING = {route: _missing(route) for route in BACKEND}
ROUTES = [pytest.param(route, marks=pytest.mark.skipif(why is not None, reason=f"{route}: {why}"))
          for route, why in MISSING.items()]


# --------------------------------------------------------------------------- helpers


def _generate(target, drafter_engine=None, k: int = 0, mode: str = "sequential") -> list[int]:
    """Greedy tokens of ``target`` after PROMPT_IDS, speculating with ``drafter_engine`` when given."""
    from specedge.runtime import loop
    from specedge.runtime.policies import FixedK
    from specedge.runtime.drafters import ModelDrafter
    from specedge.runtime.sampling import SamplingConfig

    greedy = SamplingConfig()
    drafter = ModelDrafter(drafter_engine, greedy) if drafter_engine is not None else None
    result = loop.LoopResult()
    for _ in loop.run(target, target.new_cache(), np.asarray(PROMPT_IDS, np.int64), max_new_tokens=N_TOKENS,
                      eos_token_ids=(), sampling=greedy, rng=np.random.default_rng(0), drafter=drafter,
                      controller=FixedK(k) if drafter else None, result=result, mode=mode):
        pass
    return result.tokens


def _engine(bundle: Path, route: str, role: str = "target"):
    backend, provider = BACKEND[route]
    entry = load_manifest(bundle, verify_checksums=False).models()[role]
    return create_engine(entry, bundle / entry.graph, EngineOptions(provider=provider, intra_op_threads=1),
                         backend=backend)


def median_step_s(engine, steps: int = 50) -> float:
    """Median wall time of a one-token decode step after PROMPT_IDS (rewound each time: fixed past)."""
    kv = engine.new_cache()
    engine.forward(np.asarray(PROMPT_IDS, np.int64), kv)
    token = np.array([PROMPT_IDS[-1]], np.int64)
    times = []
    for _ in range(steps + 5):
        start = time.perf_counter()
        engine.forward(token, kv)
        times.append(time.perf_counter() - start)
        kv.rewind(1)
    return float(np.median(times[5:]))  # the first steps pay lazy allocations


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def standard_bundle(tiny_model, export) -> Path:
    """fp32 target + a different fp32 draft, standard attention: the graph every route runs."""
    return export(tiny_model("llama"), draft=tiny_model("llama", seed=5), attention="standard")


@pytest.fixture(scope="module")
def baseline(standard_bundle) -> list[int]:
    """The CPU engine's plain greedy tokens; asserts they are far from ties, so GPU rounding cannot flip them."""
    entry = load_manifest(standard_bundle, verify_checksums=False).target
    cpu = OrtEngine(entry, standard_bundle / entry.graph, EngineOptions(intra_op_threads=1))
    tokens = _generate(cpu)
    kv = cpu.new_cache()
    logits = cpu.forward(np.asarray(PROMPT_IDS, np.int64), kv)
    gaps = []
    for token in tokens:
        top2 = np.sort(logits[-1])[-2:]
        gaps.append(float(top2[1] - top2[0]))
        logits = cpu.forward(np.array([token]), kv)
    assert min(gaps) > 1e-2, f"the baseline has a near-tie (top-2 gap {min(gaps):.2e}): pick another seed"
    return tokens


@pytest.fixture(scope="module", params=ROUTES)
def gpu_bundle(request, standard_bundle, tmp_path_factory) -> tuple[str, Path]:
    """(route, bundle): the TensorRT routes build their engines into a copy of the standard bundle."""
    from specedge.export.tensorrt import build_engines_for_bundle

    route = request.param
    if route == "cuda":
        return route, standard_bundle
    bundle = shutil.copytree(standard_bundle, tmp_path_factory.mktemp(route) / "bundle")
    # fp32 engines (TF32 off on the native route) so tokens can equal the CPU's; a 16-token prefill
    # profile makes the 20-token prompt run in chunks.
    build_engines_for_bundle(bundle, precision="fp32", route=route, max_prompt=16, quiet=True)
    return route, bundle


@pytest.fixture(scope="module")
def address_log(gpu_bundle) -> AddressLog:
    """Every device address the route's engines bind (logits go to a host buffer on the ORT routes)."""
    route, bundle = gpu_bundle
    io = load_manifest(bundle, verify_checksums=False).target.io
    return AddressLog(frozenset({io.logits}) if route != "native" else frozenset())


@pytest.fixture(scope="module")
def engines(gpu_bundle, address_log):
    """Two target engines (one drafts for self-speculation) and the different draft's engine."""
    route, bundle = gpu_bundle
    built = _engine(bundle, route), _engine(bundle, route), _engine(bundle, route, "draft")
    for engine in built:
        address_log.watch(engine)
    return built


# --------------------------------------------------------------------------- invariants


def test_greedy_on_the_gpu_equals_the_cpu_baseline(engines, baseline):
    target, same, other = engines
    assert _generate(target) == baseline
    for k in (2, 4, 8):
        assert _generate(target, same, k) == baseline, f"self-speculation, k={k}"
        assert _generate(target, other, k) == baseline, f"different draft, k={k}"


def test_every_bound_device_address_is_256_byte_aligned(engines, address_log, baseline):
    target, same, other = engines
    _generate(target, other, 4)  # prefill, steps at every position, verifies, rollbacks
    summary = address_log.summary()
    assert summary["bound"] > 0 and summary["misaligned"] == 0, summary


@pytest.mark.parametrize("k", [1, 4])
def test_verify_while_draft_on_two_streams_equals_the_baseline(engines, baseline, k):
    target, same, other = engines
    for drafter in (same, other):
        assert _generate(target, drafter, k, mode="pipelined") == baseline


def test_device_cache_rollback_is_a_length_change(engines, standard_bundle):
    target = engines[0]
    entry = load_manifest(standard_bundle, verify_checksums=False).target
    cpu = OrtEngine(entry, standard_bundle / entry.graph, EngineOptions(intra_op_threads=1))
    ids = np.asarray(PROMPT_IDS, np.int64)
    kv, cpu_kv = target.new_cache(), cpu.new_cache()
    target.forward(ids, kv)
    cpu.forward(ids, cpu_kv)
    for layer in range(entry.n_layers):  # the device cache holds what the CPU cache holds
        k, v = kv.to_host(layer)
        np.testing.assert_allclose(k, cpu_kv.keys[layer][:len(ids)], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(v, cpu_kv.values[layer][:len(ids)], rtol=1e-3, atol=1e-3)
    prefix = [kv.to_host(layer) for layer in range(entry.n_layers)]
    target.forward(np.array([7, 8, 9]), kv, num_logits=3)  # a rejected block
    kv.rewind(3)
    after = target.forward(np.array([10, 11, 12]), kv, num_logits=3).copy()
    reference = cpu.forward(np.array([10, 11, 12]), cpu_kv, num_logits=3)
    np.testing.assert_allclose(after, reference, rtol=1e-3, atol=1e-3)
    kv.rewind(3)
    for layer, (k, v) in enumerate(prefix):
        k_now, v_now = kv.to_host(layer)
        np.testing.assert_array_equal(k_now, k)
        np.testing.assert_array_equal(v_now, v)


def test_step_latency_against_the_memory_bandwidth_floor(engines, gpu_bundle):
    route, bundle = gpu_bundle
    step = median_step_s(engines[0])
    bandwidth = device_bandwidth()
    floor = weight_bytes(bundle) / bandwidth  # a decode step reads every weight once, at best
    print(f"\n[{route}] decode step {step * 1e6:.0f} us; floor {floor * 1e6:.1f} us "
          f"({weight_bytes(bundle) / 1e6:.2f} MB of weights at {bandwidth / 1e9:.0f} GB/s); "
          f"step / floor = {step / floor:.1f}x")
    assert step > 0 and bandwidth > 1e9


def test_the_engine_record_describes_this_gpu(gpu_bundle):
    from specedge.engines.tensorrt import EngineRecord

    route, bundle = gpu_bundle
    if route == "cuda":
        pytest.skip("the CUDA route builds no engine")
    manifest = load_manifest(bundle)  # checksums still hold after the build rewrote the manifest
    facts = runtime_facts()
    for role in manifest.models():
        record = manifest.extra.engines[role]
        assert (record.route, record.gpu_name, record.compute_capability) == (route, facts.gpu_name,
                                                                              facts.compute_capability)
        assert (bundle / record.file).exists()
        if route == "native":
            assert record.file in manifest.files
            assert [p.name for p in record.profiles] == ["step", "prefill"]


@pytest.mark.skipif(MISSING["cuda"] is not None, reason=f"cuda: {MISSING['cuda']}")
def test_fp16_gqa_speculation_on_cuda_equals_plain_decoding(tiny_model, export):
    """The default export (fused GQA, head-major cache bound as past and present) at fp16, on CUDA."""
    bundle = export(tiny_model("llama"), precision="fp16")
    target, same = _engine(bundle, "cuda"), _engine(bundle, "cuda")
    plain = _generate(target)
    for k in (2, 4):
        assert _generate(target, same, k) == plain
        assert _generate(target, same, k, mode="pipelined") == plain
