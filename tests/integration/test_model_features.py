"""Invariant: a checkpoint's config features are exported exactly, past every edge, or refused by name.

- Sliding windows (Mistral's, Qwen2's per-layer ``max_window_layers``) are applied by both
  attention graphs: greedy decoding far past the window equals transformers' token for
  token, plain and speculative (verify blocks straddle the window edge); in exact mode, or fast
  mode's near-tie promise where this machine's export recorded the graph as not row-invariant.
- The window really matters in these tests: the same weights without a window decode
  differently.
- Dynamic RoPE is exact up to max_position_embeddings and refused past it, naming why.
- Features the graph does not implement are refused by name before any graph is built:
  unknown activations, rope types, and unknown config fields set away from their defaults.
  mlp_bias and gelu activations are implemented, and match transformers.
- A --max-context past the trained context warns, is recorded in the manifest, and the
  export validation straddles that edge.
- The export validation plan reaches every edge with a verify block on top of a cached prefix.
- Bundles of format 1 (before window support) still load, and `specedge info` flags them.
"""

from __future__ import annotations

import json
import warnings

import pytest

from conftest import PROMPT_IDS
from exactness import assert_agrees, exact_holds
from tiny_models import edit_manifest, hf_greedy, load_hf

N_NEW = 40  # PROMPT_IDS (20) + 40 new tokens reach position 60: far past windows of 8 and 16
WINDOW_CONTEXT = 64

WINDOW_CASES = {
    "mistral-w8": ("mistral", {"sliding_window": 8}),
    "mistral-w16": ("mistral", {"sliding_window": 16}),
    # Qwen2 windows only layers >= max_window_layers: layer 0 full, layer 1 windowed.
    "qwen2-w8-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen2-w16": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
}


def _window_bundle(tiny_model, export, case: str, attention: str):
    arch, config = WINDOW_CASES[case]
    folder = tiny_model(arch, seed=3, config=config)
    return folder, export(folder, attention=attention, max_context=WINDOW_CONTEXT)


@pytest.mark.parametrize("attention", ["gqa", "standard"])
@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
def test_sliding_window_greedy_equals_transformers_past_the_window(case, attention, tiny_model, export,
                                                                   load_generator):
    from specedge.bundle.manifest import load_manifest

    folder, bundle = _window_bundle(tiny_model, export, case, attention)
    expected = hf_greedy(load_hf(folder), PROMPT_IDS, N_NEW)
    assert len(expected) == N_NEW, "seed 3 meets no EOS in 40 tokens"
    gen = load_generator(bundle)
    # Exact where this machine's export recorded the graph row-invariant (the standard one is not on every CPU).
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, speculation=False, exact=exact_holds(gen))
    assert plain.token_ids == expected
    arch, config = WINDOW_CASES[case]
    window = config["sliding_window"]
    windows = load_manifest(bundle).target.attention_windows
    first = config.get("max_window_layers", 0)
    assert windows == tuple(window if i >= first else 0 for i in range(2))


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_speculative_verify_blocks_across_the_window_edge_stay_exact(attention, tiny_model, export,
                                                                      load_generator):
    """Self-speculation (draft = target) accepts everything, and every k equals plain decoding."""
    arch, config = WINDOW_CASES["mistral-w8"]
    folder = tiny_model(arch, seed=3, config=config)
    bundle = export(folder, draft=folder, attention=attention, max_context=WINDOW_CONTEXT)
    gen = load_generator(bundle)
    exact = exact_holds(gen)  # the standard graph is not row-invariant on every CPU: there, fast mode's promise
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, speculation=False, exact=exact).token_ids
    for k in (1, 3, 4, 7):
        out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, drafter="model", draft_tokens=k,
                           adaptive=False, exact=exact)
        assert_agrees(gen, PROMPT_IDS, plain, out.token_ids, exact=exact)
        assert out.stats.acceptance == 1.0


def test_a_draft_that_differs_is_corrected_and_output_stays_equal(tiny_model, export, load_generator):
    arch, config = WINDOW_CASES["qwen2-w8-layers"]
    target = tiny_model(arch, seed=3, config=config)
    draft = tiny_model(arch, seed=4, config=config, perturb=(target, 0.6))
    bundle = export(target, draft=draft, max_context=WINDOW_CONTEXT)
    gen = load_generator(bundle)
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, speculation=False, exact=True).token_ids
    out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, drafter="model", draft_tokens=4, adaptive=False,
                       exact=True)
    assert out.token_ids == plain
    assert out.stats.accepted < out.stats.drafted, "the perturbed draft must be corrected at least once"


