"""The command line's promises under bad input and interruption (issue 20, item 12).

Invariants guarded here:

* click's own usage errors (missing argument, unknown option or command, a value of the
  wrong type) print the README's one line ``error: ...`` and exit 2, not click's
  ``Usage: ... Error:`` block; bare ``specedge`` still prints the help;
* ``export --quiet`` writes nothing at all to stdout or stderr (library progress bars included);
* Ctrl-C during ``export`` exits 130 with ``error: interrupted``, no traceback and no
  half bundle.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from sigint import sigint_default_in_children
from specedge.cli.main import main


@pytest.mark.parametrize("args, message", [
    (["generate"], r"Missing argument 'BUNDLE'"),
    (["generate", "/nowhere"], r"Missing option '--prompt'"),
    (["generate", "/nowhere", "-p", "hi", "--temperature", "warm"], r"'warm' is not a valid float"),
    (["generate", "/nowhere", "-p", "hi", "--drafter", "magic"], r"'magic' is not one of"),
    (["--bogus"], r"No such option '--bogus'"),
    (["nosuch"], r"No such command 'nosuch'"),
    (["serve", "/nowhere", "--port", "99999"], r"99999 is not in the range"),
], ids=["missing-argument", "missing-option", "bad-float", "bad-choice", "group-option", "no-command", "range"])
def test_usage_errors_are_one_error_line_and_exit_2(args, message):
    import re

    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), result.stderr
    assert "Usage:" not in result.output and "Traceback" not in result.output


def test_bare_specedge_still_prints_the_help():
    result = CliRunner().invoke(main, [])
    assert "Usage:" in result.output and "error:" not in result.output


def _specedge(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specedge.cli.main", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_export_quiet_prints_nothing(tiny_model, tmp_path):
    out = tmp_path / "bundle"
    proc = _specedge("export", "--target", str(tiny_model("llama")), "--draft", "self-int4", "--out", str(out),
                     "--max-context", "64", "--quiet", cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr.decode()
    assert (out / "manifest.json").is_file()
    assert stdout == b"" and stderr == b""


def test_ctrl_c_during_export_exits_130_and_leaves_nothing(tiny_model, tmp_path):
    out = tmp_path / "bundle"
    with sigint_default_in_children():  # else a suite started in the background makes the child ignore Ctrl-C
        proc = _specedge("export", "--target", str(tiny_model("llama")), "--draft", "self-int4", "--out", str(out),
                         "--max-context", "64", cwd=tmp_path)
    # Wait for the export to report its first stage, then interrupt it as a terminal would.
    deadline = time.monotonic() + 120
    seen = b""
    while b"[1/" not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen.decode()
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            seen += os.read(proc.stderr.fileno(), 4096)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    stderr = (seen + stderr).decode()
    assert proc.returncode == 130, stderr
    assert stderr.rstrip().endswith("error: interrupted") and "Traceback" not in stderr
    assert not out.exists() and not any(p.name.startswith(".bundle.") for p in tmp_path.iterdir())
