"""The CPU half of the GPU path: every shape the loop sends has a profile, the
options ORT receives are the strings it parses, an engine is refused (with the
rebuild hint) on any TensorRT / GPU mismatch, and the engines' binding,
chunking and rollback give the CPU engine's tokens.

The device-cache engine runs its own binding code on host buffers (provider
cpu). The native TensorRT engine and its build run on a simulated TensorRT:
ORT CPU behind the TensorRT calls the code makes, host memory as the device.
Nothing here needs a GPU, TensorRT or cuda-python; the GPU half is test_gpu.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import PROMPT_IDS
from specedge.engines import EngineOptions, create_engine
from specedge.engines.base import KVCache
from specedge.engines.tensorrt import (EngineRecord, RuntimeFacts, bundle_engine_record, forward_in_chunks,
                                       select_profile, split_tokens)
from specedge.errors import BackendUnavailableError, InvalidParameterError, ManifestError, UnsafePathError
from specedge.export.tensorrt import (build_engines_for_bundle, build_trt_engine, check_engine_compatible,
                                      check_tensorrt_export, engine_cache_key, engine_paths, merge_profiles,
                                      ort_trt_provider_options, verify_profiles)
from specedge.bundle.manifest import (Manifest, ModelEntry, SpeculationDefaults, TokenizerEntry, file_record,
                               load_manifest, write_manifest)

MAX_CONTEXT = 64
SHA = "ab" * 32


def _entry(n_layers: int = 2, precision: str = "fp32") -> ModelEntry:
    return ModelEntry(graph="target/model.onnx", architecture="llama", source="test", precision=precision,
                      n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=100,
                      max_context=MAX_CONTEXT, eos_token_ids=(1,))


def _record(**changes) -> EngineRecord:
    profiles = verify_profiles(_entry(), 8, 32, draft_tokens=4)
    record = EngineRecord(route="native", tensorrt_version="10.3.0", gpu_name="NVIDIA H200",
                          compute_capability="9.0", precision="fp16", profiles=profiles,
                          file="target/trt/0123456789abcdef.plan", sha256=SHA, cache_key="0123456789abcdef")
    return replace(record, **changes)


def _fake_bundle(root: Path, precision: str = "fp32", engines: dict | None = None) -> Path:
    """A bundle whose files exist with the right checksums but hold no real graph (guards only)."""
    (root / "target").mkdir(parents=True)
    (root / "tokenizer.json").write_text("{}")
    # Empty bytes: a well-formed (empty) ONNX protobuf, so the loader's graph-file check passes,
    # but no graph ONNX Runtime could run.
    (root / "target" / "model.onnx").write_bytes(b"")
    entry = _entry(precision=precision)
    files = {rel: file_record(root / rel) for rel in ("tokenizer.json", "target/model.onnx")}
    write_manifest(root, Manifest(target=entry, tokenizer=TokenizerEntry(config=None, chat_template=None),
                                  speculation=SpeculationDefaults(drafter="ngram"), files=files,
                                  extra={"engines": engines} if engines else {}))
    return root


# --------------------------------------------------------------------------- profiles


def test_step_profile_spans_one_token_decode_to_the_largest_verify():
    step, _ = verify_profiles(_entry(), max_draft_tokens=8, max_prompt=32, draft_tokens=4)
    assert step.name == "step"
    for name in ("input_ids", "position_ids"):
        r = step.shapes[name]
        assert (r.min, r.opt, r.max) == ((1, 1), (1, 5), (1, 9))  # n: 1 .. k_max+1, tuned for k+1 = 5
    for i in range(2):
        for kind in ("key", "value"):
            r = step.shapes[f"past_{kind}.{i}"]
            assert (r.min, r.opt, r.max) == ((0, 2, 8), (32, 2, 8), (63, 2, 8))
    keep = step.shapes["num_logits_to_keep"]  # the rewritten graph: its length is the row count
    assert (keep.min, keep.opt, keep.max) == ((1,), (5,), (9,))
    assert step.values == {}  # no shape tensor: nothing is read back to the host per run


def test_the_graph_as_exported_gets_a_values_range_for_its_shape_tensor():
    step, _ = verify_profiles(_entry(), 8, 32, draft_tokens=4, logits_rows_from_shape=False)
    keep = step.values["num_logits_to_keep"]  # a shape tensor: its values, not its dims
    assert (keep.min, keep.opt, keep.max) == ((1,), (5,), (9,))
    assert "num_logits_to_keep" not in step.shapes


def test_prefill_profile_covers_the_prompt_limit_from_an_empty_cache():
    _, prefill = verify_profiles(_entry(), max_draft_tokens=8, max_prompt=32, draft_tokens=4)
    assert prefill.name == "prefill"
    r = prefill.shapes["input_ids"]
    assert (r.min, r.opt, r.max) == ((1, 1), (1, 16), (1, 32))
    assert prefill.shapes["past_key.0"].opt == (0, 2, 8)
    assert prefill.shapes["past_key.0"].max == (63, 2, 8)  # a draft catching up, a chunk of a long prompt
    assert prefill.shapes["num_logits_to_keep"].max == (32,)


def test_no_prefill_profile_when_every_prompt_fits_the_step_profile():
    profiles = verify_profiles(_entry(), max_draft_tokens=8, max_prompt=9)
    assert [p.name for p in profiles] == ["step"]


def test_every_forward_the_loop_makes_has_a_profile():
    entry = _entry()
    profiles = verify_profiles(entry, max_draft_tokens=8, max_prompt=32, draft_tokens=4)
    for past in range(MAX_CONTEXT):
        for n in range(1, min(32, MAX_CONTEXT - past) + 1):
            p = profiles[select_profile(profiles, entry.io, n, past)]
            assert p.shapes["input_ids"].contains((1, n))
            assert p.shapes["past_key.0"].contains((past, 2, 8))
            assert p.shapes["num_logits_to_keep"].contains((n,))
            assert p.name == ("step" if n <= 9 else "prefill")  # verifies use the profile tuned for them


def test_a_forward_no_profile_covers_is_refused():
    entry = _entry()
    profiles = verify_profiles(entry, max_draft_tokens=8, max_prompt=32)
    with pytest.raises(InvalidParameterError, match="no TensorRT profile covers 33 new tokens"):
        select_profile(profiles, entry.io, 33, 0)


@pytest.mark.parametrize("args, message", [
    ((0, 32), "max_draft_tokens must be in"),
    ((64, 32), "max_draft_tokens must be in"),
    ((8, 0), "max_prompt must be in"),
    ((8, 64), "max_prompt must be in"),
])
def test_profile_limits_are_checked(args, message):
    with pytest.raises(InvalidParameterError, match=message):
        verify_profiles(_entry(), *args)


def test_draft_tokens_beyond_the_max_are_refused():
    with pytest.raises(InvalidParameterError, match="draft_tokens must be in"):
        verify_profiles(_entry(), 4, 32, draft_tokens=5)


def test_merged_profile_spans_all_and_stays_tuned_for_the_verify():
    step, prefill = verify_profiles(_entry(), 8, 32, draft_tokens=4)
    merged = merge_profiles([step, prefill])
    r = merged.shapes["input_ids"]
    assert (r.min, r.opt, r.max) == ((1, 1), (1, 5), (1, 32))
    assert merged.shapes["past_value.1"].opt == (32, 2, 8)
    keep = merged.shapes["num_logits_to_keep"]
    assert (keep.min, keep.opt, keep.max) == ((1,), (5,), (32,))


# --------------------------------------------------------------------------- ORT options


def test_provider_options_are_the_strings_ort_parses():
    profiles = verify_profiles(_entry(n_layers=1), 8, 32, draft_tokens=4)
    options = ort_trt_provider_options(profiles, cache_dir="target/trt-ort", cache_prefix="abc", precision="fp16")
    assert all(isinstance(v, str) for v in options.values())
    assert options["trt_profile_min_shapes"] == ("input_ids:1x1,position_ids:1x1,past_key.0:0x2x8,"
                                                 "past_value.0:0x2x8,num_logits_to_keep:1")
    assert options["trt_profile_opt_shapes"] == ("input_ids:1x5,position_ids:1x5,past_key.0:32x2x8,"
                                                 "past_value.0:32x2x8,num_logits_to_keep:5")
    assert options["trt_profile_max_shapes"] == ("input_ids:1x32,position_ids:1x32,past_key.0:63x2x8,"
                                                 "past_value.0:63x2x8,num_logits_to_keep:32")
    assert options["trt_engine_cache_enable"] == "True"
    assert options["trt_engine_cache_path"] == options["trt_timing_cache_path"] == "target/trt-ort"
    assert options["trt_engine_cache_prefix"] == "abc"
    assert (options["trt_fp16_enable"], options["trt_int8_enable"]) == ("True", "False")
    assert "device_id" not in options  # per machine: added when the session is created


@pytest.mark.parametrize("precision, fp16, int8", [("fp32", "False", "False"), ("int8", "True", "True")])
def test_precision_flags(precision, fp16, int8):
    options = ort_trt_provider_options(verify_profiles(_entry(), 4, 16), cache_dir="c", cache_prefix="p",
                                       precision=precision, workspace_bytes=1 << 30)
    assert (options["trt_fp16_enable"], options["trt_int8_enable"]) == (fp16, int8)
    assert options["trt_max_workspace_size"] == str(1 << 30)


def test_multi_profile_strings_repeat_each_input_once_per_profile():
    profiles = verify_profiles(_entry(n_layers=1), 8, 32, draft_tokens=4)
    shapes = ort_trt_provider_options(profiles, cache_dir="c", cache_prefix="p", multi_profile=True)
    entries = shapes["trt_profile_max_shapes"].split(",")
    assert [e for e in entries if e.startswith("input_ids:")] == ["input_ids:1x9", "input_ids:1x32"]


def test_unknown_precision_is_refused():
    with pytest.raises(InvalidParameterError, match="precision must be one of"):
        ort_trt_provider_options(verify_profiles(_entry(), 4, 16), cache_dir="c", cache_prefix="p", precision="bf16")


# --------------------------------------------------------------------------- keys and paths


def test_cache_key_names_one_build():
    profiles = verify_profiles(_entry(), 8, 32)
    base = dict(graph_sha256=SHA, profiles=profiles, precision="fp16", tensorrt_version="10.3.0",
                compute_capability="9.0", route="native")
    key = engine_cache_key(**base)
    assert len(key) == 16 and int(key, 16) >= 0
    assert engine_cache_key(**base) == key
    assert engine_cache_key(**{**base, "tensorrt_version": "10.3.0.26"}) == key  # the build number is not a format
    for change in ({"graph_sha256": "cd" * 32}, {"profiles": verify_profiles(_entry(), 8, 16)},
                   {"precision": "fp32"}, {"tensorrt_version": "10.4.0"}, {"compute_capability": "8.9"},
                   {"route": "ort-trt"}):
        assert engine_cache_key(**{**base, **change}) != key, change


def test_engine_files_live_next_to_their_graph():
    paths = engine_paths("draft/model.onnx", "0123456789abcdef")
    assert paths.plan == "draft/trt/0123456789abcdef.plan"
    assert paths.ort_cache_dir == "draft/trt-ort"


# --------------------------------------------------------------------------- records and compatibility


def test_engine_record_survives_the_manifest_round_trip():
    record = _record(route="ort-trt", provider_options={"trt_fp16_enable": "True"}, onnxruntime_version="1.22.0")
    assert EngineRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


@pytest.mark.parametrize("edit, error, message", [
    (lambda o: o.pop("gpu_name"), ManifestError, "extra.engines.gpu_name' is missing"),
    (lambda o: o.update(route="onnx"), ManifestError, "engine route must be one of"),
    (lambda o: o.update(file="../outside.plan"), UnsafePathError, "would leave the bundle"),
    (lambda o: o["profiles"][0]["shapes"]["input_ids"].update(min=[1, 10]), ManifestError, "min <= opt <= max"),
    (lambda o: o.update(profiles=[]), ManifestError, "at least one optimization profile"),
    (lambda o: o.update(provider_options={"trt_fp16_enable": True}), ManifestError, "must map names to strings"),
])
def test_a_bad_engine_record_is_refused_naming_the_field(edit, error, message):
    obj = _record().to_dict()
    edit(obj)
    with pytest.raises(error, match=message):
        EngineRecord.from_dict(obj)


FACTS = RuntimeFacts(tensorrt_version="10.3.0", gpu_name="NVIDIA H200", compute_capability="9.0")


def test_the_machine_the_engine_was_built_on_passes():
    check_engine_compatible(_record(), FACTS)
    check_engine_compatible(_record(), replace(FACTS, tensorrt_version="10.3.0.26"))


@pytest.mark.parametrize("facts, message", [
    (replace(FACTS, tensorrt_version="10.5.0"), r"built for TensorRT 10\.3\.0 but this machine has TensorRT 10\.5\.0"),
    (replace(FACTS, compute_capability="8.9"), r"built for compute capability 9\.0 but this machine has compute "
                                                r"capability 8\.9"),
    (replace(FACTS, gpu_name="NVIDIA H100 PCIe"), "built for GPU NVIDIA H200 but this machine has GPU NVIDIA H100"),
])
def test_each_mismatch_is_refused_with_the_rebuild_hint(facts, message):
    with pytest.raises(BackendUnavailableError, match=message) as info:
        check_engine_compatible(_record(), facts, role="target")
    assert "the target TensorRT engine" in str(info.value)
    assert "rebuild with `specedge export --engine tensorrt`" in str(info.value)


def test_facts_nobody_could_determine_are_not_compared():
    check_engine_compatible(_record(tensorrt_version=""), replace(FACTS, tensorrt_version="10.5.0"))
    check_engine_compatible(_record(), RuntimeFacts(None, None, None))


# --------------------------------------------------------------------------- chunking


@pytest.mark.parametrize("n, num_logits, max_tokens", [(5, 1, 8), (8, 8, 8), (9, 1, 8), (17, 5, 8), (20, 8, 8),
                                                        (100, 3, 7), (33, 7, 32)])
def test_chunks_cover_the_forward_and_the_last_holds_every_logits_row(n, num_logits, max_tokens):
    sizes = split_tokens(n, num_logits, max_tokens)
    assert sum(sizes) == n
    assert all(1 <= s <= max_tokens for s in sizes)
    assert sizes[-1] >= num_logits


def test_more_logits_rows_than_a_profile_takes_is_refused():
    with pytest.raises(InvalidParameterError, match="9 logits rows exceed"):
        split_tokens(20, 9, 8)


def test_chunked_forward_advances_the_cache_once_per_token():
    kv = KVCache(1, 1, 1, 64)
    calls = []

    def run(ids, cache, num_logits):
        calls.append((len(ids), cache.length, num_logits))
        cache.length += len(ids)
        return np.zeros((num_logits, 3), np.float32)

    logits = forward_in_chunks(run, np.arange(20), kv, 5, 8)
    assert calls == [(8, 0, 1), (7, 8, 1), (5, 15, 5)]
    assert kv.length == 20 and logits.shape == (5, 3)


# --------------------------------------------------------------------------- builders and backends, no GPU


def test_building_a_native_engine_without_tensorrt_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(BackendUnavailableError, match="pip install --extra-index-url https://pypi.nvidia.com"):
        build_trt_engine(tmp_path / "model.onnx", tmp_path / "x.plan", verify_profiles(_entry(), 4, 16))


@pytest.mark.parametrize("kwargs, bundle_precision, error, message", [
    ({"route": "trtexec"}, "fp32", InvalidParameterError, "route must be one of ort-trt, native"),
    ({"precision": "int8"}, "fp32", InvalidParameterError, "needs Q/DQ nodes or a calibration table"),
    ({"route": "native"}, "int4", InvalidParameterError, "MatMulNBits, an ONNX Runtime operator TensorRT"),
])
def test_build_guards_fail_before_any_gpu_work(tmp_path, kwargs, bundle_precision, error, message):
    bundle = _fake_bundle(tmp_path / "b", precision=bundle_precision)
    before = (bundle / "manifest.json").read_bytes()
    with pytest.raises(error, match=message):
        build_engines_for_bundle(bundle, **kwargs)
    assert (bundle / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("options, message", [
    ({"attention": "gqa", "precision": "fp16"}, "the target graph uses ONNX Runtime's fused GroupQueryAttention"),
    ({"attention": "standard", "precision": "int4"}, "the target model is int4: MatMulNBits"),
    ({"attention": "standard", "precision": "fp16", "draft": "self-int4"}, "the draft model is int4"),
    ({"attention": "standard", "precision": "fp16", "draft": "d", "draft_precision": "int8"}, "draft model is int8"),
])
def test_export_options_tensorrt_cannot_take_are_refused_before_exporting(options, message):
    with pytest.raises(InvalidParameterError, match=message):
        check_tensorrt_export(**options)


def test_export_options_tensorrt_takes_pass():
    check_tensorrt_export("standard", "fp16", draft="./small", draft_precision="fp32")
    check_tensorrt_export("standard", "fp32")


@pytest.mark.parametrize("route, message", [("ort-trt", "execution provider 'tensorrt' is not available"),
                                            ("native", "TensorRT's Python package is not usable")])
def test_build_without_tensorrt_is_refused(tmp_path, monkeypatch, route, message):
    from specedge.engines.ort import available_providers

    if route == "ort-trt" and "tensorrt" in available_providers():
        pytest.skip("this machine has the TensorRT EP")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailableError, match=message):
        build_engines_for_bundle(_fake_bundle(tmp_path / "b"), route=route)


def test_the_tensorrt_backend_needs_an_engine_in_the_bundle(tmp_path):
    bundle = _fake_bundle(tmp_path / "b")
    entry = load_manifest(bundle).target
    with pytest.raises(BackendUnavailableError, match="no native TensorRT engine for its target model"):
        create_engine(entry, bundle / entry.graph, EngineOptions(provider="cuda"), backend="tensorrt")


def test_the_engine_record_is_found_by_the_models_graph(tmp_path):
    record = _record()
    bundle = _fake_bundle(tmp_path / "b", engines={"target": record.to_dict()})
    entry = load_manifest(bundle).target
    root, role, found = bundle_engine_record(entry, (bundle / entry.graph).resolve())
    assert (root, role, found) == (bundle.resolve(), "target", record)


def test_gpus_are_read_from_nvidia_smi(tmp_path, monkeypatch):
    from specedge.engines import tensorrt as trt_engine

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA L4, 8.9, 23034, 570.86'\necho '1, NVIDIA H200, 9.0, 143771, 570.86'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # CUDA's device 0 is the second GPU nvidia-smi lists
    def no_cuda_python():
        raise BackendUnavailableError("cuda-python is not installed")

    monkeypatch.setattr(trt_engine, "import_cudart", no_cuda_python)
    assert trt_engine.nvidia_smi_gpus() == [
        {"index": 0, "name": "NVIDIA L4", "compute_capability": "8.9", "memory_mib": 23034, "driver": "570.86"},
        {"index": 1, "name": "NVIDIA H200", "compute_capability": "9.0", "memory_mib": 143771, "driver": "570.86"}]
    facts = trt_engine.runtime_facts(0)
    assert (facts.gpu_name, facts.compute_capability) == ("NVIDIA H200", "9.0")


def test_the_gpu_backend_refuses_the_cpu_provider(tmp_path):
    bundle = _fake_bundle(tmp_path / "b")
    entry = load_manifest(bundle).target
    with pytest.raises(InvalidParameterError, match="runs on provider cuda or tensorrt"):
        create_engine(entry, bundle / entry.graph, EngineOptions(provider="cpu"), backend="onnxruntime-gpu")


# --------------------------------------------------------------------------- the device-cache engine on CPU buffers


@pytest.fixture(scope="module", params=["standard", "gqa"])
def tiny_bundle(request, tiny_model, export):
    return export(tiny_model("llama"), attention=request.param)


def _engines(bundle: Path, max_tokens: int | None = None):
    from specedge.engines.ort import OrtEngine
    from specedge.engines.ort_cuda import OrtCudaEngine

    entry = load_manifest(bundle, verify_checksums=False).target
    options = EngineOptions(intra_op_threads=1)
    graph = bundle / entry.graph
    return OrtEngine(entry, graph, options), OrtCudaEngine(entry, graph, options, max_tokens=max_tokens)


def _greedy(engine, n_new: int = 24) -> list[int]:
    from specedge.runtime import loop
    from specedge.runtime.sampling import SamplingConfig

    result = loop.LoopResult()
    for _ in loop.run(engine, engine.new_cache(), np.asarray(PROMPT_IDS, np.int64), max_new_tokens=n_new,
                      eos_token_ids=(), sampling=SamplingConfig(), rng=np.random.default_rng(0), result=result):
        pass
    return result.tokens


@pytest.mark.parametrize("max_tokens", [None, 3])
def test_device_cache_engine_generates_what_the_cpu_engine_does(tiny_bundle, max_tokens):
    cpu, bound = _engines(tiny_bundle, max_tokens)
    assert _greedy(bound) == _greedy(cpu)


def test_chunked_prefill_equals_one_pass(tiny_bundle):  # TensorRT profiles bound n; chunking must be exact
    _, whole = _engines(tiny_bundle)
    _, chunked = _engines(tiny_bundle, max_tokens=6)
    ids = np.asarray(PROMPT_IDS, np.int64)
    kv_whole, kv_chunked = whole.new_cache(), chunked.new_cache()
    expected = whole.forward(ids, kv_whole, num_logits=5).copy()
    got = chunked.forward(ids, kv_chunked, num_logits=5)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert kv_whole.length == kv_chunked.length == len(ids)
    for layer in range(len(kv_whole.keys)):
        for a, b in zip(kv_whole.to_host(layer), kv_chunked.to_host(layer)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_rollback_on_the_device_cache_is_a_length_change(tiny_bundle):
    cpu, bound = _engines(tiny_bundle)
    ids = np.asarray(PROMPT_IDS, np.int64)
    kv = bound.new_cache()
    bound.forward(ids, kv)
    prefix = [kv.to_host(layer) for layer in range(len(kv.keys))]
    bound.forward(np.array([7, 8, 9]), kv, num_logits=3)  # a rejected draft block
    kv.rewind(3)
    assert kv.length == len(ids)
    after = bound.forward(np.array([10, 11, 12]), kv, num_logits=3).copy()  # overwrites the rejected slots
    reference = cpu.forward(np.concatenate([ids, [10, 11, 12]]), cpu.new_cache(), num_logits=3)
    np.testing.assert_allclose(after, reference, rtol=1e-4, atol=1e-5)
    kv.rewind(3)  # the prefix itself is untouched by writes past it
    for layer, (k, v) in enumerate(prefix):
        k_now, v_now = kv.to_host(layer)
        np.testing.assert_array_equal(k_now, k)
        np.testing.assert_array_equal(v_now, v)


@pytest.mark.parametrize("provider, changes, error, message", [
    ("cuda", {"attention": "gqa"}, BackendUnavailableError, "fp32 GroupQueryAttention graph"),
    ("tensorrt", {"attention": "gqa"}, InvalidParameterError, "GroupQueryAttention, which TensorRT cannot parse"),
    ("tensorrt", {"precision": "int4"}, InvalidParameterError, "MatMulNBits"),
])
def test_graphs_a_gpu_provider_would_hand_back_to_the_cpu_are_refused(tmp_path, provider, changes, error, message):
    from specedge.engines.ort_cuda import OrtCudaEngine

    with pytest.raises(error, match=message):
        OrtCudaEngine(replace(_entry(), **changes), tmp_path / "model.onnx", EngineOptions(provider=provider))


def test_a_foreign_cache_is_refused(tiny_bundle):
    cpu, bound = _engines(tiny_bundle)
    with pytest.raises(InvalidParameterError, match="needs the cache from its own new_cache"):
        bound.forward(np.array([5]), cpu.new_cache())


# --------------------------------------------------------------------------- doctor


def test_doctor_json_parses_and_lists_cpu_as_usable():
    from specedge.cli.main import main

    out = CliRunner().invoke(main, ["doctor", "--json"])
    assert out.exit_code == 0, out.output
    facts = json.loads(out.output)
    assert facts["onnxruntime"]["usable"]["cpu"] is True
    assert set(facts["onnxruntime"]["usable"]) == {"cpu", "cuda", "tensorrt"}
    assert {"tensorrt", "cuda_python", "gpus", "cpu", "memory", "extras"} <= set(facts)
    assert "export" in facts["extras"] and "gpu" in facts["extras"]


def test_doctor_text_names_each_provider():
    from specedge.cli.main import main

    out = CliRunner().invoke(main, ["doctor"])
    assert out.exit_code == 0, out.output
    assert "providers: cpu yes" in out.output
    assert "cuda " in out.output and "tensorrt " in out.output


def test_doctor_reads_cpu_features_and_ram(tmp_path):
    from specedge.cli.doctor import _cpu, _memory

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\nphysical id\t: 0\ncore id\t: 0\n"
                       "flags\t\t: fpu sse avx2 avx512f avx512_vnni\n\n"
                       "processor\t: 1\nmodel name\t: Test CPU\nphysical id\t: 0\ncore id\t: 0\n"
                       "flags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    cpu = _cpu(cpuinfo)
    assert cpu["model"] == "Test CPU" and cpu["physical_cores"] == 1
    assert cpu["flags"] == {"avx2": True, "avx512": True, "vnni": True}
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:  1 kB\nMemAvailable:    8192 kB\n")
    assert _memory(meminfo) == {"total_bytes": 16384 * 1024, "available_bytes": 8192 * 1024}


def test_doctor_hints_at_onnxruntime_gpu_when_a_gpu_has_no_cuda_provider():
    from specedge.cli.doctor import collect, render

    facts = collect()
    facts["gpus"] = [{"index": 0, "name": "NVIDIA H200", "compute_capability": "9.0", "memory_mib": 143771,
                      "driver": "570.1"}]
    facts["onnxruntime"]["usable"] = {"cpu": True, "cuda": False, "tensorrt": False}
    text = render(facts)
    assert "GPU 0: NVIDIA H200, compute capability 9.0" in text
    assert "hint: a GPU is present but ONNX Runtime has no CUDA provider" in text


# --------------------------------------------------------------------------- the native engine on a simulated TensorRT


class _FakeCudart:
    """cuda-python's runtime calls TensorrtEngine makes, on host memory ("device" pointers are host pointers)."""

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice = 1, 2, 3

    cudaStreamNonBlocking = 1

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}

    def cudaMalloc(self, nbytes):
        """256-byte aligned, as cudaMalloc's blocks are: offsets into them are what can break alignment."""
        buf = np.zeros(max(1, nbytes) + 256, np.uint8)
        ptr = -(-buf.ctypes.data // 256) * 256
        self.buffers[ptr] = buf
        return 0, ptr

    cudaMallocHost = cudaMalloc

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        import ctypes

        for i in range(height):
            ctypes.memmove(int(dst) + i * dpitch, int(src) + i * spitch, width)
        return (0,)

    def cudaFree(self, ptr):
        self.buffers.pop(int(ptr), None)
        return (0,)

    cudaFreeHost = cudaFree

    def cudaMemcpy(self, dst, src, nbytes, kind):
        import ctypes

        ctypes.memmove(int(dst), int(src), nbytes)
        return (0,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        return self.cudaMemcpy(dst, src, nbytes, kind)

    def cudaSetDevice(self, device):
        return (0,)

    def cudaStreamCreateWithFlags(self, flags):
        return 0, 7

    def cudaStreamSynchronize(self, stream):
        return (0,)

    def cudaGetDeviceProperties(self, device):
        import types

        return 0, types.SimpleNamespace(name=b"Fake GPU\x00", major=9, minor=0)


class _FakeContext:
    """IExecutionContext: runs the ONNX graph with ORT CPU on the addresses and shapes it was given."""

    def __init__(self, engine) -> None:
        self.engine, self.profile, self.shapes, self.addresses = engine, 0, {}, {}
        self.profiles_used, self.bound = [], []  # every (name, address) set, in order

    def set_optimization_profile_async(self, index, stream):
        self.profile = index
        self.profiles_used.append(index)
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = int(ptr)
        self.bound.append((name, int(ptr)))
        return True

    def execute_async_v3(self, stream):
        import ctypes

        e = self.engine
        n = self.shapes["input_ids"][1]
        past = self.shapes["past_key.0"][0]
        lo, _, hi = e.get_tensor_profile_shape("input_ids", self.profile)
        plo, _, phi = e.get_tensor_profile_shape("past_key.0", self.profile)
        assert lo[1] <= n <= hi[1] and plo[0] <= past <= phi[0], "shapes outside the active profile"
        binding = e.session.io_binding()
        if e.is_shape_inference_io("num_logits_to_keep"):  # the graph as exported: a host shape tensor
            keep = ctypes.c_int64.from_address(self.addresses["num_logits_to_keep"]).value
            binding.bind_input("num_logits_to_keep", "cpu", 0, np.int64, [1], self.addresses["num_logits_to_keep"])
        else:  # the rewrite: the row count is the tensor's length, its bytes are never read
            (keep,) = self.shapes["num_logits_to_keep"]
            binding.bind_input("num_logits_to_keep", "cpu", 0, np.int64, [keep], self.addresses["num_logits_to_keep"])
        for name in ("input_ids", "position_ids"):
            binding.bind_input(name, "cpu", 0, np.int64, [1, n], self.addresses[name])
        for i in range(e.n_layers):
            for kind in ("key", "value"):
                binding.bind_input(f"past_{kind}.{i}", "cpu", 0, np.float32, [past, *e.kv_shape],
                                   self.addresses[f"past_{kind}.{i}"])
                binding.bind_output(f"new_{kind}.{i}", "cpu", 0, np.float32, [n, *e.kv_shape],
                                    self.addresses[f"new_{kind}.{i}"])
        binding.bind_output("logits", "cpu", 0, np.float32, [1, keep, e.vocab], self.addresses["logits"])
        e.session.run_with_iobinding(binding)
        return True


class _FakeEngine:
    """ICudaEngine over a "plan" that is JSON: the graph to run and the profiles' token/past ranges."""

    def __init__(self, plan: dict) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(plan["graph"], providers=["CPUExecutionProvider"])
        self.ranges = plan["profiles"]
        self.n_layers, self.kv_shape, self.vocab = plan["n_layers"], plan["kv_shape"], plan["vocab"]
        self.rows_from_shape = plan.get("rows_from_shape", False)
        self.names = [t.name for t in self.session.get_inputs() + self.session.get_outputs()]
        self.num_io_tensors = len(self.names)
        self.num_optimization_profiles = len(self.ranges)
        self.contexts = []

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_dtype(self, name):
        return "float32"

    def get_tensor_profile_shape(self, name, index):
        (n_lo, n_hi), (p_lo, p_hi) = self.ranges[index]
        if name == "input_ids":
            return (1, n_lo), (1, n_hi), (1, n_hi)
        return (p_lo, *self.kv_shape), (p_hi, *self.kv_shape), (p_hi, *self.kv_shape)

    def is_shape_inference_io(self, name):
        return name == "num_logits_to_keep" and not self.rows_from_shape

    def create_execution_context(self):
        self.contexts.append(_FakeContext(self))
        return self.contexts[-1]


class _FakeBuilder:
    """trt.Builder and friends: record what build_trt_engine asks for; the "plan" is JSON for _FakeEngine."""

    def __init__(self, logger) -> None:
        pass

    def create_network(self, flags):
        import types

        return types.SimpleNamespace(flags=flags, graph=None, inputs=[])

    def create_builder_config(self):
        import types

        config = types.SimpleNamespace(flags={"TF32"}, profiles=[], workspace=None)  # TensorRT's defaults
        config.set_flag = config.flags.add
        config.clear_flag = config.flags.discard
        config.set_memory_pool_limit = lambda pool, size: setattr(config, "workspace", size)
        config.add_optimization_profile = config.profiles.append
        return config

    def create_optimization_profile(self):
        import types

        profile = types.SimpleNamespace(shapes={}, values={})
        profile.set_shape = lambda name, lo, opt, hi: profile.shapes.__setitem__(name, (lo, opt, hi))
        profile.set_shape_input = lambda name, lo, opt, hi: profile.values.__setitem__(name, (lo, opt, hi))
        return profile

    def build_serialized_network(self, network, config):
        import onnxruntime as ort

        session = ort.InferenceSession(network.graph, providers=["CPUExecutionProvider"])
        shape_tensors = {i.name for i in network.inputs if i.is_shape_tensor}
        dynamic = {i.name for i in session.get_inputs()} - shape_tensors
        ranges = []
        for p in config.profiles:
            assert set(p.shapes) == dynamic, "every dynamic input needs min/opt/max"
            assert set(p.values) == shape_tensors, "a shape-tensor input needs value ranges"
            ranges.append([[p.shapes["input_ids"][0][1], p.shapes["input_ids"][2][1]],
                           [p.shapes["past_key.0"][0][0], p.shapes["past_key.0"][2][0]]])
        past = {i.name: i.shape for i in session.get_inputs()}["past_key.0"]
        # A real plan holds the network; this one keeps a copy of the graph beside it (its weights are there).
        kept = Path(network.graph).with_suffix(".kept.onnx")
        kept.write_bytes(Path(network.graph).read_bytes())
        plan = {"graph": str(kept), "profiles": ranges, "flags": sorted(config.flags),
                "rows_from_shape": not shape_tensors,
                "strongly_typed": bool(network.flags), "kv_shape": past[1:],
                "n_layers": sum(i.name.startswith("past_key.") for i in session.get_inputs()),
                "vocab": session.get_outputs()[0].shape[2]}
        return json.dumps(plan).encode()


class _FakeParser:
    num_errors = 0

    def __init__(self, network, logger) -> None:
        self.network = network

    def parse_from_file(self, path):
        import types

        import onnxruntime as ort

        self.network.graph = path
        inputs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).get_inputs()
        names = [i.name for i in inputs]
        # TensorRT makes an int64 [1] input whose value shapes a tensor a shape tensor (the graph as exported).
        self.network.inputs = [types.SimpleNamespace(name=i.name, is_shape_tensor=i.name == "num_logits_to_keep"
                                                     and i.shape == [1]) for i in inputs]
        self.network.num_inputs = len(names)
        self.network.get_input = self.network.inputs.__getitem__
        return True


def _fake_tensorrt(monkeypatch) -> _FakeCudart:
    import types

    cudart = _FakeCudart()
    trt = types.SimpleNamespace(
        __version__="10.3.0", nptype=np.dtype, Builder=_FakeBuilder, OnnxParser=_FakeParser,
        NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=0),
        BuilderFlag=types.SimpleNamespace(FP16="FP16", INT8="INT8", TF32="TF32"),
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="WORKSPACE"),
        Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
        Runtime=type("Runtime", (), {"__init__": lambda self, logger: None,
                                     "deserialize_cuda_engine": lambda self, data: _FakeEngine(json.loads(data))}))
    bindings = types.SimpleNamespace(runtime=cudart)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "cuda", types.SimpleNamespace(bindings=bindings))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    return cudart


