"""Invariant: ``specedge eval`` measures what export lost, and nothing else.

- an fp32 bundle scores the perplexity of its source in transformers (within 1e-3 relative) and
  agrees with it at every position; an int4 target's perplexity is no lower than its source's;
- export records a short run in the manifest (extra.quality), which round-trips and ``info`` prints;
- the CLI prints both perplexities, their ratio and the agreement (``--json`` schema below);
  ``--no-source`` scores the bundle alone; a source not found here, or an install without the
  export extra, gives a note and the bundle's own score (exit 0), never a traceback; bad input
  is one ``error:`` line and exit 2.
"""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from specedge.cli.main import main
from specedge.bundle.manifest import load_manifest
from specedge.quality.evaluate import EvalText, evaluate_bundle
from test_no_torch import _run
from tiny_models import edit_manifest, word

# 400 tiny-vocabulary words in a fixed, varied order (ids 6..299: no control tokens).
TEXT = " ".join(word(6 + (i * 37 + i * i) % 294) for i in range(400))
SCORE_KEYS = {"positions", "perplexity", "source_perplexity", "perplexity_ratio", "top1_agreement", "kl_divergence"}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("texts") / "words.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def int4_target_bundle(tiny_model, export):
    return export(tiny_model("llama"), precision="int4")


def _invoke(*args):
    return CliRunner().invoke(main, ["eval", *map(str, args)])


def test_an_fp32_bundle_scores_as_its_source(llama_bundle):
    report = evaluate_bundle(llama_bundle, texts=[EvalText("words", TEXT)], chunk=100, threads=1)
    s = report.record.overall
    assert report.notes == () and report.record.source
    assert s.positions == 4 * 99  # 400 tokens, chunks of 100, no BOS rule: each chunk's first is context
    assert s.perplexity == pytest.approx(s.source_perplexity, rel=1e-3)
    assert s.top1_agreement == 1.0
    assert 0.0 <= s.kl_divergence < 1e-5  # one model in two runtimes: float noise only


def _sampled_texts(folder, seeds=(0, 1, 2), length=200) -> list[EvalText]:
    """Texts drawn from the source model itself (temperature 1, seeded), each one chunk long.

    On text drawn from p, no other model q has a lower expected NLL: E_p[-log q] = H(p) + KL(p||q)
    (Gibbs' inequality), so the source must score best. Random words would not say so: a random
    tiny model scores worse than uniform on them, and quantization noise can go either way.
    """
    import torch

    from tiny_models import load_hf

    model = load_hf(folder)
    texts = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        ids = [6 + seed]  # a word: the bundle records no BOS rule, so the text's first token opens the chunk
        with torch.no_grad():
            for _ in range(length - 1):
                probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
                ids.append(int(torch.multinomial(probs, 1, generator=generator)))
        texts.append(EvalText("sampled", " ".join(word(i) for i in ids)))
    return texts


def test_an_int4_target_is_no_better_than_its_source(tiny_model, int4_target_bundle):
    report = evaluate_bundle(int4_target_bundle, texts=_sampled_texts(tiny_model("llama")), threads=1)
    s = report.record.overall
    assert load_manifest(int4_target_bundle).target.precision == "int4"
    assert s.positions == 3 * 199  # every text in one chunk: every token but the first predicted
    assert s.perplexity_ratio >= 1.0
    assert s.top1_agreement < 1.0  # quantization changed some argmaxes
    assert s.kl_divergence > 1e-4  # and every distribution a little


def test_export_records_a_short_eval_that_round_trips_and_info_prints(llama_bundle):
    manifest = load_manifest(llama_bundle)
    record = manifest.extra.quality
    assert record is not None and record.source == manifest.target.source
    assert set(record.kinds) == {"prose", "code", "dialogue", "tool_call"}
    assert record.overall.perplexity_ratio == pytest.approx(1.0, abs=1e-3)
    assert record.overall.top1_agreement == 1.0
    assert load_manifest(llama_bundle).to_json()["extra"]["quality"] == record.to_dict()
    info = CliRunner().invoke(main, ["info", str(llama_bundle)])
    assert info.exit_code == 0
    assert re.search(r"quality: target perplexity [\d.]+ on \d+ tokens of prose, code, dialogue, tool_call, "
                     r"source [\d.]+ \(ratio 1\.0\d+|ratio 0\.99\d+", info.output), info.output