def test_the_window_changes_the_output_of_these_tests(tiny_model):
    """Without this, a graph that ignored the window could pass the tests above."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tiny_model("mistral", seed=3, config={"sliding_window": 8})
    windowed = hf_greedy(load_hf(folder), PROMPT_IDS, N_NEW)
    full = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, sliding_window=None).eval()
    assert hf_greedy(full, PROMPT_IDS, N_NEW) != windowed


# --------------------------------------------------------------------------- rope


DYNAMIC = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
           "max_position_embeddings": 24}


def test_dynamic_rope_past_max_position_embeddings_is_refused_by_name(tiny_model, export):
    from specedge.errors import InvalidParameterError

    folder = tiny_model("llama", seed=3, config=DYNAMIC)
    with pytest.raises(InvalidParameterError, match=r"max_context 64 exceeds .* 24 .*'dynamic'.*--max-context 24"):
        export(folder, max_context=64)


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_dynamic_rope_is_exact_up_to_max_position_embeddings(attention, tiny_model, export, load_generator):
    folder = tiny_model("llama", seed=3, config=DYNAMIC)
    bundle = export(folder, max_context=24, attention=attention)
    prompt = PROMPT_IDS[:8]
    expected = hf_greedy(load_hf(folder), prompt, 16)
    gen = load_generator(bundle)
    out = gen.generate(input_ids=prompt, max_new_tokens=16, speculation=False, exact=exact_holds(gen))
    assert out.token_ids == expected


@pytest.mark.parametrize("config", [
    {"hidden_act": "gelu"},
    {"hidden_act": "gelu_pytorch_tanh"},
    {"mlp_bias": True},
    {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 256}},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
], ids=["gelu", "gelu-tanh", "mlp-bias", "yarn", "linear"])
def test_implemented_llama_variants_equal_transformers(config, tiny_model, export, load_generator):
    folder = tiny_model("llama", seed=3, config=config)
    bundle = export(folder, max_context=WINDOW_CONTEXT)
    expected = hf_greedy(load_hf(folder), PROMPT_IDS, 24)
    assert load_generator(bundle).generate(input_ids=PROMPT_IDS, max_new_tokens=24,
                                           speculation=False, exact=True).token_ids == expected


@pytest.mark.parametrize("config, message", [
    ({"hidden_act": "tanh"}, r"hidden_act='tanh' is not supported; implemented: silu"),
    # Gemma 4's proportional rope (longrope is implemented: tests/integration/test_families.py).
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     r"rope type 'proportional' is not supported"),
], ids=["activation", "rope-type"])
def test_unimplemented_features_are_refused_by_name_before_any_graph(config, message, tiny_model, tmp_path):
    from specedge.errors import UnsupportedModelError
    from specedge.export.bundle import ExportConfig, export_bundle

    folder = tiny_model("llama", seed=3, config=config)
    out = tmp_path / "refused"
    with pytest.raises(UnsupportedModelError, match=message):
        export_bundle(ExportConfig(target=str(folder), out=out, quiet=True, max_context=64))
    assert not out.exists() and not list(tmp_path.glob(".refused.partial-*"))


def test_unknown_config_fields_are_named_in_a_warning_and_the_manifest(tiny_model, tmp_path):
    """Unknown fields may be metadata; validation to max_context decides (see the next test)."""
    from specedge.export.bundle import ExportConfig, export_bundle
    from specedge.export.features import UnknownConfigFieldWarning

    folder = tiny_model("llama", seed=3, config={"made_up_feature": 3})
    with pytest.warns(UnknownConfigFieldWarning, match=r"field\(s\) made_up_feature are not read by the exporter"):
        manifest = export_bundle(ExportConfig(target=str(folder), out=tmp_path / "b", quiet=True, max_context=64))
    assert manifest.extra.unknown_config_fields == {"target": ("made_up_feature",)}


def test_quantized_checkpoints_are_refused_by_name():
    from transformers import LlamaConfig

    from specedge.errors import UnsupportedModelError
    from specedge.export.features import read_features

    with pytest.raises(UnsupportedModelError, match="quantization_config is set: pre-quantized checkpoints"):
        read_features(LlamaConfig(quantization_config={"quant_method": "gptq", "bits": 4}))


def test_gpt2_inverse_layer_scaling_is_refused_by_name():
    from transformers import GPT2Config

    from specedge.errors import UnsupportedModelError
    from specedge.export.features import read_features

    with pytest.raises(UnsupportedModelError, match="scale_attn_by_inverse_layer_idx=True is not supported"):
        read_features(GPT2Config(scale_attn_by_inverse_layer_idx=True))


def test_every_field_of_the_supported_config_classes_is_declared():
    """The FIELDS table covers every field transformers' own config classes carry."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    from specedge.export.features import FIELDS

    for cls in (LlamaConfig, MistralConfig, Qwen2Config, GPT2Config):
        config = cls()
        missing = set(config.to_dict()) - set(FIELDS[config.model_type])
        assert not missing, f"{cls.__name__}: {sorted(missing)}"


