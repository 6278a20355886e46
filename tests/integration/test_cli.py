"""Invariant: the CLI only parses and calls, so it gives the API's results and clean errors.

Every command's --help exits 0 and documents each of its options; ``info``
describes and verifies a bundle (text and JSON); ``generate --json`` returns the
same token ids as the Python API, with and without speculation; ``export``
writes a loadable bundle; typed errors become one "error:" line and exit code 2,
never a traceback.
"""

from __future__ import annotations

import json
import re

import click
import pytest
from click.testing import CliRunner

from specedge import __version__
from specedge.cli.main import main
from specedge.bundle.manifest import load_manifest

PROMPT = "w010 w011 w012 w013"


def _invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# --------------------------------------------------------------------------- help


def test_top_level_help_lists_every_command():
    result = _invoke("--help")
    assert result.exit_code == 0
    for name in main.commands:
        assert name in result.output
    assert {"fetch", "export", "generate", "info", "demo"} <= set(main.commands)


def test_version():
    result = _invoke("--version")
    assert result.exit_code == 0 and __version__ in result.output


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command under ``group``, nested groups' subcommands included, keyed by its words."""
    found = {}
    for name, command in group.commands.items():
        found[prefix + (name,)] = command
        if isinstance(command, click.Group):
            found.update(_commands(command, prefix + (name,)))
    return found


@pytest.mark.parametrize("words", sorted(_commands(main)), ids=" ".join)
def test_every_command_help_mentions_all_its_options(words):
    command = _commands(main)[words]
    result = _invoke(*words, "--help")
    assert result.exit_code == 0, result.output
    assert f"Usage: main {' '.join(words)}" in result.output or f"Usage: specedge {' '.join(words)}" in result.output
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            assert param.help, f"`{' '.join(words)}` option {param.opts[0]} has no help text"
            for opt in param.opts + param.secondary_opts:
                assert opt in result.output, f"`{' '.join(words)} --help` does not mention {opt}"


def test_bench_is_a_group_whose_bare_form_runs_the_benchmark():
    assert {"run", "variants", "threads"} <= set(main.commands["bench"].commands)
    bare = _invoke("bench", "--help").output
    assert "specedge bench BUNDLE" in bare and "variants" in bare and "threads" in bare
    # A bundle path (or an option) first is the benchmark: its own usage error, not "no such command".
    result = CliRunner().invoke(main, ["bench", "--quick"])
    assert result.exit_code == 2 and "bench run" in result.output and "Missing argument 'BUNDLE'" in result.output
    assert "No such command" not in result.output


def test_bench_variants_refuses_unknown_variant_names(tmp_path):
    result = CliRunner().invoke(main, ["bench", "variants", "--target", "t", "--draft", "d", "--work",
                                       str(tmp_path / "w"), "--targets", "int4-b32-acc4,int3"])
    assert result.exit_code == 2
    assert "error: --targets: unknown variant(s) int3; known: int4-b32-acc4," in result.output
    assert not (tmp_path / "w").exists()


def test_generate_help_names_the_speculation_options():
    out = _invoke("generate", "--help").output
    for opt in ("--max-new-tokens", "--no-speculation", "--draft-tokens", "--drafter", "--json", "--stop"):
        assert opt in out


# --------------------------------------------------------------------------- info


def test_info_text(int4_bundle):
    result = _invoke("info", int4_bundle)
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"bundle {int4_bundle}" in out
    assert "target llama fp32: 2 layers, 4 heads (2 kv) x 16, vocab 300, max_context 256" in out
    assert "draft  llama int4" in out
    assert "speculation: drafter auto" in out
    assert "checksums: all files verified" in out
    # 2 layers x K,V x 256 positions x 2 kv heads x 16 x 4 bytes = 131072 bytes per model
    assert "conversation cache: 0.3 MB per slot (target 0.1 MB + draft 0.1 MB at max_context 256); " \
           "4 slots 1.0 MB" in out
    assert "1 slot 0.3 MB" in _invoke("info", int4_bundle, "--cache-slots", "1").output
    skipped = _invoke("info", int4_bundle, "--no-verify-checksums")
    assert "checksums: skipped" in skipped.output


