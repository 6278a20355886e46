"""Invariant: every supported architecture family exports exactly, in both attention graphs, or is refused by name.

For each family's tiny random checkpoint (2 layers, hidden 64, norms and biases perturbed away
from their HF initial values so a dropped term shows; see tiny_models.build_model):

- greedy decoding of the exported bundle equals transformers' ``generate`` token for token, past
  every sliding window, with the fused GroupQueryAttention graph and with the standard one;
- speculation (the bundle's self-int4 draft, and the n-gram drafter) equals plain decoding, both in
  exact mode; where this machine's export recorded the graph as not row-invariant (exact mode is
  refused there), both run in fast mode and may differ only at a near tie (tests/exactness.py);
- each feature a family turns on really changes the logits of these checkpoints: the same export
  with that one DecoderSpec field or weight dropped fails export validation (so the equality above
  is not vacuous);
- every field of each family's transformers config class is declared in its builder's table;
- MoE families are refused by name, with what they would take.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPT_IDS
from exactness import assert_agrees, exact_holds
from tiny_models import HEADS, HIDDEN, hf_greedy, load_hf

N_NEW = 40  # PROMPT_IDS (20) + 40 new tokens reach position 60: past windows of 8
CONTEXT = 64
WINDOW = 8
_HD = HIDDEN // HEADS


def _longrope(rotary_dim: int, original: int) -> dict:
    """Phi-3-style longrope parameters: distinct short and long factors per frequency."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}


# case -> (model_type, config overrides). Each family's first case is its default shape; later
# ones cover its variants. max_position_embeddings stays above CONTEXT except where a rope type
# makes it the exact limit.
CASES: dict[str, tuple[str, dict]] = {
    "llama-rope-default": ("llama", {}),
    "llama-rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama-rope-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0}}),
    "llama-rope-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 128}}),
    "llama-rope-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                     "max_position_embeddings": CONTEXT}),
    "llama-rope-longrope": ("llama", {"rope_parameters": _longrope(_HD, CONTEXT), "max_position_embeddings": 256}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma3_text": ("gemma3_text", {"final_logit_softcapping": 4.0}),
    "phi3-window": ("phi3", {"sliding_window": WINDOW}),
    # Phi-4-mini's shape: partial rotary 0.75 (rotary_dim 12: rotated before GQA) with longrope.
    # Phi3Config copies its top-level original_max_position_embeddings into the rope parameters.
    "phi4-mini-partial-longrope": ("phi3", {
        "rope_parameters": {**_longrope(12, CONTEXT), "partial_rotary_factor": 0.75},
        "max_position_embeddings": 256, "original_max_position_embeddings": CONTEXT}),
    # head_dim 32, rotary_dim 16: partial rotary inside GroupQueryAttention (cos/sin cache width 8).
    "phi3-partial-fused": ("phi3", {"num_attention_heads": 2, "num_key_value_heads": 1, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "gemma2": ("gemma2", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 4.0}),
    "smollm3-nope": ("smollm3", {"no_rope_layers": [1, 0]}),
    "granite": ("granite", {"embedding_multiplier": 3.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5,
                            "logits_scaling": 0.5}),
    "olmo2": ("olmo2", {}),
    "stablelm": ("stablelm", {}),
    "stablelm-parallel-qknorm-bias": ("stablelm", {"use_parallel_residual": True, "qk_layernorm": True,
                                                   "use_qkv_bias": True}),
    "gpt_neox-parallel": ("gpt_neox", {}),
    "gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "starcoder2-window": ("starcoder2", {"sliding_window": WINDOW}),
}
ATTENTIONS = ("gqa", "standard")
SEED = 3


def _bundle(tiny_model, export, case: str, attention: str):
    arch, config = CASES[case]
    folder = tiny_model(arch, seed=SEED, config=config)
    return folder, export(folder, draft="self-int4", attention=attention, max_context=CONTEXT)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers_and_speculation_equals_plain(case, attention, tiny_model, export,
                                                                load_generator):
    from specedge.bundle.manifest import load_manifest

    folder, bundle = _bundle(tiny_model, export, case, attention)
    assert load_manifest(bundle).target.attention == attention
    expected = hf_greedy(load_hf(folder), PROMPT_IDS, N_NEW)
    assert len(expected) >= WINDOW, "the continuation must run past the window (seed meets EOS too early)"
    gen = load_generator(bundle)
    # Tokenizer parity (export refuses a bundle without it: export/tokenizer_parity.py): the bundle encodes
    # text, BOS rule included, as transformers' tokenizer of the same folder does.
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder))
    text = reference.decode(PROMPT_IDS)
    assert gen.codec.encode(text) == reference.encode(text)
    exact = exact_holds(gen)  # the standard graph is not row-invariant on every CPU: there, fast mode's promise
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, speculation=False, exact=exact).token_ids
    assert plain == expected
    for drafter in ("model", "ngram"):
        out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, drafter=drafter, draft_tokens=4,
                           adaptive=False, exact=exact)
        assert_agrees(gen, PROMPT_IDS, plain, out.token_ids, exact=exact)


