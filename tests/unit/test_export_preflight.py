"""Invariant: export refuses a bad --out or a broken source before it loads anything (issue #41 item 6).

export/preflight.py, through ``export_bundle`` and the CLI, with no torch in the process (this
folder's conftest fails a test that imports it, which proves nothing was loaded):

- ``--out`` under a file (``FILE/sub``), with a 300-character name or one whose temporary sibling
  would not fit, under /proc or /sys, in a folder that refuses writes (chmod 555, or ``chattr +i``
  where root ignores the mode: the write probe catches both), or a symlink loop: each an
  ExportError naming the path, and ``specedge export`` prints one ``error:`` line and exits 2;
- a symlink ``--out``, dangling or not, resolves to where it points (the bundle is written there;
  tests/integration/test_export_paths.py runs a whole export through one); missing
  folders above ``--out`` are accepted (the export creates them) and the checks create nothing;
- a ``--target`` GGUF that is cut short after its magic, has another magic, an impossible version
  or counts its bytes cannot hold, a source file that is no GGUF, a missing source: ExportErrors
  naming the file.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.cli.main import main
from specedge.errors import ExportError
from specedge.export.bundle import ExportConfig, export_bundle
from specedge.export.preflight import check_out, check_source


@pytest.fixture
def source(tmp_path) -> Path:
    """A folder that would pass as a source until something read its weights (nothing may)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").touch()
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot write in: mode 555, or immutable where root ignores the mode."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if _writable(folder):  # root: the mode bits do not bind it
        folder.chmod(0o755)
        chattr = shutil.which("chattr")
        immutable = chattr is not None and subprocess.run([chattr, "+i", str(folder)], capture_output=True).returncode == 0
        if not immutable or _writable(folder):
            pytest.skip("no way to make a folder unwritable for this user here (root without chattr +i)")
    yield folder
    if immutable:
        subprocess.run([shutil.which("chattr"), "-i", str(folder)], check=True)
    folder.chmod(0o755)


def _bad_outs(tmp_path: Path, unwritable: Path | None = None) -> dict[str, tuple[Path, str]]:
    (tmp_path / "a-file").write_text("")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    cases = {
        "under-a-file": (tmp_path / "a-file" / "sub", r"--out .*a-file/sub: .*a-file is a file, not a folder"),
        "300-chars": (tmp_path / ("b" * 300), r"--out refused: the name 'b{24}…' is 300 bytes \(plus \d+ for its "
                                              r"temporary sibling\); this file system allows \d+"),
        "temporary-sibling": (tmp_path / ("c" * 250), r"the name 'c{24}…' is 250 bytes \(plus \d+ for its temporary "
                                                      r"sibling\)"),
        "proc": (Path("/proc/x"), r"--out /proc/x: /proc is on a proc file system \(kernel state, not storage\)"),
        "sys": (Path("/sys/x/y"), r"--out /sys/x/y: /sys(/x)? is on a sysfs file system"),
        "symlink-loop": (loop, r"--out .*loop: cannot resolve it"),
        "root": (Path("/"), r"--out / is the file system's root"),
    }
    if unwritable is not None:
        cases["unwritable"] = (unwritable / "bundle", r"--out .*read-only/bundle: cannot write in .*read-only "
                                                      r"\((Permission denied|Operation not permitted)\)")
    return cases


