"""Hardening: an untrusted manifest either loads or raises a typed bundle error, never anything else.

What this module tries (all against the manifest of a real tiny bundle with target and draft):

- property-based: random mutations of the valid manifest (fields dropped, renamed or
  added, values replaced by random JSON of any type, path fields replaced by nasty
  strings: '..', absolute, backslashes, drive letters, NUL, very long, unicode; random
  format_version; values wrapped in random nesting) go through ``parse_manifest`` and,
  written to disk, through ``load_manifest``. Each ends either "loaded" or with a
  :class:`SpecedgeError` subclass (ManifestError, UnsafePathError, BundleError,
  ChecksumError, VocabMismatchError), never KeyError / TypeError / AttributeError /
  RecursionError / OSError. The outcome counts are printed at the end of the module
  (run with ``-s`` to see them);
- deep nesting (Python objects 5000 deep, JSON text 100000 deep) and integers beyond
  Python's int-to-str digit limit, in parse_manifest and in manifest.json;
- file-system tricks under a listed path: a data file replaced by a symlink to a copy
  outside the bundle (UnsafePathError); a symlink inside the bundle to an identical
  file inside (accepted: the loader resolves symlinks, requires the target to stay
  inside, then checks the resolved file's size and sha256, so it loads and generates);
  a symlink inside to a *different* file (ChecksumError); a symlink loop, a dangling
  symlink, a directory where a file should be, a path component too long for the file
  system (all typed errors);
- a chat template the manifest names must be covered by a checksum like every other
  file the runtime reads;
- a graph cut in half, and an external-data file cut in half, with the manifest record
  updated so the loader hands them to ONNX Runtime: ModelLoadError with a one-line
  message, no ORT traceback chained; a graph whose external data points outside the
  bundle ('..', absolute, or through a symlink) is refused by ONNX Runtime, surfaced as
  ModelLoadError;
- checksums: one flipped byte in the data file is a ChecksumError naming the file;
  ``verify_checksums=False`` hashes nothing but still checks sizes.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.bundle import manifest as manifest_mod
from specedge.errors import (BundleError, ChecksumError, ManifestError, ModelLoadError, SpecedgeError,
                             UnsafePathError)
from specedge.bundle.manifest import file_record, load_manifest, parse_manifest
from tiny_models import build_model

OUTCOMES: dict[str, Counter] = {"parse_manifest": Counter(), "load_manifest": Counter()}

# Paths an attacker (or a broken tool) could write into any path field of a manifest.
NASTY_PATHS = [
    "", " ", ".", "..", "../x", "../../etc/passwd", "target/../../outside", "target/..", "a/./../..",
    "/etc/passwd", "/", "//server/share", "\\evil", "\\\\server\\share", "target\\..\\..\\x", "..\\x",
    "C:\\Windows\\x", "c:x", "a\x00b", "\x00", "tokenizer.json\x00.png", "a" * 300, "a/" * 3000, "x" * 70000,
    "~/x", "target//model.onnx", "./tokenizer.json", "target/model.onnx/", "\u00e9t\u00e9/\u4e2d\u6587.onnx",
    "\ud83d\ude00", "\u202etxt.exe", "target/model.onnx\n", "con", "nul:", "\udc80", "\ud800", "a\udfffb/c",
]
NASTY_INTS = [-(2 ** 63), -1, 0, 1, 2, 7, 63, 64, 65, 300, 2 ** 31, 2 ** 63, 10 ** 30]

json_scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.sampled_from(NASTY_INTS)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(NASTY_PATHS))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


def _paths(node, prefix=()):
    """Every path (tuple of keys / indices) in a decoded JSON tree, the root included."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


def _parent(obj, path):
    node = obj
    for key in path[:-1]:
        node = node[key]
    return node