def test_info_json_is_the_manifest(int4_bundle):
    result = _invoke("info", int4_bundle, "--json")
    assert result.exit_code == 0
    described = json.loads(result.output)
    assert described.pop("conversation_cache") == {"target_bytes": 131072, "draft_bytes": 131072,
                                                   "slot_bytes": 262144, "max_context": 256, "slots": 4,
                                                   "total_bytes": 4 * 262144}
    assert described == load_manifest(int4_bundle).to_json()


# --------------------------------------------------------------------------- generate


def _generate_json(bundle, *args):
    result = _invoke("generate", bundle, "--prompt", PROMPT, "--json", "--threads", "1", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("args, api", [
    ((), {}),
    (("--no-speculation",), {"speculation": False}),
    (("-k", "3"), {"draft_tokens": 3}),
    (("--drafter", "ngram", "-k", "2"), {"drafter": "ngram", "draft_tokens": 2}),
    (("--raw",), {"chat": False}),
    (("--drafter", "ngram", "--min-ngram", "1", "--max-ngram", "4"), {"drafter": "ngram", "min_ngram": 1,
                                                                      "max_ngram": 4}),
    (("-k", "2", "--draft-window", "8"), {"draft_tokens": 2, "draft_window": 8}),
    (("-k", "2", "--draft-window", "0"), {"draft_tokens": 2, "draft_window": None}),
    (("--temperature", "0.8", "--seed", "5", "-k", "2"), {"temperature": 0.8, "seed": 5, "draft_tokens": 2}),
])
def test_generate_json_equals_the_api(args, api, int4_bundle, load_generator):
    out = _generate_json(int4_bundle, "--max-new-tokens", "16", "--exact", *args)
    expected = load_generator(int4_bundle).generate(PROMPT, max_new_tokens=16, exact=True, **api)
    assert out["token_ids"] == expected.token_ids
    assert out["text"] == expected.text
    assert out["finish_reason"] == expected.finish_reason
    assert out["prompt_tokens"] == len(expected.prompt_ids)
    if "--no-speculation" in args:
        assert out["stats"]["drafted"] == 0 and out["stats"]["drafter"] == "none"


def test_generate_speculative_equals_no_speculation(int4_bundle):
    spec = _generate_json(int4_bundle, "--max-new-tokens", "24", "-k", "4", "--exact")
    base = _generate_json(int4_bundle, "--max-new-tokens", "24", "--no-speculation", "--exact")
    assert spec["token_ids"] == base["token_ids"]
    assert spec["stats"]["drafted"] > 0


def test_generate_plain_stream_and_stats(int4_bundle, load_generator):
    expected = load_generator(int4_bundle).generate(PROMPT, max_new_tokens=10, exact=True).text
    plain = _invoke("generate", int4_bundle, "-p", PROMPT, "--max-new-tokens", "10", "--threads", "1", "--exact")
    assert plain.exit_code == 0 and plain.stdout == expected + "\n"
    streamed = _invoke("generate", int4_bundle, "-p", PROMPT, "--max-new-tokens", "10", "--stream", "--stats",
                       "--threads", "1", "--exact")
    assert streamed.exit_code == 0 and streamed.stdout == expected + "\n"
    assert "10 tokens" in streamed.stderr and "finish length" in streamed.stderr
    assert re.search(r"draft catch-up \d+ tokens in \d+ ms \(\d+ steps kept plain", streamed.stderr)


def test_demo_on_an_existing_bundle_compares_plain_with_the_default_drafter(int4_bundle, load_generator):
    """`specedge demo --out BUNDLE` skips the fetch and export: the baseline is plain decoding, the
    speculative run is the default drafter (what `generate` runs); with --exact both give the same
    tokens, and by default (fast mode) they may part only at a measured near tie."""
    result = _invoke("demo", "--out", int4_bundle, "--prompt", PROMPT, "--max-new-tokens", "16", "--json", "--exact")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    expected = load_generator(int4_bundle).generate(PROMPT, max_new_tokens=16, speculation=False,
                                                    exact=True).token_ids
    assert out["identical"] is True and out["exact"] is True and out["divergence"] is None
    assert out["baseline"]["token_ids"] == out["speculative"]["token_ids"] == expected
    assert out["baseline"]["stats"]["drafter"] == "none" and out["speculative"]["stats"]["drafter"] == "auto"
    text = _invoke("demo", "--out", int4_bundle, "--prompt", PROMPT, "--max-new-tokens", "16", "--exact")
    assert text.exit_code == 0 and "identical tokens: yes" in text.stdout and "tokens by source:" in text.stdout
    fast = _invoke("demo", "--out", int4_bundle, "--prompt", PROMPT, "--max-new-tokens", "16", "--json")
    assert fast.exit_code == 0, fast.output
    fast = json.loads(fast.stdout)
    assert fast["exact"] is False
    assert fast["identical"] or fast["divergence"]["near_tie"], fast["divergence"]


def test_export_command_writes_a_loadable_bundle(tiny_model, tmp_path):
    out = tmp_path / "cli-bundle"
    result = _invoke("export", "--target", tiny_model("gpt2"), "--out", out, "--max-context", "64", "--quiet",
                     "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["out"] == str(out)
    assert "target:fp32" in report["validation"]
    assert load_manifest(out).target.architecture == "gpt2"
    again = _invoke("export", "--target", tiny_model("gpt2"), "--out", out, "--quiet")
    assert again.exit_code == 2 and "already exists; pass --overwrite" in again.stderr


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("args, message", [
    (("generate", "{missing}", "-p", "hi"), r"error: bundle .*missing-bundle does not exist"),
    (("info", "{missing}"), r"error: bundle .*missing-bundle does not exist"),
    (("generate", "{bundle}", "-p", PROMPT, "--top-p", "0"), r"error: top_p must be a number in \(0, 1\]; got 0.0"),
    (("generate", "{bundle}", "-p", PROMPT, "--max-new-tokens", "0"), r"error: max_new_tokens must be an integer in \[1, "),
    (("generate", "{bundle}", "-p", PROMPT, "--draft-window", "3"), r"error: draft_window must be an integer in \(4, "),
    (("generate", "{bundle}", "-p", PROMPT, "--min-ngram", "4"), r"error: n-gram sizes need"),
    (("generate", "{bundle}", "-p", PROMPT, "--max-ngram", "1000000000"), r"error: max_ngram must be an integer "
                                                                          r"in \[1, 64\]; got 1000000000"),
    (("generate", "{bundle}", "-p", PROMPT, "--threads", "2147483648"), r"error: thread counts must be integers "
                                                                        r"in \[0, \d+\]"),
    (("generate", "{bundle}", "-p", PROMPT, "--provider", "cuda"), r"error: execution provider 'cuda'"),
    (("export", "--target", "{missing}", "--out", "{tmp}/x", "--quiet"), r"error: source .* is neither an "
                                                                        r"existing path nor a catalog model"),
    (("fetch", "no-such-model"), r"error: unknown catalog model 'no-such-model'"),
])
def test_typed_errors_exit_2_with_one_line_and_no_traceback(args, message, llama_bundle, tmp_path):
    import re

    from specedge.engines.ort import available_providers

    if "cuda" in args and "cuda" in available_providers():
        pytest.skip("this onnxruntime has CUDA")
    fill = {"missing": tmp_path / "missing-bundle", "bundle": llama_bundle, "tmp": tmp_path}
    result = CliRunner().invoke(main, [a.format(**fill) for a in args])
    assert result.exit_code == 2, result.output
    assert re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.output
    assert result.stderr.count("error:") == 1
    assert result.stdout == ""


def test_usage_errors_are_clicks(llama_bundle):
    result = CliRunner().invoke(main, ["generate", str(llama_bundle)])  # --prompt missing
    assert result.exit_code == 2 and "Missing option '--prompt'" in result.stderr


def test_info_refuses_a_drafter_that_loading_refuses(int4_bundle, tmp_path):
    """A well-spelled drafter the registry does not know passes the format's check; info, which
    validates the bundle, refuses it as loading does (one error line, exit 2)."""
    import shutil

    copy = tmp_path / "bundle"
    shutil.copytree(int4_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["speculation"]["drafter"] = "telepathy"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["info", str(copy), "--no-verify-checksums"])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "speculation.drafter" in result.output and "telepathy" in result.output