@pytest.fixture(scope="module")
def standard_bundle(tiny_model, export):
    return export(tiny_model("llama"), attention="standard")


def test_native_engine_binds_profiles_chunks_and_cache_like_the_cpu_engine(standard_bundle, monkeypatch, tmp_path):
    """TensorrtEngine's own logic (profile choice, chunking, addresses, shape-tensor host input, logits rows),
    with ORT CPU standing in for TensorRT and host memory for the device."""
    from specedge.engines.ort import OrtEngine
    from specedge.engines.tensorrt import TensorrtEngine

    _fake_tensorrt(monkeypatch)
    entry = load_manifest(standard_bundle, verify_checksums=False).target
    plan = tmp_path / "model.plan"
    plan.write_text(json.dumps({"graph": str(standard_bundle / entry.graph), "n_layers": entry.n_layers,
                                "kv_shape": [entry.n_kv_heads, entry.head_dim], "vocab": entry.vocab_size,
                                "profiles": [[[1, 9], [0, entry.max_context - 1]],  # step
                                             [[1, 16], [0, entry.max_context - 1]]]}))  # prefill
    native = TensorrtEngine(entry, plan, EngineOptions())
    cpu = OrtEngine(entry, standard_bundle / entry.graph, EngineOptions(intra_op_threads=1))
    assert native.max_tokens == 16
    assert _greedy(native) == _greedy(cpu)  # a 20-token prompt: chunks of 16 + 4 on the prefill profile
    context = native.engine.contexts[0]
    assert context.profiles_used[:2] == [1, 0]  # prefill chunks, then decode steps on the step profile

    kv, cpu_kv = native.new_cache(), cpu.new_cache()
    ids = np.asarray(PROMPT_IDS, np.int64)
    got = native.forward(ids, kv, num_logits=12).copy()  # chunks 8 + 12; more rows than a verify: buffers grow
    np.testing.assert_allclose(got, cpu.forward(ids, cpu_kv, num_logits=12), rtol=1e-4, atol=1e-5)
    native.forward(np.array([7, 8, 9]), kv, num_logits=3)
    kv.rewind(3)
    after = native.forward(np.array([10, 11]), kv, num_logits=2).copy()
    np.testing.assert_allclose(after, cpu.forward(np.array([10, 11]), cpu_kv, num_logits=2), rtol=1e-4, atol=1e-5)
    for layer in range(entry.n_layers):
        k, v = kv.to_host(layer)
        np.testing.assert_allclose(k, cpu_kv.keys[layer][:kv.length], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v, cpu_kv.values[layer][:kv.length], rtol=1e-4, atol=1e-5)


