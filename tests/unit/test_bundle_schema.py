"""Invariant: the bundle is one typed schema.

- Every part of a manifest's ``extra`` has one parser: ``from_dict(to_dict(x)) == x``, and each
  malformed or unknown field is a ManifestError (a BundleError) naming the field.
- Manifests as earlier versions wrote them (format 1 and 2, older extras) still load.

Standard library only (the graph side of the schema, ModelIO, is tests/integration/test_graph_io.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from specedge.bundle.extra import (BlockCandidate, ComparisonRecord, CostProfile, EngineRecord, ExactSteps,
                                   MachineFingerprint, ManifestExtra, Profile, QualityRecord, QualityScore,
                                   QuantTuning, ShapeRange, ValidationRecord)
from specedge.errors import BundleError, ManifestError, UnsafePathError
from specedge.bundle.manifest import FORMAT_VERSION, LEGACY_FORMAT_NOTES, Manifest, parse_manifest
from tiny_models import manifest_json

MACHINE = MachineFingerprint(cpu="AMD EPYC 7B13", cores=2, threads=1, isa="avx2,avx512f,avx512_vnni")
PROFILE = CostProfile(machine=MACHINE, target_s={1: 0.01, 2: 0.012, 3: 0.014}, context=128, draft_token_s=0.002,
                      draft_catchup_token_s=0.0007)
SHAPES = {"input_ids": ShapeRange((1, 1), (1, 5), (1, 9)), "past_key.0": ShapeRange((0, 2, 8), (64, 2, 8), (96, 2, 8))}
ENGINE = EngineRecord(route="native", tensorrt_version="10.3.0", gpu_name="NVIDIA H200", compute_capability="9.0",
                      precision="fp16", profiles=(Profile("step", SHAPES, {"num_logits_to_keep": ShapeRange((1,), (5,),
                                                                                                            (9,))}),),
                      file="target/model.plan", sha256="ab" * 32, cache_key="k")
TUNING = QuantTuning(machine=MACHINE, candidates=(BlockCandidate(32, 67.1, 112.0, 0.979, True),
                                                  BlockCandidate(128, 55.2, 98.4, 0.986, False)),
                      chosen=128, positions=144, context=256)
# A tuning stopped (Ctrl-C) after two blocks, the coarser timed beside the finest (export/tune.py).
STOPPED_TUNING = QuantTuning(machine=MACHINE, candidates=(BlockCandidate(32, 67.1, 112.0, 0.979, True),
                                                          BlockCandidate(64, 60.0, 101.0, 0.981, True, 66.4)),
                             chosen=64, positions=144, context=256, step_rows=1, stopped=True)
QUALITY = QualityRecord(chunk=512, max_tokens=96, source="gguf:model.Q4_K_M.gguf",
                        kinds={"prose": QualityScore(95, 12.5, 9.3, 0.845, 0.21),  # a KL (recorded since 2026-12-07)
                               "code": QualityScore(95, 3.1, 2.9, 0.93)},  # and none (a manifest from before)
                        overall=QualityScore(190, 6.2, 5.2, 0.8875))
EXTRA = ManifestExtra(
    validation={"target:fp32": ValidationRecord({"prefill": 1e-5, "verify across edge 32": 2e-5}, 0.01, 1.0),
                "draft:int4-vs-fp32": ComparisonRecord(top1_agreement=0.9, max_abs_diff=0.3)},
    batch_variance={"target": 1e-5, "draft": 0.0},
    exact_steps={"target": ExactSteps(bit_identical=True, two_row_step_cost=1.05, one_row_step_ms=3.2)},
    context_warnings={"target": "max_context 4096 is past the 2048 positions it was trained on"},
    unknown_config_fields={"target": ("made_up_feature",)},
    export_seconds=12.5, cost_profile=PROFILE, engines={"target": ENGINE}, quant_tuning={"target": TUNING},
    quality=QUALITY)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("value", [MACHINE, PROFILE, replace(PROFILE, draft_token_s=None, draft_catchup_token_s=None),
                                   EXTRA.validation["target:fp32"], EXTRA.validation["draft:int4-vs-fp32"],
                                   EXTRA.exact_steps["target"], SHAPES["input_ids"], ENGINE.profiles[0], ENGINE,
                                   TUNING, TUNING.candidates[0], STOPPED_TUNING, STOPPED_TUNING.candidates[1],
                                   QUALITY, QUALITY.overall,
                                   QualityRecord(chunk=16, kinds={"a.txt": QualityScore(15, 7.0)},
                                                 overall=QualityScore(15, 7.0)),
                                   EXTRA, ManifestExtra()],
                         ids=lambda v: type(v).__name__)
def test_every_record_round_trips_through_json(value):
    parse = type(value).from_dict
    decoded = json.loads(json.dumps(value.to_dict()))
    assert (parse(decoded, "x") if type(value) is not ManifestExtra else parse(decoded)) == value


def test_a_manifest_built_with_a_dict_extra_parses_it_once():
    """Manifest(extra={...}) goes through ManifestExtra.from_dict: the same object, the same checks."""
    manifest = _manifest(extra=EXTRA.to_dict())
    assert manifest.extra == EXTRA
    with pytest.raises(ManifestError, match=r"'extra.timings' is not part of the schema"):
        _manifest(extra={"timings": {}})


def test_the_profile_summary_reads_the_typed_profile():
    from specedge.runtime.profile import summary

    s = summary(PROFILE)
    assert s["target_step_ms"] == pytest.approx(10.0) and s["c"] == pytest.approx(0.2)
    assert s["v"] == {1: 1.0, 2: pytest.approx(1.2), 3: pytest.approx(1.4)}


def test_the_cost_model_starts_from_the_typed_profile():
    from specedge.runtime.costs import CostModel

    model = CostModel.from_profile(PROFILE)
    assert model.target_s == PROFILE.target_s and model.draft_token_s == PROFILE.draft_token_s
    assert CostModel.from_profile(PROFILE, uses_draft_model=False).draft_token_s == 0.0


# --------------------------------------------------------------------------- malformed fields


def _edit(path: str, value=None, *, delete: bool = False) -> dict:
    """EXTRA as JSON with the dotted ``path`` set to ``value`` (or deleted)."""
    obj = copy.deepcopy(EXTRA.to_dict())
    node = obj
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if delete:
        del node[last]
    else:
        node[last] = value
    return obj


MALFORMED = [
    ("nonsense", 1, r"'extra.nonsense' is not part of the schema"),
    ("validation", [], r"'extra.validation' must be dict"),
    ("validation.target:fp32.tolerance", "tight", r"'extra.validation.target:fp32.tolerance' must be int or float"),
    ("validation.target:fp32.max_abs_diff.prefill", "small", r"'extra.validation.target:fp32.max_abs_diff.prefill' "
                                                             r"must be a number"),
    ("validation.target:fp32.top1_agreement", 1.5, r"'extra.validation.target:fp32.top1_agreement' must be a "
                                                   r"fraction"),
    ("validation.target:fp32.seed", 0, r"'extra.validation.target:fp32.seed' is not part of the schema"),
    ("validation.draft:int4-vs-fp32.max_abs_diff", None, r"'extra.validation.draft:int4-vs-fp32.max_abs_diff' "
                                                         r"must be int or float"),
    ("batch_variance", [1, 2], r"'extra.batch_variance' must be an object"),
    ("batch_variance.target", -1.0, r"'extra.batch_variance.target' must be a finite number >= 0"),
    ("batch_variance.verifier", 0.1, r"'extra.batch_variance' has key 'verifier'; keys are model roles"),
    ("exact_steps.target.bit_identical", "yes", r"'extra.exact_steps.target.bit_identical' must be bool"),
    ("exact_steps.target.two_row_step_cost", float("inf"), r"'extra.exact_steps.target.two_row_step_cost' must be "
                                                           r"a finite number"),
    ("context_warnings.target", 3, r"'extra.context_warnings.target' must be str"),
    ("unknown_config_fields.target", "made_up_feature", r"'extra.unknown_config_fields.target' must be list"),
    ("unknown_config_fields.target", [1], r"'extra.unknown_config_fields.target\[0\]' must be str"),
    ("export_seconds", "12s", r"'extra.export_seconds' must be int or float"),
    ("export_seconds", -1, r"'extra.export_seconds' must be a finite number >= 0"),
    ("cost_profile", "fast", r"'extra.cost_profile' must be an object"),
    ("cost_profile.machine", None, r"'extra.cost_profile.machine' must be dict"),
    ("cost_profile.machine.cores", "2", r"'extra.cost_profile.machine.cores' must be int"),
    ("cost_profile.machine.threads", -1, r"'extra.cost_profile.machine.threads' must be >= 0"),
    ("cost_profile.machine.gpu", "x", r"'extra.cost_profile.machine.gpu' is not part of the schema"),
    ("cost_profile.machine.isa", ["avx2"], r"'extra.cost_profile.machine.isa' must be str"),
    ("cost_profile.target_s.66", 0.1, r"'extra.cost_profile.target_s' has key '66'; keys are verify lengths "
                                      r"'1'..'65'"),
    ("cost_profile.target_s.2", 0, r"'extra.cost_profile.target_s.2' must be a finite number > 0"),
    ("cost_profile.draft_token_s", [0], r"'extra.cost_profile.draft_token_s' must be a finite number > 0"),
    ("cost_profile.context", True, r"'extra.cost_profile.context' must be an integer"),
    ("cost_profile.context", -5, r"'extra.cost_profile.context' must be >= 0"),
    ("cost_profile.notes", "", r"'extra.cost_profile.notes' is not part of the schema"),
    ("engines", [], r"'extra.engines' must be an object keyed by model role"),
    ("engines.target.route", "onnx", r"'extra.engines.target': engine route must be one of"),
    ("engines.target.file", "../x.plan", r"'extra.engines.target.file' \('../x.plan'\) contains '..'"),
    ("engines.target.profiles", [], r"at least one optimization profile"),
    ("engines.target.profiles.0.shapes.input_ids.min", [1, 10], r"min <= opt <= max"),
    ("engines.target.profiles.0.shapes.input_ids.max", [1, True], r"'extra.engines.target.profiles\[0\]"
                                                                  r".shapes.input_ids.max' must be a list of "
                                                                  r"integers"),
    ("engines.target.profiles.0.tactics", [], r"'extra.engines.target.profiles\[0\].tactics' is not part of"),
    ("engines.target.provider_options", {"trt_fp16_enable": True}, r"must map names to strings"),
    ("engines.target.builder", "me", r"'extra.engines.target.builder' is not part of the schema"),
    ("quant_tuning", [], r"'extra.quant_tuning' must be an object keyed by model role"),
    ("quant_tuning.verifier", {}, r"'extra.quant_tuning' has key 'verifier'; keys are model roles"),
    ("quant_tuning.target.chosen", 64, r"'extra.quant_tuning.target.chosen' is 64, which is not among the measured "
                                       r"block sizes \[32, 128\]"),
    ("quant_tuning.target.candidates", [], r"'extra.quant_tuning.target.candidates' must list at least one"),
    ("quant_tuning.target.step_rows", 3, r"'extra.quant_tuning.target.step_rows' must be 1 \(a draft\) or 2"),
    ("quant_tuning.target.candidates.0.block_size", 48, r"'extra.quant_tuning.target.candidates\[0\].block_size' "
                                                        r"must be a power of two >= 16"),
    ("quant_tuning.target.candidates.0.greedy_agreement", 1.2, r"'extra.quant_tuning.target.candidates\[0\]"
                                                               r".greedy_agreement' must be a fraction"),
    ("quant_tuning.target.candidates.1.exact_step_ms", 0, r"'extra.quant_tuning.target.candidates\[1\]' needs "
                                                          r"positive step times"),
    ("quant_tuning.target.positions", 0, r"'extra.quant_tuning.target.positions' must be >= 1"),
    ("quant_tuning.target.candidates.1.bit_identical", 1, r"'extra.quant_tuning.target.candidates\[1\]"
                                                          r".bit_identical' must be bool"),
    ("quant_tuning.target.machine.cpu", 7, r"'extra.quant_tuning.target.machine.cpu' must be str"),
    ("quant_tuning.target.seed", 1, r"'extra.quant_tuning.target.seed' is not part of the schema"),
    ("quant_tuning.target.stopped", "yes", r"'extra.quant_tuning.target.stopped' must be bool"),
    ("quant_tuning.target.candidates.1.default_step_ms", 0, r"'extra.quant_tuning.target.candidates\[1\]"
                                                            r".default_step_ms' must be a finite number > 0"),
    ("quality", [], r"'extra.quality' must be dict"),
    ("quality.chunk", 1, r"'extra.quality.chunk' must be >= 2"),
    ("quality.max_tokens", "all", r"'extra.quality.max_tokens' must be int"),
    ("quality.kinds", {}, r"'extra.quality.kinds' must name at least one text kind"),
    ("quality.kinds.prose.positions", 0, r"'extra.quality.kinds.prose.positions' must be >= 1"),
    ("quality.kinds.prose.perplexity", 0, r"'extra.quality.kinds.prose.perplexity' must be a finite number > 0"),
    ("quality.kinds.prose.top1_agreement", 1.2, r"'extra.quality.kinds.prose.top1_agreement' must be a fraction"),
    ("quality.overall.source_perplexity", float("nan"), r"'extra.quality.overall.source_perplexity' must be a "
                                                        r"finite number > 0"),
    ("quality.overall.perplexity_ratio", 1.2, r"'extra.quality.overall.perplexity_ratio' is not part of the schema"),
    ("quality.kinds.prose.kl_divergence", -0.1, r"'extra.quality.kinds.prose.kl_divergence' must be a finite number "
                                                r">= 0"),
    ("quality.kinds.prose.kl_divergence", float("inf"), r"'extra.quality.kinds.prose.kl_divergence' must be a finite"),
    ("quality.source", 3, r"'extra.quality.source' must be str"),
]


@pytest.mark.parametrize("path, value, match", MALFORMED, ids=[f"{p}={v!r}" for p, v, _ in MALFORMED])
def test_each_malformed_field_is_refused_naming_it(path, value, match):
    obj = _edit(path, value)
    error = UnsafePathError if "../" in repr(value) else ManifestError
    with pytest.raises(error, match=match) as info:
        ManifestExtra.from_dict(obj)
    assert isinstance(info.value, BundleError)
    with pytest.raises(error, match=match):  # and the manifest parser says the same
        parse_manifest(manifest_json(extra=obj))


@pytest.mark.parametrize("path, match", [
    ("cost_profile.machine", r"'extra.cost_profile.machine' is missing"),
    ("cost_profile.target_s.1", r"'extra.cost_profile.target_s' lacks '1'"),
    ("exact_steps.target.one_row_step_ms", r"'extra.exact_steps.target.one_row_step_ms' is missing"),
    ("engines.target.gpu_name", r"'extra.engines.target.gpu_name' is missing"),
    ("quant_tuning.target.candidates.0.greedy_agreement", r"'extra.quant_tuning.target.candidates\[0\]"
                                                          r".greedy_agreement' is missing"),
    ("quality.overall", r"'extra.quality.overall' is missing"),
    ("quality.kinds.code.perplexity", r"'extra.quality.kinds.code.perplexity' is missing"),
    # A source perplexity without its agreement (or the reverse) is half a comparison.
    ("quality.kinds.code.top1_agreement", r"'extra.quality.kinds.code': a quality score has a source perplexity "
                                          r"and a top-1 agreement, or neither"),
    # Without a tolerance it reads as a comparison, whose max_abs_diff is one number.
    ("validation.target:fp32.tolerance", r"'extra.validation.target:fp32.max_abs_diff' must be int or float"),
])
def test_each_missing_field_is_refused_naming_it(path, match):
    with pytest.raises(ManifestError, match=match):
        ManifestExtra.from_dict(_edit(path, delete=True))


# --------------------------------------------------------------------------- earlier formats


def _manifest(**kw) -> Manifest:
    return replace(parse_manifest(manifest_json()), **kw)


# What export wrote into extra at each stage of the project (git history of export/bundle.py,
# runtime/profile.py and export/tensorrt.py): every shape still parses.
LEGACY_EXTRAS = {
    "format-1-first": {"validation": {"target:fp32": {"max_abs_diff": {"prefill": 1e-6, "verify": 2e-6},
                                                      "tolerance": 0.012, "top1_agreement": 1.0}},
                       "export_seconds": 3.1},
    "with-batch-variance": {"validation": {}, "batch_variance": {"target": 3.2e-6}, "export_seconds": 2},
    "with-context-warnings": {"validation": {}, "batch_variance": {}, "context_warnings": {"target": "past 32"},
                              "export_seconds": 2.0},
    "with-exact-steps": {"validation": {"target:int4-vs-fp32": {"top1_agreement": 0.8, "max_abs_diff": 0.5}},
                         "batch_variance": {"target": 0.0},
                         "exact_steps": {"target": {"bit_identical": False, "two_row_step_cost": 1.2,
                                                    "one_row_step_ms": 0.4}},
                         "unknown_config_fields": {"target": ["made_up_feature"]}, "export_seconds": 9.9},
    # runtime/profile.py before the catch-up cost: no draft_catchup_token_s; no draft: no draft_token_s.
    "profile-before-catchup": {"cost_profile": {"machine": {"cpu": "x", "cores": 2, "threads": 0}, "context": 128,
                                                "target_s": {"1": 0.01, "2": 0.011}, "draft_token_s": 0.002}},
    "profile-without-draft": {"cost_profile": {"machine": {"cpu": "x", "cores": 2, "threads": 0}, "context": 128,
                                               "target_s": {"1": 0.01}}},
    "profile-null-draft": {"cost_profile": {"machine": {"cpu": "x", "cores": 2, "threads": 0}, "context": 0,
                                            "target_s": {"1": 0.01}, "draft_token_s": None,
                                            "draft_catchup_token_s": None}},
    # An engine record from before engine_file, graph and onnxruntime_version were recorded.
    "engine-before-engine-file": {"engines": {"target": {
        k: v for k, v in ENGINE.to_dict().items() if k not in ("engine_file", "graph", "onnxruntime_version")}}},
}


@pytest.mark.parametrize("version", sorted({FORMAT_VERSION, *LEGACY_FORMAT_NOTES}))
@pytest.mark.parametrize("name", sorted(LEGACY_EXTRAS))
def test_manifests_earlier_versions_wrote_still_load(version, name):
    extra = LEGACY_EXTRAS[name]
    obj = manifest_json(version=version, extra=extra)
    if version == 1:  # format 1 had no sliding windows, so no attention_windows
        obj["models"]["target"].pop("attention_windows", None)
    manifest = parse_manifest(obj)
    assert manifest.format_version == version
    assert manifest.extra == ManifestExtra.from_dict(extra)
    assert parse_manifest(manifest.to_json()) == manifest  # and what it writes back reads the same


def test_a_tuning_record_from_before_stopping_and_pairing_reads_as_complete_and_unpaired():
    """Records written before tuning could stop (no ``stopped``) and before each candidate was timed beside
    the finest block (no ``default_step_ms``) read as a complete tuning compared on its own step times; and
    a complete tuning writes neither key, so what older readers accept is unchanged."""
    old = {"machine": MACHINE.to_dict(), "chosen": 128, "positions": 144, "context": 256,
           "candidates": [{"block_size": 32, "exact_step_ms": 67.1, "verify_ms": 112.0, "greedy_agreement": 0.979,
                           "bit_identical": True},
                          {"block_size": 128, "exact_step_ms": 55.2, "verify_ms": 98.4, "greedy_agreement": 0.986,
                           "bit_identical": False}]}
    tuning = QuantTuning.from_dict(old, "x")
    assert not tuning.stopped and tuning.step_rows == 2 and tuning == TUNING
    assert all(c.default_step_ms is None for c in tuning.candidates)
    assert tuning.candidate(128).step_ratio(tuning.candidate(32)) == pytest.approx(55.2 / 67.1)
    assert "stopped" not in TUNING.to_dict() and "default_step_ms" not in TUNING.candidates[1].to_dict()
    assert STOPPED_TUNING.to_dict()["stopped"] is True
    # Timed beside the finest block: the ratio uses the finest block's step from the same rounds.
    assert STOPPED_TUNING.candidate(64).step_ratio(STOPPED_TUNING.candidate(32)) == pytest.approx(60.0 / 66.4)


def test_an_old_profile_reads_as_typed_costs():
    extra = ManifestExtra.from_dict(LEGACY_EXTRAS["profile-before-catchup"])
    assert extra.cost_profile.target_s == {1: 0.01, 2: 0.011}
    assert extra.cost_profile.draft_catchup_token_s is None
    assert ManifestExtra.from_dict(LEGACY_EXTRAS["with-batch-variance"]).target_batch_variance() == 3.2e-6
    assert ManifestExtra.from_dict(LEGACY_EXTRAS["format-1-first"]).target_batch_variance() is None


def test_a_quality_score_derives_its_ratio_and_never_stores_it():
    score = QUALITY.kinds["prose"]
    assert score.perplexity_ratio == pytest.approx(12.5 / 9.3)
    assert "perplexity_ratio" not in score.to_dict()
    assert QualityScore(10, 3.0).perplexity_ratio is None and QualityScore(10, 3.0).to_dict() == {
        "positions": 10, "perplexity": 3.0}
