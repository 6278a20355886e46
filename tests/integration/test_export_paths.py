"""Export's --out and source checks, end to end (issue #41 item 6; the checks themselves are unit-tested
in tests/unit/test_export_preflight.py).

- A dangling symlink as ``--out`` used to run the whole export and then fail in the final rename
  (a folder cannot replace a symlink). It names where the bundle goes: the bundle is written at the
  link's target (missing folders created), the link keeps pointing at it, the bundle loads through
  it, and no temporary folder is left on either side.
- A GGUF whose fixed header is sound but whose body is garbage gets past the header check and is
  refused by the loader as an ExportError naming the file: one ``error:`` line, exit status 2.
"""

from __future__ import annotations

import struct

from click.testing import CliRunner

from conftest import PROMPT_IDS
from specedge.cli.main import main
from specedge.export.bundle import ExportConfig, export_bundle


def test_a_dangling_out_symlink_gets_the_bundle_at_its_target(tiny_model, tmp_path):
    from specedge.runtime.generator import Generator

    link = tmp_path / "current"
    target = tmp_path / "disk" / "bundles" / "tiny"
    link.symlink_to(target)
    export_bundle(ExportConfig(target=str(tiny_model("llama")), out=link, max_context=64, quiet=True))
    assert link.is_symlink() and (target / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "disk"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]  # no .tiny.partial-PID left
    reply = Generator.from_bundle(link, threads=1).generate(input_ids=PROMPT_IDS, max_new_tokens=4)
    assert len(reply.token_ids) == 4


def test_a_gguf_with_a_sound_header_and_a_broken_body_is_an_export_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + b"\xff" * 200)
    result = CliRunner().invoke(main, ["export", "--target", str(broken), "--out", str(tmp_path / "bundle"),
                                       "--quiet"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot read GGUF file {broken}: "), result.stderr
    assert not (tmp_path / "bundle").exists()
