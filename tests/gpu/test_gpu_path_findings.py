"""What the line-by-line review of the GPU path found (issue 19), one test per finding, all on CPU.

Invariants guarded here:
* the native engine returns logits as wide as the graph's head (a truncated draft vocabulary);
* every device address an engine binds is 256-byte aligned (TensorRT's rule), checked on a fake
  allocator that records each address, and the staged rows land where in-place rows would;
* the GPU extra resolves to exactly one ONNX Runtime package, and a mixed install is refused;
* doctor reports a provider as usable only when a session loads and runs on it, with the reason;
* the docs name the TensorRT major ORT's TensorRT EP loads;
* TensorRT 11 (strongly typed only, no BuilderFlag.FP16) builds what it can and refuses the rest;
* TensorRT's failures (a raised profile switch, a refused shape) become typed errors;
* TensorRT EP sessions list CUDA before CPU;
* the standard graph reads the cached prefix in place (no Concat or Transpose of it), as exported and as
  ONNX Runtime optimizes it;
* engine caches are checked against the ORT version and the recorded engine file;
* a native TensorRT bundle loads through Generator.from_bundle;
* TensorRT engines take the logits row count from a shape (no per-run readback), with equal logits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPT_IDS
from specedge.engines import EngineOptions, backend_for, create_engine
from specedge.engines.device import ALIGNMENT, CacheBlock, HostCopier, NewRows, align_up
from specedge.engines.tensorrt import EngineRecord, check_engine_compatible
from specedge.errors import BackendUnavailableError, ChecksumError, InvalidParameterError
from specedge.bundle.manifest import load_manifest
from test_trt_profiles import FACTS, _entry, _fake_bundle, _fake_tensorrt, _greedy, _record

REPO = Path(__file__).resolve().parents[2]  # tests/gpu/ -> the repository root


@pytest.fixture(scope="module")
def standard_pair(tiny_model, export) -> Path:
    """fp32 target + a different fp32 draft, standard attention (TensorRT's graph)."""
    return export(tiny_model("llama"), draft=tiny_model("llama", seed=5), attention="standard")


def _plan(tmp_path: Path, bundle: Path, role: str = "target", rows_from_shape: bool = False) -> Path:
    """A simulated plan (JSON for test_trt_profiles' fake TensorRT) for one bundle model."""
    entry = load_manifest(bundle, verify_checksums=False).models()[role]
    graph = bundle / entry.graph
    if rows_from_shape:
        from specedge.export.trt_graph import logits_rows_from_shape, trt_graph_path

        graph = logits_rows_from_shape(graph, trt_graph_path(graph))
    plan = tmp_path / f"{role}-{rows_from_shape}.plan"
    plan.write_text(json.dumps({"graph": str(graph), "n_layers": entry.n_layers,
                                "kv_shape": [entry.n_kv_heads, entry.head_dim], "vocab": entry.output_size,
                                "rows_from_shape": rows_from_shape,
                                "profiles": [[[1, 9], [0, entry.max_context - 1]], [[1, 16], [0, entry.max_context - 1]]]}))
    return plan


# --------------------------------------------------------------------------- 1. truncated draft vocabulary


def test_native_engine_returns_logits_as_wide_as_a_truncated_draft_head(tiny_model, export, monkeypatch, tmp_path):
    from specedge.engines.ort import OrtEngine
    from specedge.engines.tensorrt import TensorrtEngine

    bundle = export(tiny_model("llama"), draft=tiny_model("llama", seed=5), attention="standard", draft_vocab=64)
    entry = load_manifest(bundle, verify_checksums=False).draft
    assert entry.output_size == 64 < entry.vocab_size
    _fake_tensorrt(monkeypatch)
    native = TensorrtEngine(entry, _plan(tmp_path, bundle, "draft"), EngineOptions())
    cpu = OrtEngine(entry, bundle / entry.graph, EngineOptions(intra_op_threads=1))
    ids = np.asarray(PROMPT_IDS, np.int64)
    got = native.forward(ids, native.new_cache(), num_logits=3)  # raised ValueError (reshape to vocab) before
    assert got.shape == (3, 64)
    np.testing.assert_allclose(got, cpu.forward(ids, cpu.new_cache(), num_logits=3), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- 2. alignment


def test_every_address_the_native_engine_binds_is_256_byte_aligned(standard_pair, monkeypatch, tmp_path):
    """A fake allocator (256-aligned blocks, as cudaMalloc's) records every set_tensor_address."""
    from specedge.engines.ort import OrtEngine
    from specedge.engines.tensorrt import TensorrtEngine

    _fake_tensorrt(monkeypatch)
    entry = load_manifest(standard_pair, verify_checksums=False).target
    row_bytes = entry.n_kv_heads * entry.head_dim * 4
    assert row_bytes % ALIGNMENT, "the tiny model's rows must be misaligned for this test to bite"
    native = TensorrtEngine(entry, _plan(tmp_path, standard_pair), EngineOptions())
    cpu = OrtEngine(entry, standard_pair / entry.graph, EngineOptions(intra_op_threads=1))
    assert _greedy(native) == _greedy(cpu)  # prefill in chunks, then 1-token steps at every position
    bound = native.engine.contexts[0].bound
    host_keep = native._keep.ptr  # the as-exported graph's host shape tensor (pinned memory, read by TensorRT)
    device = [(name, ptr) for name, ptr in bound if ptr != host_keep]
    assert len(device) > 24 * 4 * entry.n_layers
    assert [(n, hex(p)) for n, p in device if p % ALIGNMENT] == []
    staged = native._staging[1]
    assert any(name == "new_key.0" and staged <= ptr < staged + native._staging[0].nbytes for name, ptr in device)


def test_every_device_address_of_the_ort_gpu_engine_is_aligned_and_tokens_hold(standard_pair):
    """The device-cache ORT engine, on host memory (provider cpu), with its bindings recorded."""
    from specedge.engines.gpu_probe import AddressLog
    from specedge.engines.ort import OrtEngine
    from specedge.engines.ort_cuda import OrtCudaEngine

    entry = load_manifest(standard_pair, verify_checksums=False).target
    options = EngineOptions(intra_op_threads=1)
    engine = OrtCudaEngine(entry, standard_pair / entry.graph, options)
    log = AddressLog(frozenset({entry.io.logits}))
    log.watch(engine)
    assert _greedy(engine) == _greedy(OrtEngine(entry, standard_pair / entry.graph, options))
    summary = log.summary()
    # one prefill and 23 steps, 4 cache tensors per layer each
    assert summary["bound"] == 24 * 4 * entry.n_layers and summary["misaligned"] == 0, summary


@pytest.mark.parametrize("row_bytes, start, staged", [(64, 0, False), (64, 4, False), (64, 5, True),
                                                      (384, 1, True), (384, 2, False), (512, 7, False)])
def test_new_rows_are_staged_exactly_when_their_position_is_misaligned(row_bytes, start, staged):
    block = CacheBlock(n_layers=3, row_bytes=row_bytes, capacity=16)
    assert block.segment_bytes % ALIGNMENT == 0
    base = align_up(10_000)
    rows = NewRows(block, base, start, 2, (CacheBlock(3, row_bytes, 4), align_up(900_000)), HostCopier())
    assert rows.staged is staged
    assert all(rows.bind_key(i) % ALIGNMENT == 0 and rows.bind_value(i) % ALIGNMENT == 0 for i in range(3))


def test_staged_rows_land_where_in_place_rows_would():
    block = CacheBlock(n_layers=2, row_bytes=64, capacity=8)
    cache = np.zeros(block.nbytes + ALIGNMENT, np.uint8)
    base = align_up(cache.ctypes.data)
    stage_block = CacheBlock(2, 64, 3)
    stage = np.zeros(stage_block.nbytes + ALIGNMENT, np.uint8)
    stage_base = align_up(stage.ctypes.data)
    rows = NewRows(block, base, start=3, n=3, staging=(stage_block, stage_base), copier=HostCopier())
    assert rows.staged
    written = {}
    for layer in range(2):  # what the graph writes into the bound addresses
        for kind, ptr in (("k", rows.bind_key(layer)), ("v", rows.bind_value(layer))):
            data = np.random.default_rng(layer * 2 + (kind == "v")).integers(0, 255, 3 * 64, np.uint8)
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * data.size).from_address(ptr))[:] = data
            written[layer, kind] = data
    rows.land()
    view = cache[base - cache.ctypes.data:][:block.nbytes]
    for (layer, kind), data in written.items():
        offset = block.key_offset(layer, 3) if kind == "k" else block.value_offset(layer, 3)
        np.testing.assert_array_equal(view[offset:offset + data.size], data)
    assert not view[:block.key_offset(0, 3)].any()  # nothing before position 3 was touched