# --------------------------------------------------------------------------- the features bite


def _drop_weights(*suffixes: str):
    return lambda spec, w: (spec, {k: v for k, v in w.items() if not k.endswith(suffixes)})


def _spec(**fields):
    return lambda spec, w: (replace(spec, **fields), w)


# (case, what is dropped, how): each must make export validation fail on that case's checkpoint.
DROPPED = [
    ("qwen3-window", "q/k norms", _drop_weights(".q_norm", ".k_norm")),
    ("qwen3-window", "sliding window", _spec(layer_windows=(0, 0))),
    ("gemma3_text", "local rope table", lambda s, w: (replace(s, layer_rope=(0, 0)), w)),
    ("gemma3_text", "post-norms", _drop_weights(".attn_post_norm", ".mlp_post_norm")),
    ("gemma3_text", "embedding scale", _spec(embed_scale=1.0)),
    ("gemma2", "attention soft-cap", _spec(attn_softcap=0.0)),
    ("gemma2", "final soft-cap", _spec(final_softcap=0.0)),
    ("gemma2", "query_pre_attn_scalar", _spec(attn_scale=_HD ** -0.5)),
    ("phi4-mini-partial-longrope", "longrope attention scaling", _spec(rope_scaling=1.0)),
    ("smollm3-nope", "NoPE layer", _spec(layer_rope=(0, 0))),
    ("granite", "embedding multiplier", _spec(embed_scale=1.0)),
    ("granite", "residual multiplier", _spec(residual_scale=1.0)),
    ("granite", "logits scaling", _spec(logit_scale=1.0)),
    ("olmo2", "full-projection q/k norms", _drop_weights(".q_norm", ".k_norm")),
    ("stablelm-parallel-qknorm-bias", "parallel residual", _spec(parallel_residual=False)),
    ("stablelm-parallel-qknorm-bias", "per-head q/k LayerNorm", _drop_weights(".q_norm", ".k_norm")),
    ("gpt_neox-parallel", "parallel residual", _spec(parallel_residual=False)),
    ("starcoder2-window", "MLP biases", _drop_weights(".fc_bias", ".down_bias")),
]


@pytest.mark.parametrize("case, dropped, change", DROPPED, ids=[f"{c}-{d}" for c, d, _ in DROPPED])
def test_each_family_feature_changes_these_checkpoints_logits(case, dropped, change, tiny_model, tmp_path,
                                                             monkeypatch):
    from specedge.errors import ExportValidationError
    from specedge.export import weights
    from specedge.export.bundle import ExportConfig, export_bundle

    original = weights.extract

    def extract(model):
        spec, w, features = original(model)
        return (*change(spec, dict(w)), features)

    monkeypatch.setattr(weights, "extract", extract)
    arch, config = CASES[case]
    folder = tiny_model(arch, seed=SEED, config=config)
    with pytest.raises(ExportValidationError, match="differ from PyTorch"):
        export_bundle(ExportConfig(target=str(folder), out=tmp_path / "b", quiet=True, max_context=CONTEXT,
                                   attention="standard"))


# --------------------------------------------------------------------------- config tables and refusals


def test_every_field_of_each_familys_config_classes_is_declared():
    import transformers

    from specedge.export.families import FAMILIES

    for model_type, family in FAMILIES.items():
        for name in family.config_classes:
            config = getattr(transformers, name)()
            assert config.model_type == model_type
            missing = set(config.to_dict()) - set(family.fields)
            assert not missing, f"{name}: {sorted(missing)}"


@pytest.mark.parametrize("name, message", [
    ("Qwen3MoeConfig", r"architecture 'qwen3_moe': mixture-of-experts is not supported yet: it needs a router"),
    ("MixtralConfig", r"architecture 'mixtral': mixture-of-experts is not supported yet"),
    ("CohereConfig", r"architecture 'cohere' is not supported yet; supported: llama, qwen2"),
])
def test_unsupported_families_are_refused_by_name(name, message):
    import transformers

    from specedge.errors import UnsupportedModelError
    from specedge.export.features import read_features

    with pytest.raises(UnsupportedModelError, match=message):
        read_features(getattr(transformers, name)())


