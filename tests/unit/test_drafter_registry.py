"""Invariant: a drafter is one module plus one registry entry (runtime/drafters.py).

Every place that names drafters learns them from the registry: the CLI's ``--drafter`` choices
and help, the server's ``specedge.drafter``, the bench's configuration names, the manifest's
``speculation.drafter``, and GenerationConfig. The test registers a new name in the registry
alone (in a fresh interpreter, before anything else is imported) and checks that each of them
accepts it, and that "needs a draft model" is read from the entry.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tiny_models import manifest_json

BODY = textwrap.dedent('''
    import json
    from types import SimpleNamespace

    import specedge.runtime.drafters as registry

    # The one edit a new drafter makes outside its own module: its registry entry. (The module
    # is an existing one here: this test is about names, not about what the drafter proposes.)
    registry.DRAFTERS["echo"] = registry._entry("ngram_drafter", needs_draft_model=False, help="an echo drafter")
    registry.DRAFTERS["echo-model"] = registry._entry("model_drafter", needs_draft_model=True, help="echo, drafted")
    registry.DRAFTER_CHOICES = (registry.NO_DRAFTER, *registry.DRAFTERS)

    from click.testing import CliRunner

    from specedge.bench.configs import expand_configs, parse_config_name
    from specedge.cli.main import main
    from specedge.errors import ManifestError
    from specedge.bundle.manifest import parse_manifest
    from specedge.runtime.loading import check_speculation
    from specedge.runtime.options import GenerationConfig
    from specedge.server.protocol import APIError, parse_request

    out = {}
    out["config"] = GenerationConfig(drafter="echo").drafter
    help_text = CliRunner().invoke(main, ["generate", "--help"], terminal_width=200).output
    out["cli_help"] = "echo" in help_text and "an echo drafter" in help_text
    bad = CliRunner().invoke(main, ["generate", "no-bundle", "--drafter", "nope"])
    out["cli_refuses"] = "echo" in bad.output and bad.exit_code == 2
    ok = CliRunner().invoke(main, ["generate", "no-bundle", "--drafter", "echo"])
    out["cli_accepts"] = "Invalid value for '--drafter'" not in ok.output

    fake = SimpleNamespace(encode_prompt=lambda input_ids=None, **kw: list(input_ids), max_context=64, draft=None)
    parsed = parse_request("completion", {"prompt": [1, 2, 3], "specedge": {"drafter": "echo"}}, fake,
                           model_name="m")
    out["server"] = parsed.config.drafter
    try:
        parse_request("completion", {"prompt": [1, 2, 3], "specedge": {"drafter": "echo-model"}}, fake,
                      model_name="m")
    except APIError as exc:
        out["server_needs_draft"] = str(exc)

    out["bench"] = parse_config_name("echo-k4").drafter
    configs, notes = expand_configs(None, has_draft=False, max_draft_tokens=8, k_sweep=(2,))
    out["bench_all"] = [c.name for c in configs]
    out["bench_notes"] = notes

    manifest = json.loads(MANIFEST)
    manifest["speculation"]["drafter"] = "echo"
    out["manifest"] = parse_manifest(manifest).speculation.drafter
    manifest["speculation"]["drafter"] = "echo-model"
    parsed_manifest = parse_manifest(manifest)  # the format checks the spelling; loading, the registry
    try:
        check_speculation(parsed_manifest)
    except ManifestError as exc:
        out["manifest_needs_draft"] = str(exc)
    print(json.dumps(out))
''')


def test_cli_server_bench_and_manifest_learn_drafter_names_from_the_registry():
    script = f"MANIFEST = {json.dumps(json.dumps(manifest_json()))}\n{BODY}"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["config"] == "echo"
    assert out["cli_help"] and out["cli_refuses"] and out["cli_accepts"]
    assert out["server"] == "echo"
    assert "drafter 'echo-model' needs a draft model" in out["server_needs_draft"]
    assert out["bench"] == "echo"
    assert {"echo-k2", "echo-adaptive"} <= set(out["bench_all"])
    assert "echo-model-k2" not in out["bench_all"] and any("echo-model-k2" in n for n in out["bench_notes"])
    assert out["manifest"] == "echo"
    assert "'speculation.drafter' is 'echo-model' but the bundle has no models.draft" in out["manifest_needs_draft"]
