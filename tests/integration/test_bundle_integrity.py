"""The integrity check covers every file a graph reads, and corrupt weights fail loudly (issue 20, items 3, 8, 9).

Invariants guarded here:

* a graph whose external_data names a file inside the bundle that the manifest does not
  list (so no checksum covers it) is refused by ``load_manifest``, ``specedge info`` and
  ``Generator.from_bundle``, even when model.onnx's own record was updated to match;
* the graph reader (graphfile.py, no ``onnx`` import) finds exactly the locations and
  initializer shapes ``onnx.load(..., load_external_data=False)`` finds;
* NaN weights with matching checksums give NonFiniteLogitsError naming the bundle, at
  warm-up and on a generation's first step, never ``''`` or garbage;
* a manifest claiming more positions than the graph's position table holds is refused at
  load with a message naming both numbers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from specedge.errors import ChecksumError, ManifestError, NonFiniteLogitsError
from specedge.bundle.graphfile import read_graph_facts
from specedge.bundle.manifest import file_record, load_manifest

onnx = pytest.importorskip("onnx")


def _set_record(bundle: Path, rel: str) -> None:
    path = bundle / "manifest.json"
    obj = json.loads(path.read_text())
    obj["files"][rel] = file_record(bundle / rel).to_dict()
    path.write_text(json.dumps(obj))


def _copy(bundle: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(bundle, tmp_path / "copy"))


def _point_external_data_at(graph: Path, location: str) -> None:
    model = onnx.load(str(graph), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(graph))


@pytest.mark.parametrize("nan_weights", [False, True], ids=["same-weights", "nan-weights"])
def test_unlisted_external_data_inside_the_bundle_is_refused(llama_bundle, tmp_path, nan_weights):
    """Issue 20: `specedge info` said "all files verified" while the graph read an unlisted file."""
    from click.testing import CliRunner

    from specedge.cli.main import main
    from specedge.runtime.generator import Generator

    bundle = _copy(llama_bundle, tmp_path)
    data = (bundle / "target" / "model.onnx.data").read_bytes()
    if nan_weights:
        data = np.full(len(data) // 4, np.nan, np.float32).tobytes()
    (bundle / "target" / "unlisted.data").write_bytes(data)
    _point_external_data_at(bundle / "target" / "model.onnx", "unlisted.data")
    _set_record(bundle, "target/model.onnx")  # the graph's own record matches: only the reference is new
    match = r"'target/unlisted.data', which models.target.data_files does not list, so no checksum covers it"
    with pytest.raises(ChecksumError, match=match):
        load_manifest(bundle)
    with pytest.raises(ChecksumError, match=match):
        load_manifest(bundle, verify_checksums=False)
    with pytest.raises(ChecksumError, match=match):
        Generator.from_bundle(bundle, threads=1)
    result = CliRunner().invoke(main, ["info", str(bundle)])
    assert result.exit_code == 2 and "all files verified" not in result.output
    assert result.output.startswith("error: ") and "does not list" in result.output


def test_the_graph_reader_agrees_with_onnx(int4_bundle, arch_bundle):
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    for graph in [int4_bundle / "target" / "model.onnx", int4_bundle / "draft" / "model.onnx",
                  arch_bundle("gpt2") / "target" / "model.onnx"]:
        facts = read_graph_facts(graph)
        model = onnx.load(str(graph), load_external_data=False)
        locations = {next(e.value for e in t.external_data if e.key == "location")
                     for t in _get_all_tensors(model) if uses_external_data(t)}
        assert facts.external_locations == locations
        assert facts.initializer_dims == {t.name: tuple(t.dims) for t in model.graph.initializer}


def test_nan_weights_are_a_typed_error_at_warmup_and_first_step(llama_bundle, tmp_path):
    """Issue 20: NaN weights gave '' (greedy). Now: an error naming the bundle, before any token."""
    from specedge.runtime.generator import Generator

    bundle = _copy(llama_bundle, tmp_path)
    data = bundle / "target" / "model.onnx.data"
    data.write_bytes(np.full(data.stat().st_size // 4, np.nan, np.float32).tobytes())
    _set_record(bundle, "target/model.onnx.data")
    gen = Generator.from_bundle(bundle, threads=1)  # checksums match: only running it can tell
    match = rf"bundle {bundle}: target/model.onnx produced \d+ NaN or infinite logits on its first step"
    with pytest.raises(NonFiniteLogitsError, match=match):
        gen.warmup(tune=False)
    for temperature in (0.0, 0.8):
        with pytest.raises(NonFiniteLogitsError, match=match):
            gen.generate("w010 w011", chat=False, max_new_tokens=4, temperature=temperature)


def test_finite_weights_pass_the_check(llama_bundle, load_generator):
    gen = load_generator(llama_bundle)
    gen.warmup(tune=False)
    assert gen.generate("w010 w011", chat=False, max_new_tokens=4).token_ids


@pytest.mark.parametrize("arch, table", [("llama", "cos_cache"), ("gpt2", "pos_embed")])
def test_a_max_context_beyond_the_graphs_positions_is_refused_at_load(arch_bundle, tmp_path, arch, table):
    """Issue 20: this failed mid-generation with ONNX Runtime's cos_cache message."""
    bundle = _copy(arch_bundle(arch), tmp_path)
    path = bundle / "manifest.json"
    obj = json.loads(path.read_text())
    built = obj["models"]["target"]["max_context"]
    obj["models"]["target"]["max_context"] = built * 2
    path.write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match=rf"'models.target.max_context' is {built * 2} but target/model.onnx "
                                            rf"was built for {built} positions \(its '{table}' table\)"):
        load_manifest(bundle)
    obj["models"]["target"]["max_context"] = built // 2  # fewer than built is fine: a smaller cache
    path.write_text(json.dumps(obj))
    load_manifest(bundle)