@pytest.mark.parametrize("model_type, config, message", [
    ("gemma2", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True is not supported"),
    ("smollm3", {"no_rope_layers": [1, 2]}, r"no_rope_layers=\[1, 2\] must have one 0/1 entry per layer \(2\)"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                            "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                     "layer_types": ["sliding_attention", "full_attention"]},
     r"only static types per layer type"),
])
def test_family_specific_values_are_refused_by_name(model_type, config, message):
    from transformers import AutoConfig

    from specedge.errors import UnsupportedModelError
    from specedge.export.features import read_features

    cfg = AutoConfig.for_model(model_type, num_hidden_layers=2, **config)
    with pytest.raises(UnsupportedModelError, match=message):
        read_features(cfg)


def test_longrope_past_its_original_context_is_refused_by_name(tiny_model, export):
    from specedge.errors import InvalidParameterError

    arch, config = CASES["phi4-mini-partial-longrope"]
    folder = tiny_model(arch, seed=SEED, config=config)
    with pytest.raises(InvalidParameterError, match=r"max_context 128 exceeds this phi3 model's 64 .*'longrope'"):
        export(folder, max_context=128)


def test_partial_rotary_takes_the_fused_path_only_when_ort_allows_it(tiny_model, export):
    """rotary_dim / 2 a multiple of 8 rotates inside GroupQueryAttention; otherwise before it."""
    import onnx

    def rotary_nodes(case):
        arch, config = CASES[case]
        bundle = export(tiny_model(arch, seed=SEED, config=config), draft="self-int4", attention="gqa",
                        max_context=CONTEXT)
        graph = onnx.load(str(bundle / "target" / "model.onnx"), load_external_data=False).graph
        gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
        fused = [any(a.name == "do_rotary" and a.i == 1 for a in n.attribute) for n in gqa]
        # The int4 draft quantizes the token embedding's lookup only: the rotary tables a rotation outside the
        # op gathers stay float (rounding positions would move every attention score).
        draft = onnx.load(str(bundle / "draft" / "model.onnx"), load_external_data=False).graph
        assert [n.input[0] for n in draft.node if n.op_type == "GatherBlockQuantized"] == ["embed_Q8"]
        # rotate_half's Neg marks a rotation outside the op (one more Neg reads num_logits_to_keep).
        return fused, sum(n.op_type == "Neg" for n in graph.node) - 1

    assert rotary_nodes("phi3-partial-fused") == ([True, True], 0)
    fused, negs = rotary_nodes("phi4-mini-partial-longrope")
    assert fused == [False, False] and negs == 4  # q and k in each of 2 layers
    assert np.all(np.asarray(rotary_nodes("smollm3-nope")[0]) == np.array([True, False]))


# --------------------------------------------------------------------------- GGUF input


def test_a_gguf_file_of_a_new_family_exports_and_matches_transformers(tiny_model, tmp_path, monkeypatch,
                                                                     load_generator):
    """transformers' GGUF loader dequantizes to an HF folder; the family builder takes it from there.

    transformers' qwen3 GGUF mapping reads no head_dim (Qwen3Config's default, 128, applies), so this
    checkpoint has head_dim 128.
    """
    from specedge.export.bundle import ExportConfig, export_bundle
    from tiny_models import write_gguf

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))  # the dequantized folder lands here
    folder = tiny_model("qwen3", seed=SEED, config={"head_dim": 128})
    source = write_gguf(folder, tmp_path / "tiny-qwen3.gguf")
    export_bundle(ExportConfig(target=str(source), out=tmp_path / "b", quiet=True, max_context=CONTEXT))
    expected = hf_greedy(load_hf(folder), PROMPT_IDS, N_NEW)
    gen = load_generator(tmp_path / "b")
    got = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, speculation=False, exact=exact_holds(gen))
    assert got.token_ids == expected


@pytest.mark.parametrize("case", ["gpt_neox-parallel", "gemma3_text"])
def test_early_exit_self_drafts_validate_for_other_layouts(case, tiny_model, export, load_generator):
    """The early-exit draft is validated against the first layers of the PyTorch model, whatever its body."""
    arch, config = CASES[case]
    folder = tiny_model(arch, seed=SEED, config=config)
    bundle = export(folder, draft="self-int4", draft_layers=1, max_context=CONTEXT)
    gen = load_generator(bundle)
    exact = exact_holds(gen)
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, speculation=False, exact=exact).token_ids
    out = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_NEW, drafter="model", draft_tokens=4, adaptive=False,
                       exact=exact)
    assert_agrees(gen, PROMPT_IDS, plain, out.token_ids, exact=exact)
    assert out.stats.accepted < out.stats.drafted, "a one-layer draft must be corrected at least once"


@pytest.mark.parametrize("case", ["phi4-mini-partial-longrope", "gemma3_text"])
def test_a_manifest_max_context_past_the_graphs_rope_tables_is_refused_at_load(case, tiny_model, export, tmp_path):
    """Rotary tables built outside GroupQueryAttention, and Gemma 3's second table, keep the position check."""
    import json
    import shutil

    from specedge.errors import ManifestError
    from specedge.bundle.manifest import load_manifest

    arch, config = CASES[case]
    bundle = Path(shutil.copytree(export(tiny_model(arch, seed=SEED, config=config), draft="self-int4",
                                         attention="gqa", max_context=CONTEXT), tmp_path / "b"))
    path = bundle / "manifest.json"
    obj = json.loads(path.read_text())
    obj["models"]["target"]["max_context"] = 2 * CONTEXT
    path.write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match=rf"was built for {CONTEXT} positions \(its 'cos_cache' table\)"):
        load_manifest(bundle)