def test_native_engine_refuses_a_gqa_graph(monkeypatch, tmp_path):
    from specedge.engines.tensorrt import TensorrtEngine

    _fake_tensorrt(monkeypatch)
    with pytest.raises(InvalidParameterError, match="GroupQueryAttention, which TensorRT cannot parse"):
        TensorrtEngine(replace(_entry(), attention="gqa"), tmp_path / "x.plan")


def test_native_engine_checks_the_record_before_loading(monkeypatch, tmp_path):
    import specedge.engines.tensorrt as trt_engine

    _fake_tensorrt(monkeypatch)
    monkeypatch.setattr(trt_engine, "runtime_facts", lambda device_id=0: replace(FACTS, gpu_name="NVIDIA L4"))
    with pytest.raises(BackendUnavailableError, match="built for GPU NVIDIA H200 but this machine has GPU NVIDIA L4"):
        trt_engine.TensorrtEngine(_entry(), tmp_path / "missing.plan", record=_record(), role="target")


def test_native_route_builds_records_and_loads_through_the_registry(standard_bundle, monkeypatch, tmp_path):
    """build_engines_for_bundle end to end on the simulated TensorRT: plan, record, manifest, backend."""
    import shutil

    from specedge.engines.ort import OrtEngine

    _fake_tensorrt(monkeypatch)
    bundle = shutil.copytree(standard_bundle, tmp_path / "bundle")
    manifest = build_engines_for_bundle(bundle, precision="fp32", route="native", max_prompt=16, quiet=True)
    record = manifest.extra.engines["target"]
    assert (record.route, record.gpu_name, record.compute_capability, record.tensorrt_version) == \
        ("native", "Fake GPU", "9.0", "10.3.0")
    assert [p.name for p in record.profiles] == ["step", "prefill"]
    assert record.file in load_manifest(bundle).files  # listed, and its checksum holds
    plan = json.loads((bundle / record.file).read_text())
    assert plan["strongly_typed"] and "TF32" not in plan["flags"]  # fp32 graph at fp32: exact types, no TF32
    assert plan["profiles"] == [[[1, 9], [0, 255]], [[1, 16], [0, 255]]]

    entry = manifest.target
    engine = create_engine(entry, bundle / entry.graph, EngineOptions(provider="cuda"), backend="tensorrt")
    cpu = OrtEngine(entry, bundle / entry.graph, EngineOptions(intra_op_threads=1))
    assert _greedy(engine) == _greedy(cpu)

    rebuilt = build_engines_for_bundle(bundle, precision="fp16", route="native", max_prompt=16, quiet=True)
    new = rebuilt.extra.engines["target"]
    assert new.cache_key != record.cache_key
    assert not (bundle / record.file).exists() and record.file not in load_manifest(bundle).files
    new_plan = json.loads((bundle / new.file).read_text())
    assert not new_plan["strongly_typed"] and "FP16" in new_plan["flags"]  # fp16 kernels for an fp32 graph