def test_json_reports_both_models_per_kind_and_overall(llama_bundle, text_file):
    result = _invoke(llama_bundle, "--text", text_file, "--chunk", 64, "--json", "--threads", 1)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"bundle", "source", "chunk", "max_tokens", "kinds", "overall", "notes"}
    assert out["chunk"] == 64 and out["max_tokens"] is None and out["notes"] == []
    assert out["source"] == load_manifest(llama_bundle).target.source
    assert set(out["kinds"]) == {"words.txt"}
    for score in (out["kinds"]["words.txt"], out["overall"]):
        assert set(score) == SCORE_KEYS
        assert score["perplexity_ratio"] == pytest.approx(score["perplexity"] / score["source_perplexity"])
        assert score["top1_agreement"] == 1.0


def test_the_table_and_the_built_in_set(llama_bundle):
    result = _invoke(llama_bundle, "--max-tokens", 40, "--threads", 1)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "ppl bundle" in lines[1] and "ppl source" in lines[1] and "top-1 agree" in lines[1] and "KL" in lines[1]
    assert [line.split()[0] for line in lines[2:]] == ["prose", "code", "dialogue", "tool_call", "overall"]
    assert all(re.search(r" 1\.000 +0\.0000$", line) for line in lines[2:])  # fp32: every argmax agrees, no KL
    assert "eval [" in result.stderr  # the progress bar


def test_no_source_scores_the_bundle_alone(llama_bundle, text_file):
    result = _invoke(llama_bundle, "--text", text_file, "--no-source", "--json", "--quiet")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["source"] is None and out["notes"] == []
    assert set(out["overall"]) == {"positions", "perplexity"}
    assert result.stderr == ""


def test_a_source_not_found_here_is_a_note(llama_bundle, bundle_copy, text_file):
    bundle = bundle_copy(llama_bundle)
    edit_manifest(bundle, lambda m: m["models"]["target"].update(source="gguf:elsewhere.Q4_0.gguf"))
    result = _invoke(bundle, "--text", text_file, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["source"] is None and set(out["overall"]) == {"positions", "perplexity"}
    assert "recorded by name only; pass --source" in out["notes"][0]
    assert "note: the source 'gguf:elsewhere.Q4_0.gguf'" in result.stderr
    # --source points at it, and the comparison is back.
    source = load_manifest(llama_bundle).target.source
    out = json.loads(_invoke(bundle, "--text", text_file, "--json", "--source", source).stdout)
    assert out["overall"]["top1_agreement"] == 1.0


@pytest.mark.parametrize("args, message", [
    (("{missing}",), r"error: bundle .*missing-bundle does not exist"),
    (("{bundle}", "--text", "{tmp}/nope.txt"), r"error: text file .*nope.txt' does not exist"),
    (("{bundle}", "--text", "{empty}"), r"error: text file .*empty.txt' is empty"),
    (("{bundle}", "--chunk", "1"), r"error: --chunk must be in \[2, 256\]"),
    (("{bundle}", "--chunk", "257"), r"error: --chunk must be in \[2, 256\] \(the bundle's max_context\)"),
    (("{bundle}", "--max-tokens", "0"), r"error: --max-tokens must be >= 2"),
    (("{bundle}", "--source", "{tmp}/no-model"), r"error: source .*no-model' is neither an existing path"),
    (("{bundle}", "--source", "x", "--no-source"), r"error: --source and --no-source contradict"),
])
def test_bad_input_is_one_error_line_and_exit_2(args, message, llama_bundle, tmp_path):
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    fill = {"missing": tmp_path / "missing-bundle", "bundle": llama_bundle, "tmp": tmp_path,
            "empty": tmp_path / "empty.txt"}
    result = _invoke(*(a.format(**fill) for a in args), "--quiet")
    assert result.exit_code == 2, result.output
    assert re.search(message, result.stderr), result.stderr
    assert "Traceback" not in result.output and result.stderr.count("error:") == 1 and result.stdout == ""


def test_without_the_export_extra_the_bundle_is_scored_alone(llama_bundle, text_file, tmp_path):
    body = f"""
    import json
    from click.testing import CliRunner
    import specedge.cli.main

    result = CliRunner().invoke(specedge.cli.main.main, ["eval", {str(llama_bundle)!r}, "--text",
                                                         {str(text_file)!r}, "--json", "--quiet"])
    print(json.dumps({{"code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr,
                      "leaked": leaked()}}))
    """
    out = _run(("torch", "transformers", "onnx"), body, tmp_path)
    assert out["code"] == 0 and out["leaked"] == [], out
    report = json.loads(out["stdout"])
    assert report["source"] is None and set(report["overall"]) == {"positions", "perplexity"}
    assert "the export extra is not installed" in report["notes"][0]
    assert "note: the export extra is not installed" in out["stderr"] and "Traceback" not in out["stderr"]