# --------------------------------------------------------------------------- 3. one ONNX Runtime package


def test_pyproject_names_onnxruntime_only_in_the_cpu_extra_and_onnxruntime_gpu_only_in_the_gpu_extra():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def ort(requirements):
        return sorted(r.split(">")[0].split("=")[0].strip() for r in requirements if r.startswith("onnxruntime"))

    assert ort(project["dependencies"]) == []
    extras = project["optional-dependencies"]
    assert ort(extras["cpu"]) == ["onnxruntime"] and ort(extras["gpu"]) == ["onnxruntime-gpu"]
    assert all(ort(reqs) == [] for name, reqs in extras.items() if name not in ("cpu", "gpu"))


@pytest.mark.slow
@pytest.mark.parametrize("extra, package", [("gpu", "onnxruntime-gpu"), ("cpu", "onnxruntime")])
def test_pip_resolves_each_extra_to_exactly_one_onnxruntime(extra, package, tmp_path):
    """pip's own resolver (PyPI metadata, nothing installed): the issue's `pip install --dry-run --report`."""
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--report", str(report), f"{REPO}[{extra}]"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0 and "No matching distribution found for onnxruntime" in out.stderr:
        pytest.skip(f"the package index offers no {package} for this platform")
    assert out.returncode == 0, out.stderr[-2000:]
    names = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert [n for n in names if n.startswith("onnxruntime") or n.startswith("ort-")] == [package]