# --------------------------------------------------------------------------- context


def test_context_past_training_warns_is_recorded_and_validated_across(tiny_model, tmp_path):
    from specedge.export.bundle import ExportConfig, export_bundle
    from specedge.export.features import ContextBeyondTrainingWarning

    folder = tiny_model("llama", seed=3, config={"max_position_embeddings": 32})
    with pytest.warns(ContextBeyondTrainingWarning, match="max_context 64 exceeds the 32 positions"):
        manifest = export_bundle(ExportConfig(target=str(folder), out=tmp_path / "b", quiet=True, max_context=64))
    assert "32 positions" in manifest.extra.context_warnings["target"]
    assert "verify across edge 32" in manifest.extra.validation["target:fp32"].max_abs_diff


def test_no_warning_within_the_trained_context(tiny_model, tmp_path):
    from specedge.export.bundle import ExportConfig, export_bundle

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manifest = export_bundle(ExportConfig(target=str(tiny_model("llama")), out=tmp_path / "b", quiet=True,
                                              max_context=64))
    assert manifest.extra.context_warnings == {}


@pytest.mark.parametrize("edges, max_context", [((8,), 64), ((8, 16), 64), ((16, 32), 32), ((4,), 16),
                                                ((600,), 1024)])
def test_validation_plan_straddles_every_edge_on_a_cached_prefix(edges, max_context):
    from specedge.export.validate import validation_plan

    plan = validation_plan(tuple(e for e in edges if e < max_context), max_context)
    length = 0
    for seg in plan:
        assert 0 <= seg.start <= length, "a segment starts inside the cache (after a rewind) or right after it"
        assert seg.end <= max_context
        length = seg.end
    for edge in (e for e in edges if e < max_context):
        blocks = [s for s in plan if s.name == f"verify across edge {edge}"]
        assert len(blocks) == 1 and blocks[0].length == 5 and blocks[0].compare == 5
        block = blocks[0]
        assert block.start > 0, "the verify sits on a cached prefix"
        assert block.start < edge <= block.end - 1 or block.end == max_context - 1


# --------------------------------------------------------------------------- old bundles


def test_format_1_bundles_load_and_info_flags_them(arch_bundle, bundle_copy):
    from click.testing import CliRunner

    from specedge.cli.main import main
    from specedge.bundle.manifest import load_manifest

    bundle = bundle_copy(arch_bundle("llama"))
    edit_manifest(bundle, lambda obj: obj.update(format_version=1))
    assert "before sliding-window support" in load_manifest(bundle).format_notes[0]
    text = CliRunner().invoke(main, ["info", str(bundle)])
    assert text.exit_code == 0 and "warning: format 1 was exported before sliding-window support" in text.output
    described = json.loads(CliRunner().invoke(main, ["info", str(bundle), "--json"]).output)
    assert "re-export" in described["format_notes"][0]


def test_unknown_format_versions_are_refused(arch_bundle, bundle_copy):
    from specedge.errors import ManifestError
    from specedge.bundle.manifest import load_manifest

    bundle = bundle_copy(arch_bundle("llama"))
    edit_manifest(bundle, lambda obj: obj.update(format_version=99))
    with pytest.raises(ManifestError, match=r"format_version 99 is not supported \(this specedge reads versions 1, 2\)"):
        load_manifest(bundle)


def test_info_shows_the_windows(tiny_model, export):
    from click.testing import CliRunner

    from specedge.cli.main import main

    _, bundle = _window_bundle(tiny_model, export, "qwen2-w8-layers", "gqa")
    out = CliRunner().invoke(main, ["info", str(bundle)]).output
    assert "sliding window 8 on 1 of 2 layers" in out
