"""Invariant: the edge install runs without torch, transformers or onnx; the manifest and fetch need only the stdlib.

A fresh interpreter installs a meta-path finder that makes ``import torch`` (and
transformers, onnx) raise ImportError, then imports the runtime, the ORT engine,
the CLI and the ``specedge.export`` package, and runs a full speculative
generation on a bundle the parent process exported, through the API and the CLI.
A second interpreter also blocks numpy and reads a manifest and the fetch module.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

BLOCKER = """
import sys

class _Blocked:
    '''Refuse every import of the named top-level packages.'''

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ImportError(f"import of {{name!r}} is blocked: this code path must not need it")
        return None

BLOCKED = {blocked!r}
sys.meta_path.insert(0, _Blocked(BLOCKED))

def leaked():
    return sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
"""


def _run(blocked: tuple[str, ...], body: str, tmp_path) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(BLOCKER.format(blocked=blocked) + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_runtime_engine_and_cli_run_without_torch(int4_bundle, load_generator, tmp_path):
    body = f"""
    import json
    try:
        import torch  # noqa: F401
        raise SystemExit("the blocker did not block torch")
    except ImportError:
        pass

    import specedge
    import specedge.export  # the package itself: no torch until an export runs
    import specedge.export.bundle  # ExportConfig is importable; torch loads only inside export_bundle
    import specedge.engines.ort
    import specedge.runtime.generator
    import specedge.cli.main
    from click.testing import CliRunner
    from specedge.runtime.generator import Generator

    gen = Generator.from_bundle({str(int4_bundle)!r}, threads=1)
    spec = gen.generate(input_ids=list(range(6, 26)), max_new_tokens=20, draft_tokens=4, exact=True)
    base = gen.generate(input_ids=list(range(6, 26)), max_new_tokens=20, speculation=False, exact=True)
    cli = CliRunner().invoke(specedge.cli.main.main, ["generate", {str(int4_bundle)!r}, "-p", "w010 w011",
                                                      "--max-new-tokens", "8", "--json", "--threads", "1",
                                                      "--exact"])
    assert cli.exit_code == 0, cli.output
    print(json.dumps({{"spec": spec.token_ids, "base": base.token_ids, "drafted": spec.stats.drafted,
                      "cli": json.loads(cli.stdout)["token_ids"], "leaked": leaked()}}))
    """
    out = _run(("torch", "transformers", "onnx"), body, tmp_path)
    assert out["leaked"] == []
    gen = load_generator(int4_bundle)
    expected = gen.generate(input_ids=list(range(6, 26)), max_new_tokens=20, speculation=False, exact=True).token_ids
    assert out["base"] == out["spec"] == expected
    assert out["drafted"] > 0
    assert out["cli"] == gen.generate("w010 w011", max_new_tokens=8, exact=True).token_ids


def test_manifest_and_fetch_need_only_the_standard_library(int4_bundle, tmp_path):
    body = f"""
    import json
    import specedge.errors
    import specedge.bundle.manifest
    import specedge.export.catalog
    import specedge.export.fetch
    manifest = specedge.bundle.manifest.load_manifest({str(int4_bundle)!r})  # sha256 of every file included
    print(json.dumps({{"models": sorted(manifest.models()), "catalog": sorted(specedge.export.catalog.CATALOG),
                      "leaked": leaked()}}))
    """
    out = _run(("numpy", "torch", "transformers", "onnx", "onnxruntime", "tokenizers"), body, tmp_path)
    assert out["leaked"] == []
    assert out["models"] == ["draft", "target"]
    assert "smollm2-135m-instruct" in out["catalog"]
