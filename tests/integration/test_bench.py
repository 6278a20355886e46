"""`specedge bench`: the numbers it reports mean what its definitions say.

Guards these invariants:
- speedup is the median of paired per-round ratios, not a ratio of medians;
- inter-token latency per token gives 0 inside a block, per block one gap per block;
- Leviathan's bound and the fitted acceptance follow the formulas in bench/metrics.py;
- any token difference from the baseline is a failure with its first index, except a
  near-tie on a quantized target, which is labelled "near-tie divergence";
- the prompt suite has >= 24 prompts, every category, a source on each, long passages
  for the grounded ones and message lists for the voice ones;
- end to end on a tiny exported bundle: the JSON holds every configuration of every
  workload, matches the schema, and a speculative run equals the baseline (exit 0);
  a divergence makes the command exit 1.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.bench import metrics
from specedge.bench.configs import BenchConfig, expand_configs, parse_config_name
from specedge.bench.progress import Progress
from specedge.runtime.drafters import DRAFTERS
from specedge.bench.report import check_schema, clean, plot, render_markdown, to_json, write_results
from specedge.bench.runner import BenchSettings, RunRecord, check_outputs
from specedge.bench.suite import CATEGORIES, SUITE_PATH, load_suite
from specedge.errors import InvalidParameterError

# ----------------------------------------------------------------------------- pure statistics


def test_speedup_is_the_median_of_paired_ratios_not_a_ratio_of_medians():
    # Round 2 ran on a slow machine for both: the paired ratio is 2x every round.
    spec = [20.0, 10.0, 22.0]
    base = [10.0, 5.0, 11.0]
    assert metrics.median_pairwise_ratio(spec, base) == pytest.approx(2.0)
    # A ratio of medians would mix rounds; with unpaired drift it differs.
    assert metrics.median([20.0, 10.0, 30.0]) / metrics.median([10.0, 12.0, 11.0]) != pytest.approx(
        metrics.median_pairwise_ratio([20.0, 10.0, 30.0], [10.0, 12.0, 11.0]))


def test_pairwise_ratios_skip_zero_denominators_and_refuse_unequal_lengths():
    assert metrics.pairwise_ratios([1.0, 2.0], [0.0, 4.0]) == [0.5]
    with pytest.raises(ValueError, match="equal lengths"):
        metrics.pairwise_ratios([1.0], [1.0, 2.0])
    assert math.isnan(metrics.median_pairwise_ratio([1.0], [0.0]))


def test_percentiles_interpolate_linearly_and_iqr_is_p75_minus_p25():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert metrics.percentile(values, 50) == 3.0
    assert metrics.percentile(values, 95) == pytest.approx(4.8)
    assert metrics.iqr(values) == pytest.approx(2.0)
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError, match="q must be in"):
        metrics.percentile(values, 101)


def test_token_gaps_are_zero_inside_a_block_and_block_gaps_count_blocks():
    # Blocks: [t0] at 0.1, [t1 t2 t3] at 0.3, [t4] at 0.6.
    times = [0.1, 0.3, 0.3, 0.3, 0.6]
    assert metrics.token_gaps(times) == pytest.approx([0.2, 0.0, 0.0, 0.3])
    assert metrics.block_gaps(times) == pytest.approx([0.2, 0.3])
    assert metrics.token_gaps([0.5]) == [] and metrics.block_gaps([0.5]) == []


def test_leviathan_formula():
    # (1 - 0.8^5) / ((1 - 0.8)(4 * 0.1 + 1.2)) = 0.67232 / 0.32
    assert metrics.leviathan_speedup(0.8, 4, 0.1, 1.2) == pytest.approx(0.67232 / 0.32)
    assert metrics.leviathan_speedup(1.0, 4, 0.0, 1.0) == pytest.approx(5.0)  # all accepted, free draft
    assert metrics.leviathan_speedup(0.0, 4, 0.1, 1.2) == pytest.approx(1 / 1.6)  # nothing accepted
    with pytest.raises(ValueError):
        metrics.leviathan_speedup(1.5, 4, 0.1, 1.0)


def test_predicted_speedup_mixes_steps_and_reduces_to_leviathan_for_one_k():
    v = {4: 1.2, 2: 1.1}
    assert metrics.predicted_speedup(0.8, {4: 10}, 0.1, v) == pytest.approx(metrics.leviathan_speedup(0.8, 4, 0.1, 1.2))
    assert metrics.predicted_speedup(0.5, {0: 7}, 0.1, v) == pytest.approx(1.0)  # plain steps only
    mixed = metrics.predicted_speedup(0.8, {4: 1, 0: 1}, 0.1, v)
    assert mixed == pytest.approx((metrics.expected_tokens(0.8, 4) + 1) / (0.4 + 1.2 + 1))


def test_fit_acceptance_recovers_an_iid_rate():
    a = 0.7
    drafted = [1000] * 6
    accepted = [round(1000 * a ** (i + 1)) for i in range(6)]
    assert metrics.fit_acceptance(drafted, accepted) == pytest.approx(a, abs=2e-3)
    assert metrics.fit_acceptance([5, 5], [0, 0]) == 0.0
    assert metrics.fit_acceptance([5, 5], [5, 5]) == 1.0
    assert math.isnan(metrics.fit_acceptance([], []))


def _run(config: str, tokens: list[int], *, round_: int = 0, near_ties: int = 0, workload: str = "w") -> RunRecord:
    return RunRecord(workload=workload, category="code", config=config, round=round_, tokens=tokens,
                     token_times_s=[0.1 * i for i in range(len(tokens))], tokens_per_s=10.0, new_tokens=len(tokens),
                     finish_reason="length", ttft_s=0.1, prefill_s=0.1, draft_s=0.0, verify_s=0.0, overhead_s=0.0,
                     total_s=1.0, steps=1, drafted=0, accepted=0, drafted_per_position=[],
                     accepted_per_position=[], k_chosen={}, near_ties=near_ties, mode_s={}, rss_peak_mb=1.0)


def _gaps(gap: float, threshold: float = 0.5):
    """An explain() stand-in: every divergence measures ``gap`` against ``threshold``."""
    from specedge.runtime.divergence import Divergence, first_divergence

    def explain(workload, ref, other):
        i = first_divergence(ref, other)
        return Divergence(i, (ref[i], other[i]), gap, gap < threshold, threshold)
    return explain


def test_any_difference_from_the_baseline_outside_a_near_tie_is_a_failure_with_its_first_index():
    runs = [_run("baseline", [5, 6, 7, 8]), _run("model-k4", [5, 6, 7, 8]), _run("ngram-k2", [5, 6, 9, 8]),
            _run("baseline", [5, 6, 7, 8], round_=1)]
    failures = check_outputs(runs, set(), _gaps(3.0))
    assert [(f["config"], f["first_divergence"], f["kind"]) for f in failures] == [("ngram-k2", 2, "divergence")]
    assert failures[0]["baseline_token"] == 7 and failures[0]["config_token"] == 9
    assert failures[0]["top2_gap"] == 3.0 and failures[0]["reference"] == "baseline"


def test_a_nondeterministic_baseline_repeat_is_a_failure_too():
    runs = [_run("baseline", [5, 6, 7]), _run("baseline", [5, 1, 7], round_=1)]
    assert [(f["config"], f["round"]) for f in check_outputs(runs, set(), _gaps(3.0))] == [("baseline", 1)]


def test_a_fast_mode_divergence_is_excused_only_at_a_measured_near_tie():
    runs = [_run("baseline", [5, 6, 7]), _run("model-k4", [5, 6, 1])]
    assert check_outputs(runs, set(), _gaps(0.1))[0]["kind"] == "near-tie divergence"
    assert check_outputs(runs, set(), _gaps(0.9))[0]["kind"] == "divergence"


def test_exact_runs_must_equal_exact_plain_decoding_even_at_a_near_tie():
    runs = [_run("baseline", [5, 6, 7]), _run("baseline-exact", [5, 6, 8]), _run("model-k4-exact", [5, 6, 8]),
            _run("ngram-k2-exact", [5, 6, 7])]
    failures = check_outputs(runs, {"baseline-exact", "model-k4-exact", "ngram-k2-exact"}, _gaps(0.1))
    kinds = {f["config"]: (f["reference"], f["kind"]) for f in failures}
    # exact plain vs fast plain: a near tie; an exact run vs exact plain: any difference fails
    assert kinds == {"baseline-exact": ("baseline", "near-tie divergence"),
                     "ngram-k2-exact": ("baseline-exact", "divergence")}


# ----------------------------------------------------------------------------- configurations


def test_config_names_and_expansion():
    assert parse_config_name("model-k4") == BenchConfig("model-k4", "model", 4)
    assert parse_config_name("ngram-adaptive").adaptive
    assert not parse_config_name("baseline").speculative
    with pytest.raises(InvalidParameterError, match="unknown bench configuration"):
        parse_config_name("medusa-k4")
    configs, notes = expand_configs(None, has_draft=True, max_draft_tokens=8)
    assert configs[0].name == "baseline" and len(configs) == 1 + len(DRAFTERS) * 5  # k 2/4/6/8 + adaptive each
    configs, notes = expand_configs(None, has_draft=False, max_draft_tokens=8)
    assert [c.name for c in configs] == ["baseline"] + [
        f"{d}-{k}" for d in DRAFTERS if not DRAFTERS[d].needs_draft_model
        for k in ("k2", "k4", "k6", "k8", "adaptive")]
    assert "suffix-k4" in [c.name for c in configs]
    assert any("no draft model" in n for n in notes)
    configs, notes = expand_configs("model-k6,ngram-k2", has_draft=True, max_draft_tokens=4)
    assert [c.name for c in configs] == ["baseline", "ngram-k2"] and "max_draft_tokens" in notes[0]


def test_generation_configs_force_what_the_name_says():
    base = BenchConfig("baseline").generation_config(32)
    assert base.speculation is False and base.max_new_tokens == 32
    fixed = parse_config_name("composite-k6").generation_config(32, chat=False)
    assert (fixed.drafter, fixed.draft_tokens, fixed.adaptive, fixed.chat) == ("composite", 6, False, False)
    adaptive = parse_config_name("model-adaptive").generation_config(32)
    assert adaptive.adaptive is True and adaptive.draft_tokens is None
    # Each run is a cold request: no configuration inherits the previous one's prompt or draft cache.
    assert not any(c.reuse_prefix for c in (base, fixed, adaptive))


# ----------------------------------------------------------------------------- the prompt suite


def test_the_suite_ships_at_least_24_prompts_in_every_category_each_with_a_source():
    suite = load_suite()
    assert SUITE_PATH.is_file()
    assert len(suite.workloads) >= 24
    assert {w.category for w in suite.workloads} == set(CATEGORIES)
    assert all(w.source == "written for specedge" for w in suite.workloads)
    assert len({w.id for w in suite.workloads}) == len(suite.workloads)


def test_grounded_prompts_carry_a_long_passage_and_voice_prompts_are_multi_turn():
    suite = load_suite()
    grounded = [w for w in suite.workloads if w.category == "grounded"]
    assert {w.kind for w in grounded} >= {"summarise", "edit", "extract"}
    assert all(len(w.prompt.split()) >= 150 for w in grounded)
    voice = [w for w in suite.workloads if w.category == "voice"]
    assert voice and all(w.messages and sum(m["role"] == "user" for m in w.messages) >= 2 for w in voice)
    hostile = {w.kind for w in suite.workloads if w.category == "hostile"}
    assert hostile >= {"random tokens", "other language"}


def test_suite_selection_takes_the_first_n_per_category(tmp_path):
    suite = load_suite()
    chosen = suite.select(["grounded", "code"], 2)
    assert [w.category for w in chosen] == ["grounded", "grounded", "code", "code"]
    with pytest.raises(InvalidParameterError, match="unknown workload"):
        suite.select(["poetry"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompts": [{"id": "x", "category": "code", "prompt": "p"}]}))
    with pytest.raises(InvalidParameterError, match="'source'"):
        load_suite(bad)


def test_a_repeated_question_comes_along_with_its_first_occurrence(tmp_path):
    suite = load_suite()
    repeats = [w for w in suite.workloads if w.repeat_of]
    assert repeats and all(w.category == "repeat" for w in repeats)
    # --prompts 1 on `repeat` used to pick one cold question and never its return.
    assert [w.id for w in suite.select(["repeat"], 1)] == ["repeat-hours", "repeat-hours-again"]
    two = [w.id for w in suite.select(["repeat"], 2)]
    assert two == ["repeat-hours", "repeat-price", "repeat-hours-again", "repeat-price-again"]
    everything = suite.select(["repeat"])
    assert len(everything) == len([w for w in suite.workloads if w.category == "repeat"])
    for w in everything:
        if w.repeat_of:
            original = next(o for o in everything if o.id == w.repeat_of)
            assert original.messages == w.messages  # the same question, asked again
            assert everything.index(original) < everything.index(w)

    def write(prompts):
        path = tmp_path / "suite.json"
        path.write_text(json.dumps({"prompts": prompts}))
        return path

    first = {"id": "a", "category": "repeat", "source": "s", "prompt": "p"}
    with pytest.raises(InvalidParameterError, match="'repeat_of' must name an earlier prompt"):
        load_suite(write([{**first, "id": "b", "repeat_of": "a"}, first]))
    with pytest.raises(InvalidParameterError, match="'repeat_of' must name an earlier prompt of the same category"):
        load_suite(write([{**first, "category": "chat"}, {**first, "id": "b", "repeat_of": "a"}]))
    with pytest.raises(InvalidParameterError, match="not another repeat"):
        load_suite(write([first, {**first, "id": "b", "repeat_of": "a"}, {**first, "id": "c", "repeat_of": "b"}]))


def test_progress_bar_writes_to_its_stream_only_when_enabled():
    stream = io.StringIO()
    bar = Progress(4, stream=stream, every=2)
    for _ in range(4):
        bar.advance("x")
    assert "4/4" in stream.getvalue() and "[####" in stream.getvalue()
    quiet = io.StringIO()
    Progress(4, stream=quiet, enabled=False).advance("x")
    assert quiet.getvalue() == ""


def test_json_is_strict_nan_becomes_null():
    assert json.loads(to_json({"a": math.nan, "b": [math.inf, 1.0], 3: "x"})) == {"a": None, "b": [None, 1.0],
                                                                                   "3": "x"}
    assert clean((1, 2)) == [1, 2]


# ----------------------------------------------------------------------------- end to end on a tiny bundle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random Llama (vocab 300, WordLevel tokenizer) exported with an int4 self-draft."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specedge.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("bench")
    hf = root / "hf"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      eos_token_id=1, bos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t2"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", bos_token="t0",
                                         unk_token="t2").save_pretrained(hf)
    bundle = root / "bundle"
    export_bundle(ExportConfig(target=str(hf), out=bundle, draft="self-int4", max_context=1024, quiet=True))
    return {"root": root, "hf": hf, "bundle": bundle}


def _bench(args: list[str], env: dict | None = None):
    from specedge.cli.main import main

    return CliRunner().invoke(main, ["bench", *args], env=env, catch_exceptions=False)


@pytest.fixture(scope="module")
def quick_run(tiny):
    out = tiny["root"] / "results"
    out.mkdir()
    json_path = tiny["root"] / "quick.json"
    result = _bench([str(tiny["bundle"]), "--quick", "--json", str(json_path), "--out", str(out), "--no-progress"])
    return result, json.loads(json_path.read_text()), out


def test_quick_bench_runs_every_config_on_every_workload_without_failures(quick_run):
    result, doc, _ = quick_run
    assert result.exit_code == 0, result.output
    check_schema(doc)
    expected = {"baseline"} | {f"{d}-{v}" for d in DRAFTERS for v in ("k4", "adaptive")}
    assert set(doc["settings"]["configs"]) == expected
    assert set(doc["workloads"]) == set(CATEGORIES)
    for category, entry in doc["workloads"].items():
        assert set(entry["configs"]) == expected
        # One prompt per category; in `repeat` it comes with its return (repeat_of).
        assert all(c["runs"] == (2 if category == "repeat" else 1) for c in entry["configs"].values())
        assert entry["configs"]["baseline"]["speedup"] == pytest.approx(1.0)
    assert doc["failures"] == [] and doc["summary"]["exit_code"] == 0
    # The micro-benchmark measured every verify length a k up to max_draft_tokens needs.
    assert set(doc["step_costs"]["target_s"]) >= {str(n) for n in range(1, 10)}
    assert doc["step_costs"]["c_model"] > 0
    # Spread over the bench: at least one repetition before each prompt's rounds; v is paired to the 1-token step.
    assert doc["step_costs"]["reps"] >= len(doc["settings"]["prompts"])
    assert doc["step_costs"]["v"]["0"] == pytest.approx(1.0)


def test_quick_bench_reports_leviathan_next_to_the_measurement(quick_run):
    _, doc, _ = quick_run
    cell = doc["workloads"]["grounded"]["configs"]["model-k4"]
    b = cell["bound"]
    assert b["predicted"] == pytest.approx(metrics.predicted_speedup(
        b["a"], {int(k): n for k, n in cell["k_chosen"].items()}, b["c"], {int(k): x for k, x in b["v"].items()}))
    assert b["efficiency"] == pytest.approx(cell["speedup"] / b["predicted"])


def test_markdown_table_and_results_files(quick_run):
    result, doc, out = quick_run
    assert "| config | tok/s (IQR) | speedup |" in result.output
    assert "## grounded" in result.output and "token for token" in result.output
    md = sorted(out.glob("*.md"))
    js = sorted(out.glob("*.json"))
    assert len(md) == 1 and len(js) == 1 and md[0].name == f"{doc['date']}-bundle.md"
    text = md[0].read_text()
    assert doc["machine"]["cpu"] in text and "onnxruntime" in text and "specedge bench" in text
    assert json.loads(js[0].read_text())["command"] == doc["command"]


def test_rendered_failures_are_listed_with_their_first_divergence(quick_run):
    _, doc, _ = quick_run
    broken = json.loads(json.dumps(doc))
    broken["failures"] = [{"workload": "code-py-dataclass", "category": "code", "config": "model-k4", "round": 0,
                           "first_divergence": 7, "baseline_token": 3, "config_token": 4, "near_ties": 0,
                           "reference": "baseline", "top2_gap": 1.25, "near_tie_gap": 0.5,
                           "kind": "divergence"}]
    broken["summary"]["failures"] = 1
    text = render_markdown(broken)
    assert "FAILED: 1" in text
    assert "| code-py-dataclass | model-k4 | 0 | baseline | 7 | 3 vs 4 | 1.2500 | 0.5000 | divergence |" in text
    check_schema(broken)
    with pytest.raises(InvalidParameterError, match="step_costs"):
        check_schema({k: v for k, v in doc.items() if k != "step_costs"})


def test_bare_json_flag_prints_only_json_to_stdout(tiny):
    result = _bench([str(tiny["bundle"]), "--quick", "--json", "--no-progress", "--workloads", "voice",
                     "--configs", "ngram-k2"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["settings"]["configs"] == ["baseline", "ngram-k2"] and list(doc["workloads"]) == ["voice"]


def test_a_divergence_makes_the_bench_exit_non_zero(tiny, monkeypatch):
    from specedge.bench import runner

    def fake_check(runs, exact_configs, explain):
        spec = next(r for r in runs if r.config != "baseline")
        return [{"workload": spec.workload, "category": spec.category, "config": spec.config, "round": 0,
                 "first_divergence": 0, "baseline_token": 1, "config_token": 2, "near_ties": 0,
                 "kind": "divergence"}]

    monkeypatch.setattr(runner, "check_outputs", fake_check)
    result = _bench([str(tiny["bundle"]), "--quick", "--no-progress", "--workloads", "chat", "--configs", "ngram-k4"])
    assert result.exit_code == 1
    assert "FAILED: 1 run(s) differ from their baseline outside a near tie" in result.output


def test_hf_peer_on_the_same_checkpoint_gives_our_tokens_and_absent_peers_are_skipped(tiny, tmp_path):
    pytest.importorskip("transformers")
    # The tiny target doubles as its own HF assistant, so assisted generation must also give our tokens.
    result = _bench([str(tiny["bundle"]), "--quick", "--json", "--no-progress", "--workloads", "code,voice",
                     "--configs", "ngram-k4", "--peers", "hf,llamacpp,nosuch", "--hf-target", str(tiny["hf"]),
                     "--hf-draft", str(tiny["hf"])],
                    env={"SPECEDGE_CACHE": str(tmp_path), "OMP_WAIT_POLICY": "PASSIVE"})
    assert result.exit_code == 0, result.output
    peers = json.loads(result.stdout)["peers"]
    hf = peers["hf"]["configs"]
    # Plus hf-plain@own-threads(n) where torch's default thread count differs from this box's CPU count.
    assert {"hf-plain", "hf-prompt-lookup", "hf-assisted"} <= set(hf)
    assert all(name.startswith("hf-plain@own-threads(") for name in set(hf) - {"hf-plain", "hf-prompt-lookup",
                                                                              "hf-assisted"})
    for cells in hf.values():
        assert set(cells) == {"code", "voice"}
        for cell in cells.values():
            assert cell["same_text"] == 1.0  # fp32 torch vs fp32 ORT on the same weights
            assert cell["ratio_baseline"] is not None and cell["ratio_best"] is not None
    assert "skipped" in peers["llamacpp"] and "unknown peer" in peers["nosuch"]["skipped"]


def test_a_peer_whose_default_thread_count_differs_also_runs_plain_at_its_own_default(tiny, monkeypatch):
    """The thread count is the setting the bench shares with a peer: where the peer's own default
    differs, its plain decoding also runs at that default, so the report gives our ratio both ways."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from specedge.bench import peers
    from specedge.bundle.manifest import load_manifest

    calls: list[int] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # torch's own default on some box
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # record, leave this process's pool alone
    ctx = peers.PeerContext(1, {"hf_target": str(tiny["hf"])}, load_manifest(tiny["bundle"]))
    session = peers.setup_hf(ctx, Progress(0, enabled=False))
    own = peers.own_threads_config("hf-plain", 3)
    assert own == "hf-plain@own-threads(3)" and own in session.configs and session.info["default_threads"] == 3
    job = peers.Job("w", "code", list(range(6, 20)), 6, [])
    calls.clear()
    shared, default = session.generate(job, "hf-plain", 6), session.generate(job, own, 6)
    assert calls == [1, 3]  # each configuration runs at its own thread count
    assert default.tokens == shared.tokens  # the same model: the thread count changes speed only