@pytest.mark.parametrize("installed, message", [
    ([], r"ONNX Runtime is not installed: pip install 'specedge\[cpu\]'"),
    (["onnxruntime", "onnxruntime-gpu"], r"onnxruntime and onnxruntime-gpu are all installed.*fix: pip uninstall -y "
                                         r"onnxruntime onnxruntime-gpu && pip install 'specedge\[gpu\]'"),
])
def test_a_missing_or_mixed_onnxruntime_install_is_refused_with_the_fix(monkeypatch, tmp_path, installed, message):
    import importlib.metadata

    from specedge.engines import providers

    real = importlib.metadata.version

    def version(name):
        if name in providers.ORT_DISTRIBUTIONS:
            if name in installed:
                return "1.31.0"
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    providers.check_onnxruntime_install.cache_clear()
    try:
        bundle = _fake_bundle(tmp_path / "b")
        entry = load_manifest(bundle).target
        with pytest.raises(BackendUnavailableError, match=message):
            create_engine(entry, bundle / entry.graph, EngineOptions())
    finally:
        providers.check_onnxruntime_install.cache_clear()


def test_this_install_has_exactly_one_onnxruntime():
    from specedge.engines.providers import check_onnxruntime_install, installed_onnxruntime_distributions

    assert installed_onnxruntime_distributions() == [check_onnxruntime_install()]


# --------------------------------------------------------------------------- 4. providers that load


def test_the_embedded_probe_graph_is_what_onnx_writes():
    from onnx import TensorProto, helper

    from specedge.engines.providers import PROBE_GRAPH

    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              producer_name="specedge-probe")
    assert model.SerializeToString() == PROBE_GRAPH


def test_the_cpu_provider_loads_and_runs():
    from specedge.engines.providers import probe_provider

    assert probe_provider("cpu").to_json() == {"compiled": True, "loadable": True, "reason": None}


def test_a_provider_compiled_in_but_failing_to_load_is_not_usable_and_says_why(monkeypatch):
    """onnxruntime-gpu lists TensorRT with no TensorRT installed (onnxruntime#13501): the session is what counts."""
    import onnxruntime as ort

    from specedge.engines import providers, tensorrt

    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(tensorrt, "tensorrt_version", lambda: None)
    seen = {}

    def session(model, so, providers=None, **kwargs):
        seen.update(providers=providers, kwargs=kwargs)
        raise RuntimeError("onnxruntime_providers_tensorrt.so: libnvinfer.so.10: cannot open shared object file")

    monkeypatch.setattr(ort, "InferenceSession", session)
    probe = providers.probe_provider("tensorrt")
    assert (probe.compiled, probe.loadable) == (True, False)
    assert "libnvinfer.so.10: cannot open shared object file" in probe.reason
    assert seen["kwargs"] == {"enable_fallback": 0}  # no silent retry on CUDA/CPU
    assert [p[0] if isinstance(p, tuple) else p for p in seen["providers"]] == [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_a_session_that_silently_dropped_the_provider_is_not_usable(monkeypatch):
    import onnxruntime as ort

    from specedge.engines import providers

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    real = ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession",
                        lambda model, so, providers=None, **kw: real(model, so, providers=["CPUExecutionProvider"]))
    probe = providers.probe_provider("cuda")
    assert not probe.loadable and "without CUDAExecutionProvider" in probe.reason


def test_doctor_reports_each_provider_loadable_or_not_with_the_reason():
    from click.testing import CliRunner

    from specedge.cli.main import main

    out = CliRunner().invoke(main, ["doctor", "--json"])
    assert out.exit_code == 0, out.output
    ort = json.loads(out.output)["onnxruntime"]
    assert ort["providers"]["cpu"] == {"compiled": True, "loadable": True, "reason": None}
    for name in ("cuda", "tensorrt"):
        probe = ort["providers"][name]
        assert ort["usable"][name] is probe["loadable"]
        assert probe["loadable"] or probe["reason"]
    assert ort["installed"] == [ort["package"]] and ort["install_problem"] is None


# --------------------------------------------------------------------------- 5. the docs


