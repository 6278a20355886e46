"""Invariant: a manifest is untrusted data, and every way it can be wrong has a typed error.

A manifest round-trips (to_json -> parse_manifest gives an equal Manifest). Bad
input raises the typed error whose message names the field or file: a missing or
ill-typed field (by dotted path), an unknown format_version, a path that could
leave the bundle ('..', absolute, a symlink out), a wrong sha256, a truncated or
missing file, a bundle that is not a folder or has no manifest.json, invalid JSON.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

from specedge.errors import BundleError, ChecksumError, ManifestError, UnsafePathError
from specedge.bundle.manifest import FORMAT_VERSION, Manifest, load_manifest, parse_manifest
from tiny_models import edit_manifest


@pytest.fixture(scope="module")
def manifest_json(int4_bundle) -> dict:
    """The manifest of a bundle with target and draft, as decoded JSON."""
    return json.loads((int4_bundle / "manifest.json").read_text())


def _with(obj: dict, path: str, value=None, *, delete: bool = False) -> dict:
    """A deep copy of ``obj`` with the dotted ``path`` set to ``value`` (or deleted)."""
    out = copy.deepcopy(obj)
    node = out
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    if delete:
        del node[last]
    else:
        node[last] = value
    return out


# --------------------------------------------------------------------------- round trip


def test_round_trip(int4_bundle, manifest_json):
    manifest = load_manifest(int4_bundle)
    assert isinstance(manifest, Manifest)
    assert parse_manifest(manifest.to_json()) == manifest
    assert parse_manifest(json.loads(json.dumps(manifest.to_json()))) == manifest
    assert parse_manifest(manifest_json) == manifest
    assert manifest.format_version == FORMAT_VERSION
    assert set(manifest.models()) == {"target", "draft"}
    # Every file the runtime reads is covered by a checksum.
    referenced = {manifest.tokenizer.file, manifest.target.graph, manifest.draft.graph,
                  *manifest.target.data_files, *manifest.draft.data_files}
    assert referenced <= set(manifest.files)


def test_optional_fields_take_their_defaults(manifest_json):
    obj = _with(manifest_json, "speculation", delete=True)
    obj = _with(obj, "models.target.io", delete=True)
    manifest = parse_manifest(obj)
    assert manifest.speculation.drafter == "auto"  # the default: lookups, and the draft where it pays
    assert manifest.target.io.past_key == "past_key.%d"


# --------------------------------------------------------------------------- fields


@pytest.mark.parametrize("path", ["models.target.n_layers", "models.draft.vocab_size", "models.target.graph",
                                  "tokenizer.file", "files", "format_version", "models.target.eos_token_ids"])
def test_missing_field_is_named(manifest_json, path):
    with pytest.raises(ManifestError, match=rf"manifest field '{path}' is missing"):
        parse_manifest(_with(manifest_json, path, delete=True))


@pytest.mark.parametrize("path, value, want", [
    ("models.target.n_layers", "2", "int"),
    ("models.target.n_layers", True, "an integer"),  # bool is not an int here
    ("models.target.head_dim", 1.5, "int"),
    ("models.draft.architecture", 7, "str"),
    ("tokenizer.add_bos_token", "yes", "bool"),
    ("speculation.max_draft_tokens", [8], "int"),
    ("models.target.eos_token_ids", 1, "list"),
    ("files", [], "dict"),
])
def test_ill_typed_field_names_the_dotted_field(manifest_json, path, value, want):
    with pytest.raises(ManifestError, match=rf"manifest field '{path}' must be {want}"):
        parse_manifest(_with(manifest_json, path, value))


@pytest.mark.parametrize("path, value, match", [
    ("models.target.n_layers", 0, r"'models.target.n_layers' must be >= 1"),
    ("models.target.precision", "int3", r"'models.target.precision' must be one of fp32, fp16, int4, int8"),
    ("models.target.n_kv_heads", 3, r"must be a multiple of n_kv_heads"),
    ("models.target.eos_token_ids", [999999], r"eos_token_ids\[0\]' must be a token id in \[0, 300\)"),
    ("models.target.io", {"past_key": "past_key"}, r"'models.target.io.past_key' must contain exactly one '%d'"),
    ("speculation.drafter", "Beam Search!", r"'speculation.drafter' must be a drafter name"),
    ("speculation.max_draft_tokens", 65, r"must be in \[1, 64\]"),
    ("format", "other-bundle", r"not a specedge bundle"),
])
def test_out_of_range_values_are_refused(manifest_json, path, value, match):
    with pytest.raises(ManifestError, match=match):
        parse_manifest(_with(manifest_json, path, value))


def test_unknown_model_role_and_missing_draft(manifest_json):
    obj = _with(manifest_json, "models.extra", manifest_json["models"]["draft"])
    with pytest.raises(ManifestError, match=r"unknown entries \['extra'\]"):
        parse_manifest(obj)
    no_draft = _with(manifest_json, "models.draft", delete=True)
    from specedge.runtime.loading import check_speculation  # the registry says which drafters need a draft model

    with pytest.raises(ManifestError, match=r"'speculation.drafter' is 'model' but the bundle has no models.draft"):
        check_speculation(parse_manifest(_with(no_draft, "speculation.drafter", "model")))
    assert parse_manifest(_with(no_draft, "speculation", delete=True)).speculation.drafter == "auto"  # lookup only


@pytest.mark.parametrize("version", [0, 3, 99])
def test_unknown_format_version(manifest_json, version):
    with pytest.raises(ManifestError, match=rf"format_version {version} is not supported .* re-export"):
        parse_manifest(_with(manifest_json, "format_version", version))


def test_not_an_object():
    with pytest.raises(ManifestError, match="must hold a JSON object"):
        parse_manifest([1, 2])


# --------------------------------------------------------------------------- paths


@pytest.mark.parametrize("path, value", [
    ("models.target.graph", "../outside/model.onnx"),
    ("models.draft.graph", "draft/../../x.onnx"),
    ("tokenizer.file", "..\\tokenizer.json"),
])
def test_dotdot_paths_are_refused(manifest_json, path, value):
    with pytest.raises(UnsafePathError, match=rf"'{path}' .*contains '\.\.' and would leave the bundle"):
        parse_manifest(_with(manifest_json, path, value))


@pytest.mark.parametrize("value", ["/etc/passwd", "\\\\server\\share\\x", "C:\\model.onnx"])
def test_absolute_paths_are_refused(manifest_json, value):
    with pytest.raises(UnsafePathError, match=r"'models.target.graph' is an absolute path"):
        parse_manifest(_with(manifest_json, "models.target.graph", value))


def test_unsafe_paths_in_files_and_data_files(manifest_json):
    files = dict(manifest_json["files"])
    files["../evil"] = next(iter(files.values()))
    with pytest.raises(UnsafePathError, match=r"files\['../evil'\]"):
        parse_manifest(_with(manifest_json, "files", files))
    with pytest.raises(UnsafePathError, match=r"data_files\[0\]' is an absolute path"):
        parse_manifest(_with(manifest_json, "models.target.data_files", ["/tmp/x.data"]))


def test_a_referenced_file_without_checksum(manifest_json):
    files = {k: v for k, v in manifest_json["files"].items() if k != "tokenizer.json"}
    with pytest.raises(ManifestError, match=r"lists 'tokenizer.json' but has no sha256 for it"):
        parse_manifest(_with(manifest_json, "files", files))


def test_bad_sha256_format(manifest_json):
    files = copy.deepcopy(manifest_json["files"])
    files["tokenizer.json"]["sha256"] = "XYZ"
    with pytest.raises(ManifestError, match=r"files\['tokenizer.json'\].sha256' must be 64 lowercase hex"):
        parse_manifest(_with(manifest_json, "files", files))


def test_symlink_leaving_the_bundle_is_refused(int4_bundle, bundle_copy, tmp_path):
    bundle = bundle_copy(int4_bundle)
    outside = tmp_path / "outside-tokenizer.json"
    outside.write_bytes((bundle / "tokenizer.json").read_bytes())  # same bytes: only the location is wrong
    (bundle / "tokenizer.json").unlink()
    os.symlink(outside, bundle / "tokenizer.json")
    with pytest.raises(UnsafePathError, match=r"'tokenizer.json' resolves to .* outside the bundle"):
        load_manifest(bundle)


def test_symlink_inside_the_bundle_is_allowed(int4_bundle, bundle_copy):
    bundle = bundle_copy(int4_bundle)
    (bundle / "real-tokenizer.json").write_bytes((bundle / "tokenizer.json").read_bytes())
    (bundle / "tokenizer.json").unlink()
    os.symlink("real-tokenizer.json", bundle / "tokenizer.json")
    load_manifest(bundle)


# --------------------------------------------------------------------------- files on disk


def test_wrong_sha256_is_a_checksum_error(int4_bundle, bundle_copy):
    bundle = bundle_copy(int4_bundle)
    data = bundle / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte flipped
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"'target/model.onnx.data' has sha256 .* \(corrupt or tampered\)"):
        load_manifest(bundle)
    load_manifest(bundle, verify_checksums=False)  # the opt-out skips hashing (sizes still checked)


def test_truncated_file_is_a_size_mismatch(int4_bundle, bundle_copy):
    bundle = bundle_copy(int4_bundle)
    data = bundle / "draft" / "model.onnx.data"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ChecksumError, match=rf"'draft/model.onnx.data' is {size // 2} bytes but the manifest "
                                            rf"records {size} \(truncated"):
        load_manifest(bundle, verify_checksums=False)


def test_missing_file(int4_bundle, bundle_copy):
    bundle = bundle_copy(int4_bundle)
    (bundle / "draft" / "model.onnx").unlink()
    with pytest.raises(BundleError, match=r"bundle file 'draft/model.onnx' listed in the manifest is missing"):
        load_manifest(bundle)


def test_bundle_that_does_not_exist(tmp_path):
    with pytest.raises(BundleError, match=r"does not exist"):
        load_manifest(tmp_path / "nope")


def test_bundle_that_is_not_a_folder(tmp_path):
    path = tmp_path / "file.bundle"
    path.write_text("{}")
    with pytest.raises(BundleError, match=r"is not a folder"):
        load_manifest(path)


def test_folder_without_manifest(tmp_path):
    with pytest.raises(BundleError, match=r"has no manifest.json: not a specedge bundle"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe\x00garbage"])
def test_invalid_json(tmp_path, content):
    (tmp_path / "manifest.json").write_bytes(content)
    with pytest.raises(ManifestError, match=r"manifest.json is not valid JSON"):
        load_manifest(tmp_path)


def test_hand_edited_manifest_is_validated_at_load(int4_bundle, bundle_copy):
    bundle = bundle_copy(int4_bundle)
    edit_manifest(bundle, lambda obj: obj["models"]["target"].update(n_heads="four"))
    with pytest.raises(ManifestError, match=r"'models.target.n_heads' must be int"):
        load_manifest(bundle)


def test_a_drafter_the_registry_does_not_know_is_refused_at_load(int4_bundle, bundle_copy):
    """The format checks a drafter name's spelling; loading checks it against the runtime's registry."""
    from specedge.runtime.generator import Generator

    assert parse_manifest(_with(json.loads((int4_bundle / "manifest.json").read_text()), "speculation.drafter",
                                "beam")).speculation.drafter == "beam"
    bundle = bundle_copy(int4_bundle)
    edit_manifest(bundle, lambda obj: obj["speculation"].update(drafter="beam"))
    with pytest.raises(ManifestError, match=r"'speculation.drafter' must be one of none, auto, model, ngram, "
                                            r"composite, suffix; got 'beam'"):
        Generator.from_bundle(bundle)