def _mutate(obj: dict, data) -> dict:
    """Apply 1-4 random mutations to a deep copy of ``obj``; returns the mutated copy."""
    obj = copy.deepcopy(obj)
    for _ in range(data.draw(st.integers(1, 4), label="n_mutations")):
        if not isinstance(obj, dict):
            break
        op = data.draw(st.sampled_from(["drop", "replace", "path", "nest", "rename", "add", "format_version",
                                        "files_key", "int"]), label="op")
        paths = [p for p in _paths(obj) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        parent, last = _parent(obj, path), path[-1]
        if op == "drop":
            del parent[last]
        elif op == "replace":
            parent[last] = data.draw(json_values, label="value")
        elif op == "path":
            parent[last] = data.draw(st.sampled_from(NASTY_PATHS) | st.text(), label="nasty_path")
        elif op == "int":
            parent[last] = data.draw(st.sampled_from(NASTY_INTS) | st.integers(), label="int")
        elif op == "nest":
            depth = data.draw(st.integers(1, 60), label="depth")
            value = parent[last]
            for _ in range(depth):
                value = [value] if data.draw(st.booleans(), label="as_list") else {"x": value}
            parent[last] = value
        elif op == "rename" and isinstance(parent, dict):
            parent[data.draw(st.text(max_size=10), label="new_key")] = parent.pop(last)
        elif op == "add":
            node = parent[last]
            if isinstance(node, dict):
                node[data.draw(st.text(max_size=10), label="added_key")] = data.draw(json_values, label="added")
            elif isinstance(node, list):
                node.append(data.draw(json_values, label="appended"))
        elif op == "format_version":
            obj["format_version"] = data.draw(json_values | st.integers(), label="format_version")
        elif op == "files_key" and isinstance(obj.get("files"), dict) and obj["files"]:
            key = data.draw(st.sampled_from(sorted(obj["files"])), label="files_key")
            obj["files"][data.draw(st.sampled_from(NASTY_PATHS) | st.text(), label="new_files_key")] = \
                obj["files"].pop(key)
    return obj


def _outcome(fn, *args, **kwargs) -> str:
    """'loaded', or the SpecedgeError subclass's name; anything else fails the test."""
    try:
        fn(*args, **kwargs)
    except SpecedgeError as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return type(exc).__name__
    return "loaded"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A tiny llama target with an fp32 copy of itself as the draft (max_context 64)."""
    from specedge.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("hardening-manifest")
    folder = build_model(root / "model", "llama", 0)
    out = root / "bundle"
    export_bundle(ExportConfig(target=str(folder), out=out, draft=str(folder), max_context=64, quiet=True))
    return out


@pytest.fixture(scope="module")
def manifest_obj(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


@pytest.fixture(scope="module")
def scratch_bundle(bundle, tmp_path_factory) -> Path:
    """One private copy whose manifest.json the load_manifest property test rewrites per example."""
    return Path(shutil.copytree(bundle, tmp_path_factory.mktemp("scratch") / "bundle"))


@pytest.fixture(scope="module", autouse=True)
def outcome_summary():
    yield
    for name, counts in OUTCOMES.items():
        if counts:
            total = sum(counts.values())
            detail = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
            print(f"\n[hardening] {name}: {total} random manifests tried: {detail}")


@pytest.fixture
def copy_of(bundle, tmp_path):
    def make() -> Path:
        return Path(shutil.copytree(bundle, tmp_path / "copy"))

    return make


def _set_record(bundle: Path, rel: str) -> None:
    """Make the manifest's record of ``rel`` match the file now on disk."""
    path = bundle / "manifest.json"
    obj = json.loads(path.read_text())
    obj["files"][rel] = file_record(bundle / rel).to_dict()
    path.write_text(json.dumps(obj))


# --------------------------------------------------------------------------- property tests


def test_the_unmutated_manifest_loads(bundle, manifest_obj):
    assert parse_manifest(copy.deepcopy(manifest_obj)).draft is not None
    load_manifest(bundle)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_manifests_parse_or_raise_a_typed_error(manifest_obj, data):
    mutated = _mutate(manifest_obj, data)
    OUTCOMES["parse_manifest"][_outcome(parse_manifest, mutated)] += 1


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_manifests_on_disk_load_or_raise_a_typed_error(manifest_obj, scratch_bundle, data):
    mutated = _mutate(manifest_obj, data)
    (scratch_bundle / "manifest.json").write_text(json.dumps(mutated), encoding="utf-8")
    OUTCOMES["load_manifest"][_outcome(load_manifest, scratch_bundle)] += 1


@settings(max_examples=60, deadline=None, database=None)
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode)
       | st.sampled_from([b"", b"\xef\xbb\xbf{}", b"null", b"[]", b'"manifest"', b"NaN", b"1e999", b"{" * 5000]))