def test_the_docs_install_the_tensorrt_major_the_ep_loads_and_put_its_libraries_on_the_path():
    from specedge.engines.tensorrt import ORT_TRT_EP_TENSORRT_MAJOR

    text = (REPO / "docs" / "GPU.md").read_text()
    major = ORT_TRT_EP_TENSORRT_MAJOR
    assert f"tensorrt-cu13=={major}.*" in text and f"tensorrt-cu12=={major}.*" in text
    assert "tensorrt_libs" in text and "LD_LIBRARY_PATH" in text
    assert "580" in text  # onnxruntime-gpu 1.31's CUDA 13 needs driver >= 580
    assert "pip install tensorrt\n" not in text  # that gives TensorRT 11, which the EP cannot load


# --------------------------------------------------------------------------- 6. TensorRT 11


def _trt11(monkeypatch):
    import types

    cudart = _fake_tensorrt(monkeypatch)
    trt = sys.modules["tensorrt"]
    trt.__version__ = "11.2.1"
    trt.BuilderFlag = types.SimpleNamespace()  # no FP16 / INT8 / TF32
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace()  # no STRONGLY_TYPED: it is the only mode
    return cudart


def test_tensorrt_11_builds_a_graph_at_its_own_precision(standard_pair, monkeypatch, tmp_path):
    from specedge.export.tensorrt import build_engines_for_bundle

    _trt11(monkeypatch)
    bundle = shutil.copytree(standard_pair, tmp_path / "bundle")
    manifest = build_engines_for_bundle(bundle, precision="fp32", route="native", max_prompt=16, quiet=True)
    record = manifest.extra.engines["target"]
    plan = json.loads((bundle / record.file).read_text())
    assert plan["strongly_typed"] is False  # create_network(0): strongly typed is the only mode on 11
    assert not {"FP16", "INT8"} & set(plan["flags"])
    assert record.tensorrt_version == "11.2.1"


def test_tensorrt_11_refuses_an_fp32_graph_at_fp16_before_building(standard_pair, monkeypatch, tmp_path):
    from specedge.export.tensorrt import build_trt_engine, verify_profiles

    _trt11(monkeypatch)
    entry = load_manifest(standard_pair, verify_checksums=False).target
    with pytest.raises(InvalidParameterError, match="TensorRT 11.2.1 builds only strongly typed networks.*"
                                                    "--precision fp16"):
        build_trt_engine(standard_pair / entry.graph, tmp_path / "x.plan", verify_profiles(entry, 4, 16), "fp16")
    assert not (tmp_path / "x.plan").exists()


def test_the_tensorrt_ep_route_refuses_tensorrt_11(monkeypatch):
    from specedge.engines.tensorrt import check_ort_trt_tensorrt

    check_ort_trt_tensorrt("10.16.0")
    check_ort_trt_tensorrt(None)
    with pytest.raises(BackendUnavailableError, match=r"TensorRT EP needs TensorRT 10\.x but this machine has "
                                                      r"TensorRT 11\.2\.1.*--trt-route native"):
        check_ort_trt_tensorrt("11.2.1")


# --------------------------------------------------------------------------- 7. TensorRT's failures


def test_a_profile_switch_tensorrt_raises_on_becomes_a_typed_error(standard_pair, monkeypatch, tmp_path):
    from specedge.engines.tensorrt import TensorrtEngine

    _fake_tensorrt(monkeypatch)
    entry = load_manifest(standard_pair, verify_checksums=False).target
    native = TensorrtEngine(entry, _plan(tmp_path, standard_pair), EngineOptions())

    def refuse(index, stream):
        raise RuntimeError("IExecutionContext::setOptimizationProfileAsync: profile index out of range")

    monkeypatch.setattr(native.context, "set_optimization_profile_async", refuse)
    with pytest.raises(BackendUnavailableError, match="refused optimization profile 1: .*out of range"):
        native.forward(np.asarray(PROMPT_IDS, np.int64), native.new_cache())


def test_a_refused_input_shape_becomes_a_typed_error(standard_pair, monkeypatch, tmp_path):
    from specedge.engines.tensorrt import TensorrtEngine

    _fake_tensorrt(monkeypatch)
    entry = load_manifest(standard_pair, verify_checksums=False).target
    native = TensorrtEngine(entry, _plan(tmp_path, standard_pair), EngineOptions())
    monkeypatch.setattr(native.context, "set_input_shape", lambda name, shape: name != "past_key.1")
    with pytest.raises(BackendUnavailableError, match=r"TensorRT refused shape \(0, 2, 16\) for past_key\.1"):
        native.forward(np.array([5, 6]), native.new_cache())


# --------------------------------------------------------------------------- 8. provider order