def test_genai_default_threads_copy_unsets_the_thread_count_and_links_the_weights(tmp_path):
    from specedge.bench import peers

    model = tmp_path / "m-int4"
    model.mkdir()
    (model / "model.onnx").write_bytes(b"weights")
    (model / "genai_config.json").write_text(json.dumps(
        {"model": {"decoder": {"session_options": {"intra_op_num_threads": 2, "log_id": "x"}}}}))
    copy = peers._genai_default_threads_copy(model)
    options = json.loads((copy / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert options == {"log_id": "x"}
    assert (copy / "model.onnx").is_symlink() and (copy / "model.onnx").read_bytes() == b"weights"
    assert json.loads((model / "genai_config.json").read_text())["model"]["decoder"]["session_options"][
        "intra_op_num_threads"] == 2  # the original is untouched


def test_a_self_draft_has_no_hf_checkpoint_and_gguf_sources_map_to_the_cache(tmp_path, monkeypatch):
    from specedge.bench import peers

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    assert peers.hf_folder(None, "self-int4 of gguf:m.Q4_1.gguf") is None
    converted = tmp_path / "converted" / "m.Q4_1-0123456789abcdef"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    assert peers.hf_folder(None, "gguf:m.Q4_1.gguf") == converted
    gguf = tmp_path / "models" / "m" / "m.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    assert peers.gguf_file(None, "gguf:m.Q4_1.gguf") == gguf
    with pytest.raises(peers.PeerSkipped, match="not an HF model folder"):
        peers.hf_folder(str(tmp_path), "")


class _Notes:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, line: str) -> None:
        self.lines.append(line)


def test_genai_is_built_from_a_gguf_converted_on_demand_or_found_by_name(tmp_path, monkeypatch):
    """With no converted folder cached, the genai peer converts the bundle's GGUF file once (the exporter's
    cache folder); a genai model already built from that folder needs only its name, not a new conversion;
    with no GGUF file at hand it is skipped and says what to pass."""
    from specedge.bench import peers
    from specedge.export import loader

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    with pytest.raises(peers.PeerSkipped, match="no HF checkpoint for the target .*--hf-target"):
        peers.genai_source(None, "gguf:m.Q4_1.gguf", ("int4",), _Notes())
    gguf = tmp_path / "models" / "m" / "m.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    named = loader.converted_cache_dir(gguf)
    conversions = []

    def fake_load_gguf(path, *, quiet=False, into=None):
        conversions.append(path)
        named.mkdir(parents=True)
        (named / "config.json").write_text("{}")
        return named, f"gguf:{path.name}"

    monkeypatch.setattr(loader, "load_gguf", fake_load_gguf)
    built = peers.genai_model_dir(named, "int4")
    built.mkdir(parents=True)
    (built / "genai_config.json").write_text("{}")
    notes = _Notes()
    assert peers.genai_source(None, "gguf:m.Q4_1.gguf", ("int4",), notes) == named
    assert conversions == [] and not named.exists()  # the built model is found by the folder's name
    assert peers.genai_source(None, "gguf:m.Q4_1.gguf", ("int4", "fp32"), notes) == named  # fp32 is not built
    assert conversions == [gguf] and (named / "config.json").is_file()
    assert any("converting m.Q4_1.gguf to an HF folder" in line for line in notes.lines)
    assert peers.genai_source(None, "gguf:m.Q4_1.gguf", ("fp32",), notes) == named  # converted once
    assert conversions == [gguf]


def test_plot_needs_matplotlib_and_says_how_to_get_it(quick_run, tmp_path, monkeypatch):
    _, doc, _ = quick_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(InvalidParameterError, match=r"pip install 'specedge\[plot\]'"):
        plot(doc, tmp_path / "p.png")


def test_plot_draws_speedup_vs_k_and_acceptance_per_position(quick_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, doc, _ = quick_run
    path = plot(doc, tmp_path / "p.png")
    assert path.stat().st_size > 1000


def test_plot_bars_are_the_reported_speedups(quick_run):
    """The picture shows the table's numbers: one bar per (configuration, workload), its height
    the median paired speedup from the results document."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specedge.bench.report import _plot_speedup_bars, clean

    _, doc, _ = quick_run
    doc = clean(doc)
    fig, ax = plt.subplots()
    _plot_speedup_bars(ax, doc)
    configs = [n for n in doc["settings"]["configs"] if n != "baseline"]
    expected = [doc["workloads"][c]["configs"][n]["speedup"] or 0.0 for n in configs for c in doc["workloads"]]
    assert [round(b.get_height(), 9) for b in ax.patches] == [round(v, 9) for v in expected]
    plt.close(fig)


def test_write_results_to_a_stem(quick_run, tmp_path):
    _, doc, _ = quick_run
    md, js = write_results(doc, tmp_path / "sub" / "run.json")
    assert md == tmp_path / "sub" / "run.md" and js.is_file()


def test_peers_run_with_the_environment_unchanged(monkeypatch):
    """No environment setting slows a peer: the bench sets no OpenMP wait policy (or anything else)."""
    import os

    from specedge.bench.peers import run_peers

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    before = dict(os.environ)
    out = run_peers(BenchSettings(Path("unused"), peers=("nope",)), None, [], [], {}, log=Progress(0, enabled=False))
    assert "unknown peer" in out["nope"]["skipped"]
    assert dict(os.environ) == before


# A stand-in peer worker speaking bench/peer_worker.py's protocol: it answers the handshake and
# its first generation, then dies of SIGSEGV on the second, as llama.cpp's AMX matmul did.
FAKE_WORKER = """
import json, os, signal, sys
init = json.loads(sys.stdin.readline())
print(json.dumps({"configs": ["fake-plain"], "info": {"build": "FAKE_BUILD=1"}, "notes": []}), flush=True)
for i, line in enumerate(sys.stdin):
    if i == 1:
        print("ggml_backend_amx_mul_mat: about to crash", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    job = json.loads(line)["job"]
    print(json.dumps({"tokens": job["reference"], "times": [0.01 * (j + 1) for j in range(len(job["reference"]))]}),
          flush=True)
"""


@pytest.fixture
def segfaulting_peer(tmp_path, monkeypatch):
    from specedge.bench import peers

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(peers, "_worker_command", lambda: [sys.executable, str(script)])


def test_a_peer_that_segfaults_is_reported_as_crashed_with_its_signal_and_stderr(segfaulting_peer):
    from types import SimpleNamespace

    from specedge.bench.peers import run_peers

    workloads = [(SimpleNamespace(id=f"w{i}", category="code"), [6, 7, 8], False) for i in range(3)]
    ours = [SimpleNamespace(workload=f"w{i}", config="baseline", round=0, tokens=[9, 10, 11]) for i in range(3)]
    events = []
    settings = BenchSettings(Path("unused"), peers=("llamacpp",), peer_repeats=1, threads=1)
    out = run_peers(settings, None, workloads, ours, {}, Progress(0, enabled=False), on_event=events.append)
    crash = out["llamacpp"]["crashed"]
    assert crash["signal"] == "SIGSEGV" and crash["returncode"] == -11
    assert crash["stderr_tail"][-1] == "ggml_backend_amx_mul_mat: about to crash"
    assert len(out["llamacpp"]["runs"]) == 1  # the run finished before the crash is kept
    assert any("DGGML_AMX_INT8=OFF" in note for note in out["llamacpp"]["notes"])
    assert [e["run"]["workload"] for e in events if "run" in e] == ["w0"]
    assert events[-1]["outcome"]["crashed"]["signal"] == "SIGSEGV"


def test_a_peer_crash_keeps_our_results_and_the_partial_file_has_every_run(tiny, segfaulting_peer, tmp_path):
    from specedge.bench.report import partial_results_path
    from specedge.bench.runner import BenchSettings, PartialLog, run_bench

    partial = partial_results_path(tmp_path / "out", tiny["bundle"])
    settings = BenchSettings(bundle=tiny["bundle"], categories=("code", "chat"), per_category=1,
                             max_new_tokens=8, repeats=1, configs="ngram-k2", warmup_tokens=4, micro_reps=1,
                             peers=("llamacpp",), progress=False, partial_path=partial)
    doc = run_bench(settings)
    check_schema(doc)
    assert doc["peers"]["llamacpp"]["crashed"]["signal"] == "SIGSEGV"
    assert "CRASHED (SIGSEGV)" in render_markdown(doc)
    events = [json.loads(line) for line in partial.read_text().splitlines()]
    runs = [e for e in events if e["event"] == "run"]
    # Written as they happened: every specedge run (2 prompts x 2 configs), then the peer's.
    assert len(runs) == 4 and {r["config"] for r in runs} == {"baseline", "ngram-k2"}
    assert events[0]["event"] == "start" and events[-1]["event"] == "peer"
    assert events[-1]["outcome"]["crashed"]["signal"] == "SIGSEGV"
    PartialLog(None)({"event": "ignored"})  # no path: nothing written, nothing raised


def test_baseline_is_one_row_plain_decoding_and_exact_configurations_bring_exact_plain_decoding():
    assert parse_config_name("baseline").generation_config(8).exact is False
    assert parse_config_name("baseline-exact").generation_config(8).exact is True
    exact = parse_config_name("model-k4-exact")
    assert exact.speculative and exact.draft_tokens == 4 and exact.generation_config(8).exact
    assert parse_config_name("ngram-adaptive-pipelined-exact").mode == "pipelined"
    with pytest.raises(InvalidParameterError, match="'baseline-1row' is now 'baseline'"):
        parse_config_name("baseline-1row")
    configs, _ = expand_configs("ngram-k2,model-k4-exact", has_draft=True, max_draft_tokens=8)
    assert [c.name for c in configs] == ["baseline", "baseline-exact", "ngram-k2", "model-k4-exact"]
    configs, _ = expand_configs("ngram-k2", has_draft=True, max_draft_tokens=8)
    assert [c.name for c in configs] == ["baseline", "ngram-k2"]


_REC = dict(workload="w", category="code", round=0, token_times_s=[], tokens_per_s=1.0, new_tokens=3,
            finish_reason="length", ttft_s=0.0, prefill_s=0.0, draft_s=0.0, verify_s=0.0, overhead_s=0.0,
            total_s=1.0, steps=3, drafted=0, accepted=0, drafted_per_position=[], accepted_per_position=[],
            k_chosen={}, near_ties=0, mode_s={}, rss_peak_mb=0.0)


def test_draft_window_suffix_names_a_window():
    """``-w<N>`` sets the draft window (``-w0``: the whole history); without it, the runtime default."""
    from specedge.runtime.options import DEFAULT_DRAFT_WINDOW

    assert parse_config_name("model-adaptive-w0").generation_config(16).draft_window is None
    assert parse_config_name("model-k2-w16").generation_config(16).draft_window == 16
    assert parse_config_name("composite-k2-pipelined-w32").mode == "pipelined"
    assert parse_config_name("model-k2").generation_config(16).draft_window == DEFAULT_DRAFT_WINDOW
    with pytest.raises(InvalidParameterError, match=r"'model-k2-w3': the draft window \(-w0 = the whole history\) must be an integer in \(4, "):
        parse_config_name("model-k2-w3")


def test_the_default_policys_steps_by_source_are_aggregated_and_shown():
    """``sources`` sums the default policy's lookup / guess / model / plain steps over a cell's runs
    (guesses are lookups too: counted once, as guesses); other configurations get none."""
    from specedge.bench.report import _sources
    from specedge.bench.runner import aggregate

    base = RunRecord(**{**_REC, "config": "baseline", "tokens": [1, 2, 3]})
    runs = [RunRecord(**{**_REC, "config": "auto-adaptive", "tokens": [1, 2, 3], "steps": 10, "lookup_steps": 4,
                         "guess_steps": 1, "model_steps": 2}),
            RunRecord(**{**_REC, "config": "auto-adaptive", "tokens": [1, 2, 3], "steps": 10, "lookup_steps": 2,
                         "guess_steps": 2, "model_steps": 0})]
    cell = aggregate(runs, {("w", 0): base})
    assert cell["sources"] == {"lookup": 3, "guess": 3, "model": 2, "plain": 12}
    assert _sources(cell["sources"]) == "15/15/10/60"
    assert aggregate([base], {("w", 0): base})["sources"] == {} and _sources({}) == ""


def test_what_a_token_cost_by_step_source_is_aggregated_and_shown():
    """``ms_per_token``: per source, the cell's step seconds over the tokens they committed (any
    configuration); the column shows lookup/model/plain with "-" for a source no step had."""
    from specedge.bench.report import _by_source_ms
    from specedge.bench.runner import aggregate

    base = RunRecord(**{**_REC, "config": "baseline", "tokens": [1, 2, 3], "source_s": {"plain": 0.2},
                        "source_tokens": {"plain": 4}})
    runs = [RunRecord(**{**_REC, "config": "suffix-adaptive", "tokens": [1, 2, 3],
                         "source_s": {"lookup": 0.1, "plain": 0.05}, "source_tokens": {"lookup": 4, "plain": 1}}),
            RunRecord(**{**_REC, "config": "suffix-adaptive", "tokens": [1, 2, 3],
                         "source_s": {"lookup": 0.2}, "source_tokens": {"lookup": 6}})]
    cell = aggregate(runs, {("w", 0): base})
    assert cell["ms_per_token"] == pytest.approx({"lookup": 30.0, "plain": 50.0})
    assert _by_source_ms(cell["ms_per_token"]) == "30/-/50"
    assert aggregate([base], {("w", 0): base})["ms_per_token"] == {"plain": 50.0}
    assert _by_source_ms({}) == ""


def test_bench_bound_prints_each_workloads_bounds_and_writes_its_files(tiny, tmp_path):
    """`specedge bench bound` on the tiny bundle: every selected workload has its bounds, ordered as
    an oracle's must be (more sources or free verifies never bound lower), and per-position counts
    with one entry per reply token."""
    out = tmp_path / "bound"
    result = _bench(["bound", str(tiny["bundle"]), "--workloads", "repeat,agent", "--prompts", "2", "--reps", "2",
                     "--max-new-tokens", "12", "--no-progress", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert set(doc["categories"]) == {"repeat", "agent"}
    assert doc["has_draft_model"] and doc["prices"]["v"][0] == 1.0 and doc["prices"]["c"] > 0
    assert doc["measured"]["draft_prefill_token_s"] > 0  # the draft's prompt prefill is priced, not free
    assert list(doc["prices"]["v"]) == sorted(doc["prices"]["v"])  # a longer verify never costs less
    for cell in doc["categories"].values():
        bound = cell["bound"]
        assert bound["lookup"] >= 1.0 - 1e-9 and bound["model"] >= 1.0 - 1e-9
        assert bound["both"] >= max(bound["lookup"], bound["model"]) - 1e-9
        assert bound["both_free_verify"] >= bound["both"] - 1e-9
    for prompt in doc["prompts"]:
        assert len(prompt["lookup_right"]) == len(prompt["lookup_offered"]) == len(prompt["model_right"]) == prompt["tokens"]
        assert all(r <= o for r, o in zip(prompt["lookup_right"], prompt["lookup_offered"]))
    assert all(0.0 <= cell["model_right"] <= 1.0 for cell in doc["categories"].values())
    assert "| repeat |" in out.with_suffix(".md").read_text() and json.loads(out.with_suffix(".json").read_text())


def test_bench_bound_refuses_a_missing_bundle_by_name(tmp_path):
    from specedge.cli.main import main

    result = CliRunner().invoke(main, ["bench", "bound", str(tmp_path / "nope")])
    assert result.exit_code != 0
    assert "nope" in result.output
    # A bad option is refused by name before any bundle is read.
    result = CliRunner().invoke(main, ["bench", "bound", str(tmp_path / "nope"), "--draft-window", "2"])
    assert result.exit_code == 2 and "--draft-window" in result.output and "nope" not in result.output


def test_bench_bound_model_counts_equal_the_draft_models_own_greedy_steps(tiny):
    """The teacher-forced forward says, at each reply position, what a 1-token draft step there
    would propose: the bound counts the drafts the model drafter would really make."""
    import numpy as np

    from specedge.bench.bound import model_correct
    from specedge.runtime.generator import Generator

    gen = Generator.from_bundle(tiny["bundle"])
    ids = [5, 17, 42, 99, 7, 3]
    reply = list(gen.generate(input_ids=ids, max_new_tokens=16, speculation=False).token_ids)
    cache = gen.draft.new_cache()
    logits = gen.draft.forward(np.asarray(ids, np.int64), cache, 1)
    stepped, clear = [], []
    for token in reply:
        index = int(np.argmax(logits[-1]))
        stepped.append((index if gen.draft_head_ids is None else int(gen.draft_head_ids[index])) == token)
        top2 = np.sort(logits[-1])[-2:]
        # A batched and a 1-row forward agree to ~1e-7 here (AVX-512 EPYC); near ties below 1e-3 are
        # left out, so another CPU's kernels cannot flip what is compared.
        clear.append(top2[1] - top2[0] > 1e-3)
        logits = gen.draft.forward(np.asarray([token], np.int64), cache, 1)
    counted = model_correct(gen.draft, gen.draft_head_ids, ids, reply)
    assert sum(clear) >= len(reply) // 2
    assert [c for c, ok in zip(counted, clear) if ok] == [s for s, ok in zip(stepped, clear) if ok]
