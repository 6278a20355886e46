"""TensorRT engines for a bundle: optimization profiles, EP options, cache keys, builders.

A speculative loop calls each model with a few distinct shapes: a prompt
(n up to the prompt limit, past 0), and decode / draft / verify steps (n from 1
to k+1, past anywhere in the context). TensorRT tunes kernels per optimization
profile, so :func:`verify_profiles` gives the decode/verify path its own
profile, tuned for n = k+1, and prefill another.

Two routes build an engine (``build_engines_for_bundle``, called by
``specedge export --engine tensorrt``):

* ``ort-trt``: ONNX Runtime's TensorRT EP with explicit profiles and its engine
  cache pointed into the bundle. ORT parses several profiles but its execution
  context stays on profile 0 (onnxruntime PR #31624 adds switching; open as of
  2026-09), so this route merges the profiles into one, still tuned for k+1.
* ``native``: the TensorRT Python API builds a plan with both profiles and
  engines/tensorrt.py selects one per call.

The functions that compute shapes, option strings, keys and paths are pure and
tested on CPU. The builders need a GPU and are not verified on hardware here.
What a bundle records about each engine is an :class:`EngineRecord` under
manifest ``extra["engines"][role]`` (defined in bundle/extra.py, which
reads it at load time, and re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

import numpy as np

from ..bundle.extra import ROUTES, TRT_PRECISIONS, EngineRecord, Profile, ShapeRange
from ..engines.tensorrt import (check_engine_compatible, check_ort_trt_tensorrt, check_tensorrt_graph, import_cudart, import_tensorrt,
                                major_minor_patch, runtime_facts, tensorrt_graph_problem, tensorrt_version)
from ..errors import BackendUnavailableError, ExportError, InvalidParameterError
from .trt_graph import logits_rows_from_shape, trt_graph_path
from ..bundle.manifest import (FileRecord, Manifest, ModelEntry, file_record, load_manifest, resolve_inside, sha256_file,
                        write_manifest)

# Longer prompts are prefilled in chunks of this many tokens, which is exact (the graph takes any
# past length). A larger limit buys little prefill speed and costs activation memory and build time.
DEFAULT_MAX_PROMPT = 512
ENGINES = ("onnxruntime", "tensorrt")  # choices for `specedge export --engine`
# What `specedge export --engine tensorrt` builds: TensorRT int8 needs Q/DQ nodes or a calibration
# table, and specedge graphs carry neither (their int8/int4 is weight-only MatMulNBits).
BUILD_PRECISIONS = ("fp32", "fp16")
_GRAPH_PRECISION = {"float32": "fp32", "float16": "fp16"}

__all__ = ["BUILD_PRECISIONS", "DEFAULT_MAX_PROMPT", "ENGINES", "EnginePaths", "EngineRecord", "Profile", "ShapeRange",
           "build_engines_for_bundle", "build_trt_engine", "check_engine_compatible", "check_tensorrt_export",
           "engine_cache_key", "engine_paths", "merge_profiles", "ort_trt_provider_options", "profile_shape_strings",
           "verify_profiles"]


# --------------------------------------------------------------------------- profiles


def verify_profiles(entry: ModelEntry, max_draft_tokens: int, max_prompt: int, *,
                    draft_tokens: int | None = None, logits_rows_from_shape: bool = True) -> tuple[Profile, ...]:
    """Optimization profiles covering every forward the loop makes on ``entry``.

    ``step``: n in [1, max_draft_tokens + 1], tuned for n = draft_tokens + 1 (a verify;
    decode and draft steps are n = 1); past length in [0, max_context - 1].
    ``prefill``: n in [1, max_prompt], past in [0, max_context - 1], tuned for past 0
    (a prompt; also a draft catching up after plain steps, or one chunk of a long prompt).
    Only ``step`` when max_prompt fits in it. ``num_logits_to_keep`` gets a dims range
    in the rewritten graph (``logits_rows_from_shape``: its length is the row count;
    export/trt_graph.py), or a *values* range in the graph as exported, where TensorRT
    treats it as a shape tensor.
    """
    check_tensorrt_graph(entry)  # the shapes below are the standard graph's inputs
    io, ctx = entry.io, entry.max_context
    if not 1 <= max_draft_tokens <= ctx - 1:
        raise InvalidParameterError(f"max_draft_tokens must be in [1, max_context - 1 = {ctx - 1}]; "
                                    f"got {max_draft_tokens}")
    if not 1 <= max_prompt <= ctx - 1:
        raise InvalidParameterError(f"max_prompt must be in [1, max_context - 1 = {ctx - 1}]; got {max_prompt}")
    k = min(4, max_draft_tokens) if draft_tokens is None else draft_tokens
    if not 0 <= k <= max_draft_tokens:
        raise InvalidParameterError(f"draft_tokens must be in [0, max_draft_tokens={max_draft_tokens}]; got {k}")

    def profile(name: str, n: tuple[int, int, int], past_opt: int, keep_opt: int) -> Profile:
        tokens = ShapeRange((1, n[0]), (1, n[1]), (1, n[2]))
        # The middle of the context for steps: TRT tunes the attention kernels for opt, and the
        # weight-bound GEMMs that dominate a step do not depend on the past length at all.
        past = ShapeRange((0, entry.n_kv_heads, entry.head_dim), (past_opt, entry.n_kv_heads, entry.head_dim),
                          (ctx - 1, entry.n_kv_heads, entry.head_dim))
        shapes = {io.input_ids: tokens, io.positions: tokens}
        for i in range(entry.n_layers):
            shapes[io.past_key % i] = past
            shapes[io.past_value % i] = past
        keep = ShapeRange((1,), (keep_opt,), (n[2],))
        if logits_rows_from_shape:
            return Profile(name, {**shapes, io.num_logits: keep})
        return Profile(name, shapes, {io.num_logits: keep})

    step_max = max_draft_tokens + 1
    step = profile("step", (1, k + 1, step_max), ctx // 2, k + 1)
    if max_prompt <= step_max:
        return (step,)
    # Tuned for half the prompt limit: both ends stay within a small factor of the tuned shape.
    return step, profile("prefill", (1, max(1, max_prompt // 2), max_prompt), 0, 1)


def merge_profiles(profiles: tuple[Profile, ...] | list[Profile]) -> Profile:
    """One profile spanning all of them, tuned where the first (the step profile) is."""
    first = profiles[0]

    def union(name: str, kind: str) -> ShapeRange:
        ranges = [getattr(p, kind)[name] for p in profiles]
        return ShapeRange(tuple(min(d) for d in zip(*(r.min for r in ranges))), getattr(first, kind)[name].opt,
                          tuple(max(d) for d in zip(*(r.max for r in ranges))))

    return Profile("merged", {name: union(name, "shapes") for name in first.shapes},
                   {name: union(name, "values") for name in first.values})


def profile_shape_strings(profiles: tuple[Profile, ...] | list[Profile]) -> dict[str, str]:
    """ORT's ``trt_profile_{min,opt,max}_shapes`` strings: ``name:d0xd1,name:d0xd1``.

    Shape tensors list their values in place of dims (ORT's TensorRT EP reads them so).
    Several profiles repeat each name, one entry per profile, in profile order.
    """
    out = {}
    for key in ("min", "opt", "max"):
        entries = []
        for p in profiles:
            for name, r in {**p.shapes, **p.values}.items():
                entries.append(f"{name}:{'x'.join(str(d) for d in getattr(r, key))}")
        out[f"trt_profile_{key}_shapes"] = ",".join(entries)
    return out


def ort_trt_provider_options(profiles: tuple[Profile, ...] | list[Profile], *, cache_dir: str, cache_prefix: str,
                             precision: str = "fp16", workspace_bytes: int | None = None,
                             multi_profile: bool = False) -> dict[str, str]:
    """Options for ORT's TensorrtExecutionProvider (strings; ORT's Python binding wants "True"/"False").

    ``cache_dir`` holds the EP's engine and timing caches; ``cache_prefix`` names the engine
    files, so a bundle can tell its engine from others. Unless ``multi_profile``, the
    profiles are merged into one (ORT's TensorRT EP runs profile 0 only; see module doc).
    device_id and the CUDA stream are per machine and added when a session is created.
    """
    if precision not in TRT_PRECISIONS:
        raise InvalidParameterError(f"precision must be one of {', '.join(TRT_PRECISIONS)}; got {precision!r}")
    used = list(profiles) if multi_profile else [merge_profiles(profiles)]
    flag = {True: "True", False: "False"}
    options = {
        "trt_fp16_enable": flag[precision in ("fp16", "int8")],  # int8 layers without Q/DQ fall back to fp16
        "trt_int8_enable": flag[precision == "int8"],
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": cache_dir,
        "trt_engine_cache_prefix": cache_prefix,
        "trt_timing_cache_enable": "True",  # kernel timings: a rebuild on the same GPU takes seconds
        "trt_timing_cache_path": cache_dir,
        **profile_shape_strings(used),
    }
    if workspace_bytes:
        options["trt_max_workspace_size"] = str(int(workspace_bytes))
    return options


# --------------------------------------------------------------------------- keys and paths


def engine_cache_key(graph_sha256: str, profiles: tuple[Profile, ...] | list[Profile], precision: str,
                     tensorrt_version: str, compute_capability: str, route: str = "native") -> str:
    """16 hex digits naming one build: the same graph, shapes, precision, TensorRT and GPU give the same key."""
    facts = {"graph": graph_sha256, "profiles": [p.to_dict() for p in profiles], "precision": precision,
             "tensorrt": major_minor_patch(tensorrt_version), "compute_capability": compute_capability, "route": route}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EnginePaths:
    """Bundle-relative POSIX paths, next to the model's graph."""

    plan: str  # the native route's serialized engine
    ort_cache_dir: str  # the ort-trt route's engine and timing cache folder


def engine_paths(graph: str, cache_key: str) -> EnginePaths:
    folder = PurePosixPath(graph).parent
    return EnginePaths(plan=str(folder / "trt" / f"{cache_key}.plan"), ort_cache_dir=str(folder / "trt-ort"))


# --------------------------------------------------------------------------- builders


def tensorrt_major(trt) -> int:
    return int(str(trt.__version__).split(".")[0])


def build_trt_engine(onnx_path: Path, out_path: Path, profiles: tuple[Profile, ...] | list[Profile],
                     precision: str = "fp16", *, graph_dtype: str = "float32",
                     workspace_bytes: int | None = None) -> Path:
    """Build a TensorRT plan from an ONNX graph with the TensorRT Python API; write it to ``out_path``.

    When the engine precision is the graph's own, the network is strongly typed so
    TensorRT keeps the graph's fp32 islands (RMSNorm, softmax) in fp16 graphs. An fp32
    graph built at fp16 needs weak typing (BuilderFlag.FP16), which TensorRT 10 has and
    TensorRT 11 dropped (every network is strongly typed there, and has no
    ``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` to ask for it): on 11 that build
    is refused before any work, naming the fix (export the bundle at fp16).
    """
    if precision not in TRT_PRECISIONS:
        raise InvalidParameterError(f"precision must be one of {', '.join(TRT_PRECISIONS)}; got {precision!r}")
    trt = import_tensorrt()
    weak = precision != _GRAPH_PRECISION.get(graph_dtype)
    major = tensorrt_major(trt)
    missing = [name for name in {"fp16": ["FP16"], "int8": ["INT8", "FP16"]}.get(precision, [])
               if getattr(trt.BuilderFlag, name, None) is None]
    if weak and (major >= 11 or missing):
        raise InvalidParameterError(f"TensorRT {trt.__version__} builds only strongly typed networks, so an "
                                    f"{graph_dtype} graph cannot become a {precision} engine; export the bundle "
                                    f"with --precision {precision}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    # TensorRT 10: ask for strong typing when the graph's own precision is wanted. 11: it is the only mode.
    flags = 1 << int(strongly_typed) if not weak and strongly_typed is not None and major < 11 else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads external data next to the graph
        errors = "; ".join(str(parser.get_error(i)) for i in range(min(parser.num_errors, 3)))
        raise ExportError(f"TensorRT's ONNX parser rejected {Path(onnx_path).name}: {errors}")
    config = builder.create_builder_config()
    if weak:
        for name in ({"fp16": ["FP16"], "int8": ["INT8", "FP16"]}.get(precision, [])):
            config.set_flag(getattr(trt.BuilderFlag, name))
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if precision == "fp32" and tf32 is not None:
        config.clear_flag(tf32)  # fp32 means fp32: TF32's 10-bit mantissa flips greedy near-ties
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    shape_inputs = {network.get_input(i).name for i in range(network.num_inputs)
                    if network.get_input(i).is_shape_tensor}
    for p in profiles:
        profile = builder.create_optimization_profile()
        for name, r in p.shapes.items():
            profile.set_shape(name, r.min, r.opt, r.max)
        for name, r in p.values.items():
            if name in shape_inputs:
                profile.set_shape_input(name, r.min, r.opt, r.max)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ExportError(f"TensorRT could not build an engine for {Path(onnx_path).name} (see its log above)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    partial.write_bytes(memoryview(plan))
    os.replace(partial, out_path)
    return out_path


def _build_ort_trt(bundle: Path, entry: ModelEntry, graph: str, profiles: tuple[Profile, ...], precision: str,
                   key: str, paths: EnginePaths, facts, device_id: int, workspace_bytes: int | None) -> EngineRecord:
    """Let ORT's TensorRT EP build and cache its engine inside the bundle by running ``graph`` once."""
    import onnxruntime as ort

    from ..engines.base import EngineOptions
    from ..engines.ort_cuda import OrtCudaEngine, resolve_provider_options

    merged = merge_profiles(profiles)
    cache_dir = bundle / paths.ort_cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    options = ort_trt_provider_options([merged], cache_dir=paths.ort_cache_dir, cache_prefix=key,
                                       precision=precision, workspace_bytes=workspace_bytes)
    engine = OrtCudaEngine(entry, resolve_inside(bundle, graph), EngineOptions(provider="tensorrt", device_id=device_id),
                           resolve_provider_options(options, bundle), max_tokens=merged.new_tokens(entry.io)[1],
                           logits_rows_from_shape=True)
    engine.forward(np.zeros(1, np.int64), engine.new_cache(), 1)  # the EP builds and caches its engine on first run
    del engine
    built = sorted(cache_dir.glob(f"{key}*.engine"))
    if len(built) != 1:  # one merged profile, one engine: anything else and the record could name the wrong one
        raise ExportError(f"ONNX Runtime's TensorRT EP wrote {len(built)} engine files for key {key} in "
                          f"{paths.ort_cache_dir} (expected 1): {[p.name for p in built]}")
    return EngineRecord(route="ort-trt", tensorrt_version=facts.tensorrt_version or "", gpu_name=facts.gpu_name,
                        compute_capability=facts.compute_capability, precision=precision, profiles=(merged,),
                        file=paths.ort_cache_dir, sha256=sha256_file(built[0]), cache_key=key,
                        provider_options=options, onnxruntime_version=ort.__version__,
                        engine_file=str(PurePosixPath(paths.ort_cache_dir) / built[0].name), graph=graph)


def _drop_stale(bundle: Path, files: dict[str, FileRecord], old: EngineRecord | None, new: EngineRecord) -> None:
    """Remove the files of the engine a rebuild replaces, and their manifest entries."""
    if old is None or old.cache_key == new.cache_key:
        return
    if old.route == "native":
        files.pop(old.file, None)
        (bundle / old.file).unlink(missing_ok=True)
    else:
        for path in (bundle / old.file).glob(f"{old.cache_key}*"):
            path.unlink()
    if old.graph and old.graph != new.graph:
        files.pop(old.graph, None)
        (bundle / old.graph).unlink(missing_ok=True)


def check_tensorrt_export(attention: str, precision: str, draft: str | None = None,
                          draft_precision: str | None = None) -> None:
    """Refuse export options whose bundle TensorRT could not take, before minutes of export.

    Mirrors what build_engines_for_bundle checks on the written bundle. (GPT-2 always
    gets the standard graph, so for it ``attention`` is moot; pass "standard".)
    """
    models = [("target", precision)]
    if draft is not None:
        models.append(("draft", draft.removeprefix("self-") if draft.startswith("self-") else
                       draft_precision or precision))
    for role, model_precision in models:
        problem = tensorrt_graph_problem(attention, model_precision, role)
        if problem:
            raise InvalidParameterError(problem)


def build_engines_for_bundle(bundle_path: str | os.PathLike[str], precision: str = "fp16", route: str = "ort-trt",
                             *, max_prompt: int | None = None, device_id: int = 0,
                             workspace_bytes: int | None = None, quiet: bool = False) -> Manifest:
    """Build a TensorRT engine for every model of a written bundle; return the updated manifest.

    Engines land next to each graph (``target/trt/<key>.plan`` or ``target/trt-ort/``);
    their records go to manifest ``extra["engines"][role]``, and a native plan is
    also listed in ``files`` so the bundle's checksum check covers it.
    ``max_prompt``: the prefill profile's largest n (default min(max_context - 1, 512)).
    Everything is checked before a GPU does any work.
    """
    bundle = Path(bundle_path)
    if route not in ROUTES:
        raise InvalidParameterError(f"route must be one of {', '.join(ROUTES)}; got {route!r}")
    if precision not in BUILD_PRECISIONS:
        raise InvalidParameterError(f"engine precision must be {' or '.join(BUILD_PRECISIONS)}; got {precision!r} "
                                    "(TensorRT int8 "
                                    "needs Q/DQ nodes or a calibration table, and specedge graphs carry neither: "
                                    "their int8/int4 is weight-only MatMulNBits)")
    manifest = load_manifest(bundle)  # with checksums: an engine built from a corrupt graph would be trusted later
    for role, entry in manifest.models().items():
        check_tensorrt_graph(entry, role)
    if route == "native":
        import_tensorrt()
        import_cudart()
    else:
        from ..engines.ort import check_provider

        check_provider("tensorrt")
        check_ort_trt_tensorrt(tensorrt_version())
    facts = runtime_facts(device_id)
    if facts.gpu_name is None or facts.compute_capability is None:
        raise BackendUnavailableError(f"no NVIDIA GPU {device_id} is visible (neither cuda-python nor nvidia-smi "
                                      "reports one): TensorRT engines are built on the GPU that will run them")

    spec = manifest.speculation
    files = dict(manifest.files)
    engines = dict(manifest.extra.engines)
    for role, entry in manifest.models().items():
        limit = max_prompt or min(entry.max_context - 1, DEFAULT_MAX_PROMPT)
        profiles = verify_profiles(entry, spec.max_draft_tokens, limit, draft_tokens=spec.draft_tokens)
        key = engine_cache_key(files[entry.graph].sha256, profiles, precision, facts.tensorrt_version or "",
                               facts.compute_capability, route)
        paths = engine_paths(entry.graph, key)
        if not quiet:
            print(f"[tensorrt] building the {role} engine ({route}, {precision}, profiles "
                  f"{', '.join(p.name for p in profiles)}) on {facts.gpu_name}", file=sys.stderr, flush=True)
        # The engines take the logits row count from a shape, so nothing is read back per run (trt_graph.py).
        source = resolve_inside(bundle, entry.graph)
        rewritten = logits_rows_from_shape(source, trt_graph_path(source), entry.io.num_logits)
        rewritten_rel = str(PurePosixPath(entry.graph).parent / rewritten.name)
        if route == "native":
            try:
                plan = build_trt_engine(rewritten, bundle / paths.plan, profiles, precision,
                                        graph_dtype=entry.kv_dtype, workspace_bytes=workspace_bytes)
            finally:
                rewritten.unlink(missing_ok=True)  # the plan holds what it needs
            files[paths.plan] = file_record(plan)
            record = EngineRecord(route="native", tensorrt_version=facts.tensorrt_version or "",
                                  gpu_name=facts.gpu_name, compute_capability=facts.compute_capability,
                                  precision=precision, profiles=profiles, file=paths.plan,
                                  sha256=files[paths.plan].sha256, cache_key=key)
        else:
            files[rewritten_rel] = file_record(rewritten)  # the EP session loads it: checksummed with the rest
            record = _build_ort_trt(bundle, entry, rewritten_rel, profiles, precision, key, paths, facts,
                                    device_id, workspace_bytes)
        _drop_stale(bundle, files, engines.get(role), record)
        engines[role] = record

    updated = replace(manifest, files=files, extra=replace(manifest.extra, engines=engines))
    scratch = bundle / f".manifest-{os.getpid()}"  # write beside, then rename: a crash never leaves half a manifest
    scratch.mkdir(exist_ok=True)
    try:
        os.replace(write_manifest(scratch, updated), bundle / "manifest.json")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return updated
