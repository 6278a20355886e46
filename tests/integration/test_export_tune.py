"""``export --tune --exact`` on a quantized target and its quantized draft: the block size is measured and chosen on
this machine (the target's with exact steps required, the draft's without: its tokens are verified)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specedge.bundle.extra import MachineFingerprint
from specedge.cli.main import main
from specedge.export.tune import CANDIDATE_BLOCKS, choose
from specedge.bundle.manifest import load_manifest

from tiny_models import PROMPT_IDS


@pytest.fixture(scope="module")
def tuned_bundle(tiny_model, export):
    # exact=True: tuned for exact mode (2-row plain steps equal to verify rows), what the tests below decode in
    return export(tiny_model("llama"), draft="self-int4", precision="int4", tune_block_size=True, exact=True)


def _block_sizes(graph) -> set[int]:
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    return {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}


def test_the_tuned_target_is_quantized_at_the_recorded_choice(tuned_bundle):
    manifest = load_manifest(tuned_bundle)
    tuning = manifest.extra.quant_tuning["target"]
    assert [c.block_size for c in tuning.candidates] == list(CANDIDATE_BLOCKS)
    assert tuning.chosen == choose(tuning.candidates)
    assert _block_sizes(tuned_bundle / manifest.target.graph) == {tuning.chosen}
    for c in tuning.candidates:
        assert c.exact_step_ms > 0 and c.verify_ms > 0 and 0 <= c.greedy_agreement <= 1
    # Whatever the CPU, the shipped graph keeps exact steps wherever the default block has them.
    default = min(tuning.candidates, key=lambda c: c.block_size)
    assert tuning.candidate(tuning.chosen).bit_identical or not default.bit_identical
    assert manifest.extra.exact_steps["target"].bit_identical == tuning.candidate(tuning.chosen).bit_identical
    assert tuning.machine == MachineFingerprint.here(0)
    assert tuning.positions > 0
    # Only the chosen graph is in the bundle: the candidates' scratch folders are gone.
    assert sorted(p.name for p in (tuned_bundle / "target").iterdir()) == ["model.onnx", "model.onnx.data"]
    assert not [p for p in tuned_bundle.iterdir() if p.name.startswith(".")]


def test_the_tuned_draft_is_quantized_at_its_own_choice_without_requiring_exactness(tuned_bundle):
    from specedge.export.mixquant import WIDE_INT8_BLOCK

    manifest = load_manifest(tuned_bundle)
    tuning = manifest.extra.quant_tuning["draft"]
    assert tuning.step_rows == 1 and manifest.extra.quant_tuning["target"].step_rows == 2
    assert [c.block_size for c in tuning.candidates] == list(CANDIDATE_BLOCKS)
    assert tuning.chosen == choose(tuning.candidates, require_exact=False)
    # a draft's 8-bit layers take the wide block even in an exact export (its rows never reach the output)
    assert _block_sizes(tuned_bundle / manifest.draft.graph) == {tuning.chosen, max(tuning.chosen, WIDE_INT8_BLOCK)}
    default = min(tuning.candidates, key=lambda c: c.block_size)
    assert tuning.candidate(tuning.chosen).greedy_agreement >= default.greedy_agreement
    out = CliRunner().invoke(main, ["info", str(tuned_bundle)])
    line = next(l for l in out.output.splitlines() if "draft block size" in l)
    assert "1-row step" in line and "not exact" not in line


def test_a_tuned_bundle_decodes_exactly(tuned_bundle, load_generator):
    from specedge.runtime.options import GenerationConfig

    gen = load_generator(tuned_bundle)
    plain = gen.generate(input_ids=PROMPT_IDS, config=GenerationConfig(max_new_tokens=24, speculation=False,
                                                                      exact=True))
    spec = gen.generate(input_ids=PROMPT_IDS, config=GenerationConfig(max_new_tokens=24, drafter="ngram",
                                                                     draft_tokens=3, exact=True))
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 1
    by_model = gen.generate(input_ids=PROMPT_IDS, config=GenerationConfig(max_new_tokens=24, drafter="model",
                                                                         draft_tokens=3, adaptive=False, exact=True))
    assert by_model.token_ids == plain.token_ids


def test_info_says_what_was_chosen_and_where(tuned_bundle, monkeypatch):
    tuning = load_manifest(tuned_bundle).extra.quant_tuning["target"]
    out = CliRunner().invoke(main, ["info", str(tuned_bundle)])
    assert out.exit_code == 0, out.output
    line = next(l for l in out.output.splitlines() if "target block size" in l)
    assert f"block size: {tuning.chosen}, chosen by export --tune on {tuning.machine.describe()}" in line
    assert "tuned elsewhere" not in line

    taken = tuning.machine
    for cpu, isa, cores in (("Other CPU 9000", taken.isa, taken.cores), (taken.cpu, "some_future_isa", taken.cores)):
        # Another model, or the same model name with other vector extensions (two "AMD EPYC" VMs).
        monkeypatch.setattr(MachineFingerprint, "here", classmethod(lambda cls, threads, c=cpu, i=isa, n=cores:
                                                                     cls(c, n, threads, i)))
        out = CliRunner().invoke(main, ["info", str(tuned_bundle)])
        line = next(l for l in out.output.splitlines() if "target block size" in l)
        assert f"tuned elsewhere: this machine is {cpu} ({isa}), {cores} cores (the bundle runs as is" in line

    described = json.loads(CliRunner().invoke(main, ["info", str(tuned_bundle), "--json"]).output)
    assert described["extra"]["quant_tuning"]["target"]["chosen"] == tuning.chosen


@pytest.mark.parametrize("exact", [False, True])
def test_an_explicit_block_size_is_not_tuned(tiny_model, export, exact):
    from specedge.export.mixquant import WIDE_INT8_BLOCK

    bundle = export(tiny_model("llama"), precision="int4", block_size=64, exact=exact)
    manifest = load_manifest(bundle)
    assert manifest.extra.quant_tuning == {}
    # the mix's 8-bit layers take the wide block in a fast-mode export, the chosen block in an exact one
    assert _block_sizes(bundle / manifest.target.graph) == ({64} if exact else {64, WIDE_INT8_BLOCK})


def test_the_cli_tunes_the_block_only_without_an_explicit_block_size(tiny_model, tmp_path, monkeypatch):
    import specedge.cli.main as cli

    seen = []
    monkeypatch.setattr("specedge.export.bundle.export_bundle", lambda config: seen.append(config) or
                        (_ for _ in ()).throw(SystemExit(0)))
    folder = str(tiny_model("llama"))
    for extra, tuned, block in (([], False, 32), (["--tune"], True, 32), (["--tune", "--block-size", "128"], False, 128)):
        CliRunner().invoke(cli.main, ["export", "--target", folder, "--precision", "int4",
                                      "--out", str(tmp_path / "b"), *extra])
        assert (seen[-1].tune_block_size, seen[-1].block_size) == (tuned, block)


def test_fp32_targets_have_nothing_to_tune(tiny_model, export):
    bundle = export(tiny_model("llama"), tune_block_size=True)
    assert load_manifest(bundle).extra.quant_tuning == {}


def test_tuning_fits_a_small_context(tiny_model, export):
    bundle = export(tiny_model("llama"), precision="int4", tune_block_size=True, max_context=32)
    tuning = load_manifest(bundle).extra.quant_tuning["target"]
    assert tuning.positions == 5 * 16  # five calibration prompts, half the context each


def test_greedy_references_of_a_truncated_head_are_token_ids(tiny_model, export, tmp_path):
    """A --draft-vocab head's logit columns are not token ids: the tuning's references map each argmax column
    through the head's ids before feeding it back (and agreement compares token ids)."""
    import shutil

    import numpy as np

    from specedge.engines.ort import OrtEngine
    from specedge.export.tune import greedy_agreement, greedy_references

    bundle = tmp_path / "b"
    shutil.copytree(export(tiny_model("llama"), draft="self-int4", precision="int4", draft_vocab=64), bundle)
    entry = load_manifest(bundle, verify_checksums=False).draft
    # columns -> token ids that differ from the column numbers, as a real tokenizer's head ids do
    ids = np.sort(np.random.default_rng(0).choice(np.arange(3, 300), entry.head_size, replace=False)).astype("<i4")
    ids.tofile(bundle / entry.head_tokens)
    graph = bundle / entry.graph
    prompts = [np.array(PROMPT_IDS, np.int64)]
    [reference] = greedy_references(entry, graph, prompts)
    assert set(reference.tolist()) <= set(ids.tolist())
    engine, kv, expected = OrtEngine(entry, graph), None, []
    kv = engine.new_cache()
    logits = engine.forward(prompts[0], kv)
    for _ in range(len(reference)):
        expected.append(int(ids[int(np.argmax(logits[-1]))]))
        logits = engine.forward(np.array([expected[-1]], np.int64), kv)
    assert reference.tolist() == expected
    assert greedy_agreement(entry, graph, prompts, [reference]) == 1.0