CASES = ["under-a-file", "300-chars", "temporary-sibling", "proc", "sys", "symlink-loop", "root"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_out_is_refused_before_anything_loads(tmp_path, source, case):
    out, message = _bad_outs(tmp_path)[case]
    with pytest.raises(ExportError, match=message):
        check_out(out)
    with pytest.raises(ExportError, match=message):
        export_bundle(ExportConfig(target=str(source), out=out, quiet=True))


def test_an_unwritable_folder_is_found_by_the_write_probe(tmp_path, source, unwritable):
    out, message = _bad_outs(tmp_path, unwritable)["unwritable"]
    with pytest.raises(ExportError, match=message):
        export_bundle(ExportConfig(target=str(source), out=out, quiet=True))
    assert list(unwritable.iterdir()) == []


@pytest.mark.parametrize("case", [*CASES, "unwritable"])
def test_the_cli_prints_one_error_line_and_exits_2(tmp_path, source, request, case):
    unwritable = request.getfixturevalue("unwritable") if case == "unwritable" else None
    out, message = _bad_outs(tmp_path, unwritable)[case]
    result = CliRunner().invoke(main, ["export", "--target", str(source), "--out", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in result.output


def test_symlinks_resolve_to_where_they_point_and_nothing_is_created(tmp_path):
    """A dangling --out link is where the user wants the bundle: written at its target (whose missing
    folders the export creates), and the temporary folder beside it, so the final rename succeeds."""
    dangling = tmp_path / "current"
    dangling.symlink_to(tmp_path / "disk" / "bundles" / "qwen")
    assert check_out(dangling) == (tmp_path / "disk" / "bundles" / "qwen").resolve()
    existing = tmp_path / "existing"
    existing.mkdir()
    (tmp_path / "link").symlink_to(existing)
    assert check_out(tmp_path / "link") == existing.resolve()
    assert check_out(tmp_path / "new" / "deeper" / "bundle") == (tmp_path / "new" / "deeper" / "bundle").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "existing", "link"]  # the probe left nothing


# ----------------------------------------------------------------------------- sources
def _gguf(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("data, message", [
    (b"GGUF\x03\x00\x00\x00garbagegarbage", r"GGUF file .*cut\.gguf is truncated: 22 bytes, shorter than its 24-byte "
                                             r"header"),
    (b"GGUF", r"GGUF file .*cut\.gguf is truncated: 4 bytes"),
    (b"GGUFgarbagegarbagegarbagegarbage", r"GGUF file .*cut\.gguf declares format version \d+; GGUF versions are "
                                          r"1, 2, 3"),
    (b"LLAMA\x00" + bytes(40), r".*cut\.gguf is not a GGUF file \(it does not start with b'GGUF'\)"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 5) + bytes(100),
     r"GGUF file .*cut\.gguf declares 1099511627776 tensors and 5 metadata entries, which 124 bytes cannot hold"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 0), r"declares 0 tensors"),
], ids=["cut-after-version", "magic-only", "garbage-version", "not-gguf", "counts", "no-tensors"])
def test_a_broken_gguf_is_refused_naming_the_file(tmp_path, data, message):
    path = _gguf(tmp_path / "cut.gguf", data)
    with pytest.raises(ExportError, match=message):
        export_bundle(ExportConfig(target=str(path), out=tmp_path / "bundle", quiet=True))
    result = CliRunner().invoke(main, ["export", "--target", str(path), "--out", str(tmp_path / "b"), "--quiet"])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]  # no bundle, no temporary folder


@pytest.mark.parametrize("role", ["target", "draft"])
def test_missing_and_non_gguf_sources_are_refused_by_role(tmp_path, source, role):
    (tmp_path / "weights.bin").write_bytes(b"\x80\x04")
    for src, message in ((tmp_path / "nowhere", rf"source '.*nowhere' \(--{role}\) is neither an existing path nor "
                                                "a catalog model"),
                         (tmp_path / "weights.bin", rf"--{role} .*weights\.bin is a file but not a \.gguf"),
                         (tmp_path / ("d" * 300), rf"--{role} refused: the name 'd{{24}}…' is 300 bytes")):
        options = {"target": str(src)} if role == "target" else {"target": str(source), "draft": str(src)}
        with pytest.raises(ExportError, match=message):
            export_bundle(ExportConfig(out=tmp_path / "bundle", quiet=True, **options))
    assert not (tmp_path / "bundle").exists()


def test_check_source_passes_what_only_the_loader_can_judge(source):
    check_source(str(source), "target")  # a folder: its files are the loader's to read
    check_source("smollm2-135m-instruct", "target")  # a catalog name: fetched by the loader, not here
    assert os.listdir(source) == ["config.json"]