def test_random_manifest_bytes_are_a_manifest_error(scratch_bundle, content):
    """manifest.json holding arbitrary bytes: not UTF-8, not JSON, or JSON of the wrong shape."""
    (scratch_bundle / "manifest.json").write_bytes(content)
    with pytest.raises(ManifestError):
        load_manifest(scratch_bundle)


# --------------------------------------------------------------------------- nesting and huge numbers


@pytest.mark.parametrize("field", ["format", "models", "models.target.eos_token_ids", "tokenizer.file",
                                   "files", "speculation.draft_tokens"])
def test_deep_nesting_in_a_python_object_is_a_manifest_error(manifest_obj, field):
    value: object = []
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        value = [value]
    obj = copy.deepcopy(manifest_obj)
    *parents, last = field.split(".")
    node = obj
    for key in parents:
        node = node[key]
    if isinstance(node[last], list):
        node[last] = [value]
    else:
        node[last] = value
    with pytest.raises(ManifestError, match=r"manifest field"):
        parse_manifest(obj)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,
                                  '{"format": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                  '{"a": ' * 50_000 + "1" + "}" * 50_000])
def test_deeply_nested_manifest_json_is_a_manifest_error(scratch_bundle, text):
    (scratch_bundle / "manifest.json").write_text(text)
    with pytest.raises(ManifestError, match=r"manifest.json"):
        load_manifest(scratch_bundle)


@pytest.mark.parametrize("field", ["format_version", "models.target.max_context", "models.target.n_layers",
                                   "models.target.eos_token_ids", "speculation.max_draft_tokens",
                                   "files.tokenizer.json.size"])
@pytest.mark.parametrize("sign", [1, -1])
def test_integers_past_the_digit_limit_are_manifest_errors(manifest_obj, scratch_bundle, field, sign):
    """str() of an int over 4300 digits raises ValueError (Python >= 3.11), and so does json.loads of one."""
    def with_value(value) -> dict:
        obj = copy.deepcopy(manifest_obj)
        if field.startswith("files."):
            obj["files"]["tokenizer.json"]["size"] = value
            return obj
        *parents, last = field.split(".")
        node = obj
        for key in parents:
            node = node[key]
        node[last] = [value] if isinstance(node[last], list) else value
        return obj

    with pytest.raises(ManifestError):
        parse_manifest(with_value(sign * 10 ** 5000))
    marker = 987654321987654321  # written as a number, then swapped for 5000 digits in the text
    text = json.dumps(with_value(marker)).replace(str(marker), ("-" if sign < 0 else "") + "9" * 5000)
    (scratch_bundle / "manifest.json").write_text(text)
    with pytest.raises(ManifestError):
        load_manifest(scratch_bundle)


# --------------------------------------------------------------------------- nasty paths


@pytest.mark.parametrize("value", NASTY_PATHS, ids=lambda v: repr(v[:20]))
@pytest.mark.parametrize("field", ["graph", "data_file", "tokenizer", "chat_template", "files_key"])
def test_nasty_paths_load_or_raise_a_typed_error(manifest_obj, scratch_bundle, field, value):
    obj = copy.deepcopy(manifest_obj)
    target = obj["models"]["target"]
    if field == "graph":
        obj["files"][value] = obj["files"].pop(target["graph"])
        target["graph"] = value
    elif field == "data_file":
        obj["files"][value] = obj["files"].pop(target["data_files"][0])
        target["data_files"] = [value]
    elif field == "tokenizer":
        obj["files"][value] = obj["files"].pop("tokenizer.json")
        obj["tokenizer"]["file"] = value
    elif field == "chat_template":
        obj["tokenizer"]["chat_template"] = value
    else:
        obj["files"][value] = obj["files"].pop("tokenizer_config.json")
    outcome = _outcome(parse_manifest, obj)
    if ".." in value.replace("\\", "/").split("/") or value.startswith(("/", "\\")) or "\x00" in value \
            or any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        assert outcome == "UnsafePathError", value
    (scratch_bundle / "manifest.json").write_text(json.dumps(obj))
    loaded = _outcome(load_manifest, scratch_bundle)
    # JSON can change the value on the way (an escaped surrogate pair decodes to one character).
    outcome = _outcome(parse_manifest, json.loads(json.dumps(obj)))
    if outcome != "loaded":
        assert loaded == outcome
    else:  # the manifest is well formed, but the renamed file is not on disk under that name
        # (or names another file on disk, e.g. './tokenizer.json', whose size differs)
        assert loaded in ("loaded", "BundleError", "UnsafePathError", "ManifestError", "ChecksumError"), loaded


# --------------------------------------------------------------------------- symlinks and odd files


def test_data_file_symlinked_outside_the_bundle_is_refused(copy_of, tmp_path):
    bundle = copy_of()
    data = bundle / "target" / "model.onnx.data"
    outside = tmp_path / "outside.data"
    shutil.copyfile(data, outside)  # identical bytes: only the location is wrong
    data.unlink()
    os.symlink(outside, data)
    with pytest.raises(UnsafePathError, match=r"'target/model.onnx.data' resolves to .*outside the bundle"):
        load_manifest(bundle)
    with pytest.raises(UnsafePathError):
        load_manifest(bundle, verify_checksums=False)


def test_symlink_to_an_identical_file_inside_the_bundle_is_accepted(copy_of):
    """Decided from resolve_inside: a symlink is followed, and what it points at must stay inside the
    bundle and carry the recorded size and sha256. Then it is as good as the file itself."""
    from specedge.runtime.generator import Generator

    bundle = copy_of()
    data = bundle / "target" / "model.onnx.data"
    shutil.copyfile(data, bundle / "target" / "shared.data")
    data.unlink()
    os.symlink("shared.data", data)
    load_manifest(bundle)
    result = Generator.from_bundle(bundle, threads=1).generate(input_ids=[6, 7, 8], max_new_tokens=4)
    assert len(result.token_ids) == 4


def test_external_data_symlinked_out_of_its_graph_folder_is_refused_by_onnx_runtime(copy_of):
    """The manifest allows a symlink anywhere inside the bundle, but ONNX Runtime only reads a graph's
    external data from the graph's own folder (symlinks resolved): that is a clear ModelLoadError."""
    from specedge.runtime.generator import Generator

    bundle = copy_of()
    data = bundle / "target" / "model.onnx.data"
    shutil.copyfile(data, bundle / "shared.data")
    data.unlink()
    os.symlink("../shared.data", data)
    load_manifest(bundle)
    with pytest.raises(ModelLoadError, match=r"could not load model.onnx .*External data path"):
        Generator.from_bundle(bundle, threads=1)


def test_symlink_to_a_different_file_inside_is_a_checksum_error(copy_of):
    bundle = copy_of()
    data = bundle / "target" / "model.onnx.data"
    data.unlink()
    os.symlink("../draft/model.onnx", data)
    with pytest.raises(ChecksumError, match=r"'target/model.onnx.data' is \d+ bytes but the manifest records"):
        load_manifest(bundle)


def test_symlink_loop_is_a_typed_error(copy_of):
    bundle = copy_of()
    data = bundle / "target" / "model.onnx.data"
    data.unlink()
    os.symlink("model.onnx.data", data)  # points at itself
    with pytest.raises(BundleError, match=r"target/model.onnx.data"):
        load_manifest(bundle)


def test_dangling_symlink_and_directory_are_bundle_errors(copy_of):
    bundle = copy_of()
    data = bundle / "target" / "model.onnx.data"
    data.unlink()
    os.symlink("nowhere.data", data)
    with pytest.raises(BundleError, match=r"'target/model.onnx.data' listed in the manifest is missing"):
        load_manifest(bundle)
    data.unlink()
    data.mkdir()
    with pytest.raises(BundleError, match=r"'target/model.onnx.data' listed in the manifest is missing"):
        load_manifest(bundle)


def test_path_too_long_for_the_file_system_is_a_bundle_error(manifest_obj, scratch_bundle):
    for long in ("a" * 300, "a/" * 3000 + "x"):
        obj = copy.deepcopy(manifest_obj)
        obj["files"][long] = obj["files"]["tokenizer_config.json"]
        (scratch_bundle / "manifest.json").write_text(json.dumps(obj))
        with pytest.raises(BundleError):
            load_manifest(scratch_bundle)


def test_a_named_chat_template_needs_a_checksum(manifest_obj, bundle):
    """The runtime renders the chat template, so like every file it reads it must be hashed at load."""
    from specedge.runtime.generator import Generator

    obj = copy.deepcopy(manifest_obj)
    del obj["files"]["chat_template.jinja"]
    with pytest.raises(ManifestError, match=r"'chat_template.jinja' but has no sha256"):
        parse_manifest(obj)
    obj = copy.deepcopy(manifest_obj)
    obj["tokenizer"]["chat_template"] = "missing.jinja"
    with pytest.raises(ManifestError, match=r"'missing.jinja' but has no sha256"):
        parse_manifest(obj)
    assert Generator.from_bundle(bundle, threads=1).codec.chat_template  # the exported bundle lists it


# --------------------------------------------------------------------------- broken graphs


@pytest.mark.parametrize("rel", ["target/model.onnx", "target/model.onnx.data"])
def test_file_cut_in_half_with_a_matching_record_is_a_model_load_error(copy_of, rel):
    from specedge.runtime.generator import Generator

    bundle = copy_of()
    path = bundle / rel
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    _set_record(bundle, rel)
    if rel.endswith(".onnx"):  # the graph's own protobuf is read at load (for its external-data files)
        with pytest.raises(ModelLoadError, match=r"model.onnx is not a valid ONNX file .*truncated or corrupt"):
            load_manifest(bundle)
        return
    load_manifest(bundle)  # the records match: the loader passes the file on to ONNX Runtime
    with pytest.raises(ModelLoadError, match=r"ONNX Runtime could not load model.onnx .*truncated, corrupt") as info:
        Generator.from_bundle(bundle, threads=1)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message and len(message) < 800
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_graph_whose_external_data_leaves_the_bundle_is_refused(copy_of, tmp_path, how):
    """The graph names its own external-data file: refused at load, before ONNX Runtime opens anything."""
    onnx = pytest.importorskip("onnx")
    from specedge.runtime.generator import Generator

    bundle = copy_of()
    outside = tmp_path / "outside.data"
    shutil.copyfile(bundle / "target" / "model.onnx.data", outside)
    location = {"dotdot": "../../outside.data", "absolute": str(outside), "symlink": "evil.data"}[how]
    if how == "symlink":
        os.symlink(outside, bundle / "target" / "evil.data")
    graph = bundle / "target" / "model.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(graph))
    _set_record(bundle, "target/model.onnx")
    match = {"dotdot": r"contains '\.\.'", "absolute": r"is an absolute path",
             "symlink": r"outside the bundle"}[how]
    with pytest.raises(UnsafePathError, match=match):
        load_manifest(bundle)
    with pytest.raises(UnsafePathError, match=match):
        Generator.from_bundle(bundle, threads=1)


# --------------------------------------------------------------------------- checksums


def test_one_flipped_byte_is_a_checksum_error_naming_the_file(copy_of, monkeypatch):
    bundle = copy_of()
    data = bundle / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"bundle file 'target/model.onnx.data' has sha256 [0-9a-f]{16}"):
        load_manifest(bundle)

    def no_hashing(path):
        raise AssertionError(f"verify_checksums=False hashed {path}")

    monkeypatch.setattr(manifest_mod, "sha256_file", no_hashing)
    load_manifest(bundle, verify_checksums=False)  # no hash computed, sizes match
    data.write_bytes(bytes(raw) + b"\x00")  # one byte longer
    with pytest.raises(ChecksumError, match=r"'target/model.onnx.data' is \d+ bytes but the manifest records"):
        load_manifest(bundle, verify_checksums=False)