# --------------------------------------------------------------------------- manifest fields the runtime reads
@pytest.mark.parametrize("pattern", ["past_key.%%d", "past_key.%s.%d", "past_key.%d.%d", "past_key.%", "past_key"])
def test_an_io_pattern_that_is_not_one_layer_index_is_a_manifest_error(llama_bundle, pattern):
    """Issue 20: "%%d" passed the old count("%d") check and then failed with a TypeError."""
    from specedge.bundle.manifest import parse_manifest

    obj = json.loads((llama_bundle / "manifest.json").read_text())
    obj["models"]["target"].setdefault("io", {})["past_key"] = pattern
    with pytest.raises(ManifestError, match=r"'models.target.io.past_key' must contain exactly one '%d'"):
        parse_manifest(obj)


MACHINE = {"cpu": "a CPU", "cores": 2, "threads": 1}


@pytest.mark.parametrize("extra, match", [
    ({"batch_variance": [1, 2]}, r"'extra.batch_variance' must be an object"),
    ({"batch_variance": {"target": "big"}}, r"'extra.batch_variance.target' must be a finite number >= 0"),
    ({"batch_variance": {"target": -1.0}}, r"'extra.batch_variance.target' must be a finite number >= 0"),
    ({"cost_profile": "fast"}, r"'extra.cost_profile' must be an object"),
    ({"cost_profile": {"target_s": {"1": 0.01}}}, r"'extra.cost_profile.machine' is missing"),
    ({"cost_profile": {"machine": MACHINE, "target_s": {"x": 0.01}}}, r"has key 'x'; keys are verify lengths"),
    ({"cost_profile": {"machine": MACHINE, "target_s": {"1": "slow"}}}, r"'extra.cost_profile.target_s.1' must be a"),
    ({"cost_profile": {"machine": MACHINE, "target_s": {"2": 0.01}}}, r"lacks '1'"),
    ({"cost_profile": {"machine": MACHINE, "target_s": {"1": 0.01}, "draft_token_s": [0]}},
     r"'extra.cost_profile.draft_token_s' must be a finite number > 0"),
    ({"cost_profile": {"machine": MACHINE, "target_s": {"1": 0.01}, "context": True}},
     r"'extra.cost_profile.context' must be an integer"),
], ids=["variance-list", "variance-str", "variance-negative", "profile-str", "profile-no-machine", "profile-bad-key",
        "profile-bad-time", "profile-no-step", "profile-bad-draft", "profile-bool-context"])
def test_malformed_extras_the_runtime_reads_are_manifest_errors(llama_bundle, tmp_path, extra, match):
    """Issue 20: a malformed cost_profile or batch_variance gave AttributeError/ValueError at load."""
    from specedge.runtime.generator import Generator

    bundle = _copy(llama_bundle, tmp_path)
    path = bundle / "manifest.json"
    obj = json.loads(path.read_text())
    obj["extra"].update(extra)
    path.write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match=match):
        load_manifest(bundle)
    with pytest.raises(ManifestError, match=match):
        Generator.from_bundle(bundle, threads=1)


def test_a_measured_profile_round_trips(llama_bundle, tmp_path):
    from specedge.runtime.generator import Generator

    bundle = _copy(llama_bundle, tmp_path)
    gen = Generator.from_bundle(bundle, threads=1)
    gen.tune(save=True, context=16)
    assert load_manifest(bundle).extra.cost_profile.target_s[1] > 0