def test_tensorrt_sessions_list_cuda_before_cpu():
    from specedge.engines.ort import session_providers

    cuda = {"device_id": "1", "user_compute_stream": "42"}
    assert session_providers("tensorrt", {"trt_fp16_enable": "True", **cuda}, cuda) == [
        ("TensorrtExecutionProvider", {"trt_fp16_enable": "True", **cuda}), ("CUDAExecutionProvider", cuda),
        "CPUExecutionProvider"]
    assert session_providers("cuda", cuda, cuda) == [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    assert session_providers("cpu") == [("CPUExecutionProvider", {})]


def test_the_gpu_engine_creates_its_tensorrt_session_with_cuda_in_between(monkeypatch, tmp_path):
    import onnxruntime as ort

    from specedge.engines import ort as ort_engine
    from specedge.engines.ort_cuda import OrtCudaEngine

    monkeypatch.setattr(ort_engine, "check_provider", lambda provider: None)
    seen = []

    class Stop(Exception):
        pass

    def session(path, so, providers=None):
        seen.append(providers)
        raise Stop

    monkeypatch.setattr(ort, "InferenceSession", session)
    with pytest.raises(Exception):
        OrtCudaEngine(replace(_entry(), head_dim=64), tmp_path / "model.onnx", EngineOptions(provider="tensorrt",
                                                                                            device_id=1),
                      {"trt_fp16_enable": "True"}, stream=42)
    names = [p[0] if isinstance(p, tuple) else p for p in seen[0]]
    assert names == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert seen[0][1][1] == {"device_id": "1", "user_compute_stream": "42"}


# --------------------------------------------------------------------------- 9. the per-step prefix copy


# A view of a tensor (ORT aliases their outputs to their input: no bytes move) and the
# consumers that read a cached prefix where it lies. A last-two-axes Transpose is allowed
# only straight into a MatMul: ORT fuses the pair into one GEMM with transB (checked on the
# optimized graph below) and TensorRT into its matrix op.
_VIEWS = {"Reshape", "Squeeze", "Unsqueeze"}
_READERS_IN_PLACE = {"Shape", "MatMul", "FusedMatMul"}


def _prefix_copies(graph, pasts: set[str]) -> list[str]:
    """Nodes of ``graph`` that copy (or may copy) a cached prefix, following views of it."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    copies, seen, todo = [], set(), list(pasts)
    while todo:
        for node in consumers.get(todo.pop(), []):
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op_type in _VIEWS:
                todo.append(node.output[0])
            elif node.op_type == "FusedMatMul" and any(a.name.startswith("transBatch") and a.i for a in node.attribute):
                copies.append(f"{node.op_type} {node.name} (batch-transposed operand)")
            elif node.op_type == "Transpose" and [a.ints for a in node.attribute if a.name == "perm"] == [[1, 0]] \
                    and all(c.op_type == "MatMul" for c in consumers.get(node.output[0], [])):
                continue  # becomes the GEMM's transB; the optimized-graph check below proves ORT fuses it
            elif node.op_type not in _READERS_IN_PLACE:
                copies.append(f"{node.op_type} {node.name}")
    return copies


def test_the_standard_graph_reads_the_cached_prefix_in_place(standard_pair, tmp_path):
    """Issue 19 item 9: no Concat, Transpose or other copy of past_key/past_value, as exported
    (TensorRT's input) and after ONNX Runtime's optimizer (what the CPU and CUDA EPs run)."""
    import onnx

    from specedge.engines.ort import OrtEngine

    entry = load_manifest(standard_pair, verify_checksums=False).target
    pasts = {entry.io.past_key % i for i in range(entry.n_layers)} | {entry.io.past_value % i
                                                                      for i in range(entry.n_layers)}
    graph = onnx.load(str(standard_pair / entry.graph), load_external_data=False).graph
    assert _prefix_copies(graph, pasts) == []
    assert not any(n.op_type == "Concat" and pasts & set(n.input) for n in graph.node)

    optimized = tmp_path / "optimized.onnx"
    engine = OrtEngine(entry, standard_pair / entry.graph, EngineOptions(intra_op_threads=1,
                                                                         optimized_model_path=str(optimized)))
    assert _greedy(engine) == _greedy(OrtEngine(entry, standard_pair / entry.graph,
                                                EngineOptions(intra_op_threads=1, graph_optimization="disable")))
    graph = onnx.load(str(optimized), load_external_data=False).graph
    assert _prefix_copies(graph, pasts) == []
    # Every prefix is read by a GEMM; the keys' one through ORT's fused transB.
    gemms = [n for n in graph.node if n.op_type in ("MatMul", "FusedMatMul")
             and any(_views_of(graph, p) & set(n.input) for p in pasts)]
    assert len(gemms) == 2 * entry.n_layers
    assert not any(n.op_type == "Transpose" and any(_views_of(graph, p) & set(n.input) for p in pasts)
                   for n in graph.node)


def _views_of(graph, name: str) -> set[str]:
    """``name`` and every tensor that is a view (Reshape, Squeeze, Unsqueeze) of it."""
    views, grown = {name}, True
    while grown:
        grown = False
        for node in graph.node:
            if node.op_type in _VIEWS and node.input[0] in views and node.output[0] not in views:
                views.add(node.output[0])
                grown = True
    return views


# --------------------------------------------------------------------------- 10. engine caches


def test_an_ort_trt_engine_from_another_onnxruntime_release_is_refused():
    record = _record(route="ort-trt", onnxruntime_version="1.22.1")
    check_engine_compatible(record, replace(FACTS, onnxruntime_version="1.22.0"))  # patch releases share a cache
    with pytest.raises(BackendUnavailableError, match=r"built for ONNX Runtime 1\.22 but this machine has ONNX "
                                                      r"Runtime 1\.31.*rebuild with"):
        check_engine_compatible(record, replace(FACTS, onnxruntime_version="1.31.1"))
    check_engine_compatible(replace(record, route="native"), replace(FACTS, onnxruntime_version="1.31.1"))


def _ort_trt_bundle(root: Path, engine_file: str, files: dict[str, bytes]) -> Path:
    record = _record(route="ort-trt", file="target/trt-ort", cache_key="abc", engine_file=engine_file,
                     sha256=__import__("hashlib").sha256(b"the engine").hexdigest())
    bundle = _fake_bundle(root, engines={"target": record.to_dict()})
    (bundle / "target" / "trt-ort").mkdir()
    for name, data in files.items():
        (bundle / "target" / "trt-ort" / name).write_bytes(data)
    return bundle


@pytest.mark.parametrize("engine_file, files, error, message", [
    ("", {"abc_1.engine": b"the engine", "abc_2.engine": b"old"}, ChecksumError, "holds 2 engine files for key abc"),
    ("", {}, ChecksumError, "holds no engine file for key abc"),
    ("target/trt-ort/abc_1.engine", {"abc_1.engine": b"replaced"}, ChecksumError, "differs from the one the manifest"),
    ("target/trt-ort/abc_1.engine", {}, BackendUnavailableError, "abc_1.engine is missing"),
])
def test_the_ep_engine_file_is_always_checked(tmp_path, engine_file, files, error, message):
    from specedge.engines.ort_cuda import check_ort_trt_engine_file

    bundle = _ort_trt_bundle(tmp_path / "b", engine_file, files)
    record = load_manifest(bundle).extra.engines["target"]
    with pytest.raises(error, match=message):
        check_ort_trt_engine_file(bundle, record, "target")


def test_the_recorded_ep_engine_file_passes_beside_others(tmp_path):
    from specedge.engines.ort_cuda import check_ort_trt_engine_file

    bundle = _ort_trt_bundle(tmp_path / "b", "target/trt-ort/abc_1.engine",
                             {"abc_1.engine": b"the engine", "abc_1.profile": b"x", "abc_9.engine": b"other"})
    check_ort_trt_engine_file(bundle, load_manifest(bundle).extra.engines["target"],
                              "target")


# --------------------------------------------------------------------------- 11. native bundles load


def test_a_native_tensorrt_bundle_loads_through_generator_from_bundle(standard_pair, monkeypatch, tmp_path):
    from specedge.engines.tensorrt import TensorrtEngine
    from specedge.export.tensorrt import build_engines_for_bundle
    from specedge.runtime.generator import Generator

    _fake_tensorrt(monkeypatch)
    bundle = shutil.copytree(standard_pair, tmp_path / "bundle")
    manifest = build_engines_for_bundle(bundle, precision="fp32", route="native", max_prompt=16, quiet=True)
    entry = manifest.target
    assert backend_for(entry, bundle / entry.graph, "tensorrt") == "tensorrt"
    assert backend_for(entry, bundle / entry.graph, "cuda") == "onnxruntime-gpu"
    assert backend_for(entry, bundle / entry.graph, "cpu") == "onnxruntime"
    gen = Generator.from_bundle(bundle, provider="tensorrt")
    assert isinstance(gen.target.inner, TensorrtEngine) and isinstance(gen.draft, TensorrtEngine)
    cpu = Generator.from_bundle(bundle, provider="cpu", threads=1)
    config = dict(input_ids=PROMPT_IDS, max_new_tokens=16, chat=False, drafter="model", draft_tokens=3,
                  adaptive=False, temperature=0.0)
    assert gen.generate(**config).token_ids == cpu.generate(**config).token_ids


def test_without_a_native_record_tensorrt_means_the_ep(tmp_path):
    bundle = _fake_bundle(tmp_path / "b")
    entry = load_manifest(bundle).target
    assert backend_for(entry, bundle / entry.graph, "tensorrt") == "onnxruntime-gpu"


# --------------------------------------------------------------------------- 12. no per-run readback


def test_the_rewritten_graph_gives_the_same_logits_with_the_row_count_as_a_length(standard_pair, tmp_path):
    import onnxruntime as ort

    from specedge.export.trt_graph import logits_rows_from_shape, trt_graph_path

    entry = load_manifest(standard_pair, verify_checksums=False).target
    source = standard_pair / entry.graph
    work = Path(shutil.copytree(standard_pair, tmp_path / "b")) / entry.graph
    rewritten = logits_rows_from_shape(work, trt_graph_path(work))
    assert rewritten.stat().st_size < 100_000  # the graph only: weights stay in the shared data file
    before = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(str(rewritten), providers=["CPUExecutionProvider"])
    assert {i.name: i.shape for i in after.get_inputs()}["num_logits_to_keep"] == ["num_logits"]
    n, keep = 6, 4
    feed = {"input_ids": np.arange(6, 6 + n, dtype=np.int64)[None], "position_ids": np.arange(n, dtype=np.int64)[None]}
    for i in range(entry.n_layers):
        for kind in ("key", "value"):
            feed[f"past_{kind}.{i}"] = np.zeros((0, entry.n_kv_heads, entry.head_dim), np.float32)
    want = before.run(["logits"], {**feed, "num_logits_to_keep": np.array([keep], np.int64)})[0]
    got = after.run(["logits"], {**feed, "num_logits_to_keep": np.full(keep, -7, np.int64)})[0]  # values unread
    assert got.shape == (1, keep, entry.vocab_size)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(Exception, match="no int64 \\[1\\] input"):
        logits_rows_from_shape(rewritten, rewritten.with_name("again.onnx"))


def test_engines_on_the_rewritten_graph_read_nothing_back(standard_pair, monkeypatch, tmp_path):
    """Native: the row count is set as a dims, bound at an aligned device address. ORT EP route: the same binding."""
    from specedge.engines.ort import OrtEngine
    from specedge.engines.ort_cuda import OrtCudaEngine
    from specedge.engines.tensorrt import TensorrtEngine
    from specedge.export.trt_graph import trt_graph_path

    _fake_tensorrt(monkeypatch)
    entry = load_manifest(standard_pair, verify_checksums=False).target
    bundle = Path(shutil.copytree(standard_pair, tmp_path / "b"))
    native = TensorrtEngine(entry, _plan(tmp_path, bundle, rows_from_shape=True), EngineOptions())
    assert not native._keep_on_host
    cpu = OrtEngine(entry, bundle / entry.graph, EngineOptions(intra_op_threads=1))
    assert _greedy(native) == _greedy(cpu)
    context = native.engine.contexts[0]
    assert context.shapes["num_logits_to_keep"] == (1,)  # the last decode step kept one row
    keep_addresses = {ptr for name, ptr in context.bound if name == "num_logits_to_keep"}
    assert keep_addresses == {native._rows_dev} and native._rows_dev % ALIGNMENT == 0

    rewritten = trt_graph_path(bundle / entry.graph)
    ep = OrtCudaEngine(entry, rewritten, EngineOptions(intra_op_threads=1), logits_rows_from_shape=True)
    assert _greedy(ep) == _greedy(cpu)
    kv = ep.new_cache()
    np.testing.assert_allclose(ep.forward(np.asarray(PROMPT_IDS, np.int64), kv, num_logits=5),
                               cpu.forward(np.asarray(PROMPT_IDS, np.int64), cpu.new_cache(), num_logits=5),
                               rtol=1e-4, atol=1e-5)


def test_the_ort_trt_build_records_the_rewritten_graph_and_its_checksum(standard_pair, monkeypatch, tmp_path):
    """The TensorRT EP route's build on CPU: OrtCudaEngine is what runs; the EP itself is not here."""
    from specedge.engines import ort as ort_engine
    from specedge.engines import ort_cuda
    from specedge.export import tensorrt as export_trt

    bundle = Path(shutil.copytree(standard_pair, tmp_path / "bundle"))
    monkeypatch.setattr(ort_engine, "check_provider", lambda provider: None)
    monkeypatch.setattr(export_trt, "check_ort_trt_tensorrt", lambda version: None)
    monkeypatch.setattr(export_trt, "runtime_facts", lambda device_id=0: FACTS)
    runs = []

    class CpuStandIn(ort_cuda.OrtCudaEngine):  # the EP would write its engine file on this first run
        def __init__(self, entry, graph, options, provider_options, **kwargs):
            runs.append((graph, provider_options, kwargs))
            super().__init__(entry, graph, EngineOptions(intra_op_threads=1), **kwargs)
            cache = Path(provider_options["trt_engine_cache_path"])
            (cache / f"{provider_options['trt_engine_cache_prefix']}_x_sm90.engine").write_bytes(graph.name.encode())

    monkeypatch.setattr(ort_cuda, "OrtCudaEngine", CpuStandIn)
    manifest = export_trt.build_engines_for_bundle(bundle, precision="fp32", route="ort-trt", max_prompt=16,
                                                   quiet=True)
    record = manifest.extra.engines["target"]
    assert record.graph == "target/model.trt.onnx" and record.graph in load_manifest(bundle).files
    assert record.engine_file == f"target/trt-ort/{record.cache_key}_x_sm90.engine"
    assert runs[0][0].name == "model.trt.onnx" and runs[0][2]["logits_rows_from_shape"] is True
    merged = record.profiles[0]
    assert merged.values == {} and merged.shapes["num_logits_to_keep"].max == (16,)


# --------------------------------------------------------------------------- doctor --verify


def test_doctor_verify_checks_what_this_machine_allows_and_says_what_it_skipped():
    from click.testing import CliRunner

    from specedge.cli.main import main
    from specedge.engines.gpu_probe import ROUTES, route_missing

    out = CliRunner().invoke(main, ["doctor", "--verify"])
    assert out.exit_code == 0, out.output[-3000:]
    report = json.loads(out.stdout)
    cpu_mode = report["routes"]["cpu-mode"]
    assert cpu_mode["status"] == "pass", cpu_mode
    assert all(run["equal"] for run in cpu_mode["runs"].values())
    assert cpu_mode["addresses"]["misaligned"] == 0 and cpu_mode["addresses"]["bound"] > 0
    assert report["reference"]["greedy_speculative_equals_plain_on_cpu"] is True
    for route in ROUTES[1:]:
        why = route_missing(route)
        result = report["routes"][route]
        if why is not None:
            assert result == {"status": "skipped", "reason": why}
            assert f"{route}: {why}" in report["not_checked"]
        else:
            assert result["status"] == "pass", result
    assert report["ok"] is True and report["seconds"] < 300


def test_doctor_verify_without_the_exporter_skips_everything_and_says_why(monkeypatch):
    from specedge.bench import device_check as verify

    monkeypatch.setattr(verify, "exporter_missing", lambda: "the exporter needs torch and transformers (test)")
    report = verify.run_verify(routes=("cpu-mode",))
    assert report["routes"]["cpu-mode"] == {"status": "skipped",
                                            "reason": "the exporter needs torch and transformers (test)"}
    assert report["ok"] is True and "the exporter needs torch and transformers (test)" in report["not_checked"]


# --------------------------------------------------------------------------- fixed-address steps (CUDA-graph ready)


@pytest.fixture(scope="module")
def gqa_bundle(tiny_model, export) -> Path:
    """The default export: fused GQA, head-major cache shared as past and present (fp32 runs on ORT CPU)."""
    return export(tiny_model("llama"))


def test_fixed_address_steps_give_the_dynamic_engines_logits_and_never_rebind(gqa_bundle):
    """What a captured CUDA graph needs: after a token count's first run, no address or shape changes."""
    from specedge.engines.gpu_probe import AddressLog
    from specedge.engines.ort_cuda import OrtCudaEngine

    entry = load_manifest(gqa_bundle, verify_checksums=False).target
    options = EngineOptions(intra_op_threads=1)
    dynamic = OrtCudaEngine(entry, gqa_bundle / entry.graph, options)
    static = OrtCudaEngine(entry, gqa_bundle / entry.graph, options, static_steps=5)
    log = AddressLog()
    log.watch(static)
    kv_d, kv_s = dynamic.new_cache(), static.new_cache()
    ids = np.asarray(PROMPT_IDS, np.int64)
    np.testing.assert_array_equal(static.forward(ids, kv_s), dynamic.forward(ids, kv_d))  # prefill: dynamic path
    after_prefill = len(log.addresses)
    for step in range(12):  # decode steps, and a verify of 5 that is rejected and rewound, at moving positions
        token = np.array([6 + step], np.int64)
        np.testing.assert_allclose(static.forward(token, kv_s), dynamic.forward(token, kv_d), rtol=1e-5, atol=1e-6)
        block = np.arange(30 + step, 35 + step, dtype=np.int64)
        np.testing.assert_allclose(static.forward(block, kv_s, num_logits=3),
                                   dynamic.forward(block, kv_d, num_logits=3), rtol=1e-5, atol=1e-6)
        kv_s.rewind(5)
        kv_d.rewind(5)
    per_binding = 3 + 4 * entry.n_layers + 1  # ids, positions, seqlens_k; past/present K/V; logits
    assert len(log.addresses) - after_prefill == 2 * per_binding  # bound once for n=1 and once for n=5
    assert [(n, hex(p)) for n, p in log.addresses[after_prefill:] if p % ALIGNMENT] == []  # logits on the device too


def test_fixed_address_steps_need_the_gqa_graph_and_capture_needs_cuda(tmp_path):
    from specedge.engines.ort_cuda import OrtCudaEngine

    with pytest.raises(InvalidParameterError, match="fixed-address steps need the fused-GQA graph"):
        OrtCudaEngine(_entry(), tmp_path / "m.onnx", EngineOptions(), static_steps=5)
    with pytest.raises(InvalidParameterError, match="CUDA graph capture needs provider cuda"):
        OrtCudaEngine(replace(_entry(), attention="gqa"), tmp_path / "m.onnx", EngineOptions(), static_steps=5,
                      cuda_graph=True)