# --------------------------------------------------------------------------- a manifest that lies about its graph


@pytest.mark.parametrize("edit", [{"head_dim": 8}, {"head_dim": 32}, {"n_kv_heads": 1}, {"n_kv_heads": 4},
                                  {"vocab_size": 400}, {"kv_dtype": "float16"}, {"n_layers": 1}, {"n_layers": 3}],
                         ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_manifest_sizes_that_disagree_with_the_graph_fail_at_load(copy_of, edit):
    """Parsed fine, but the graph's declared IO says otherwise: refused when the session is created,
    not as an ONNX Runtime shape error in the middle of a generation."""
    from specedge.runtime.generator import Generator

    bundle = copy_of()
    path = bundle / "manifest.json"
    obj = json.loads(path.read_text())
    for role in ("target", "draft"):
        obj["models"][role].update(edit)
    path.write_text(json.dumps(obj))
    load_manifest(bundle)
    with pytest.raises(ModelLoadError, match=r"the manifest does not describe this graph"):
        Generator.from_bundle(bundle, threads=1)


def test_a_max_context_too_large_to_allocate_is_a_manifest_error(manifest_obj):
    obj = copy.deepcopy(manifest_obj)
    obj["models"]["target"]["max_context"] = 2 ** 40  # a 128 TiB KV cache
    with pytest.raises(ManifestError, match=r"'models.target.max_context' must be <= 1048576"):
        parse_manifest(obj)


# --------------------------------------------------------------------------- a broken chat template


@pytest.mark.parametrize("content, error, match, at_load", [
    (b"\xff\xfe{{ messages }}", BundleError, r"chat template 'chat_template.jinja' is not UTF-8 text", True),
    (b"{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", BundleError, r"chat template recurses without end", False),
    (b"{% for m in messages %}{{ m['content'] }", SpecedgeError, r"chat template", False),
], ids=["not-utf8", "endless-recursion", "syntax-error"])
def test_broken_chat_template_is_a_typed_error(copy_of, content, error, match, at_load):
    """The template's record matches, so only its content is wrong."""
    from specedge.runtime.generator import Generator

    bundle = copy_of()
    (bundle / "chat_template.jinja").write_bytes(content)
    _set_record(bundle, "chat_template.jinja")
    if at_load:
        with pytest.raises(error, match=match):
            Generator.from_bundle(bundle, threads=1)
        return
    gen = Generator.from_bundle(bundle, threads=1)
    with pytest.raises(error, match=match):
        gen.generate("w010 w011", max_new_tokens=2)
    assert gen.generate("w010 w011", chat=False, max_new_tokens=2).token_ids  # plain prompts still work
