"""What a checkpoint's config asks of the graph, read field by field before any graph is built.

Every config field of a supported family is declared here with what the exporter does
with it:

- ``implemented``: the graph computes it (and export validation compares it with PyTorch);
- ``checked``: some values are implemented, any other value is refused by name;
- ``ignored``: it cannot change inference logits (training-only, metadata, output flags),
  and the reason is written next to it.

A field the table does not know, set away from its config class's default, is named in a
warning and in the manifest: it may be metadata (GGUF conversions add some) or a feature.
Export validation then decides, and it runs to the last position the bundle can hold
(export/validate.py), so a feature that changes logits anywhere in that range fails there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidParameterError, UnsupportedModelError

LLAMA_FAMILY = ("llama", "qwen2", "mistral")
SUPPORTED = LLAMA_FAMILY + ("gpt2",)

# Activations the graph builder implements, by transformers' ACT2FN name.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# Rope types whose inverse frequencies transformers computes once, from the config: a pure
# function of position, so every forward (prefill, step, verify) rotates a position alike.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Attention layer kinds of ``config.layer_types`` the graph builds.
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Field:
    handling: str  # "implemented" | "checked" | "ignored"
    note: str


def _impl(note: str) -> Field:
    return Field("implemented", note)


def _checked(note: str) -> Field:
    return Field("checked", note)


def _ignored(note: str) -> Field:
    return Field("ignored", note)


# PretrainedConfig's own fields: metadata and output switches of the PyTorch module.
_BASE_FIELDS = {
    "_name_or_path": _ignored("where transformers loaded the config from"),
    "_model_name_or_path": _ignored("where a GGUF conversion came from (metadata)"),
    "architectures": _ignored("the PyTorch class name; model_type decides the family"),
    "model_type": _checked(f"selects the family; supported: {', '.join(SUPPORTED)}"),
    "transformers_version": _ignored("metadata"),
    "dtype": _ignored("storage dtype; weights are read as float32, the graph's precision is --precision"),
    "torch_dtype": _ignored("storage dtype (older name)"),
    "return_dict": _ignored("PyTorch output container"),
    "output_attentions": _ignored("PyTorch debug output"),
    "output_hidden_states": _ignored("PyTorch debug output"),
    "chunk_size_feed_forward": _ignored("a PyTorch memory trade-off; the result is the same"),
    "is_encoder_decoder": _checked("must be false (decoder-only)"),
    "id2label": _ignored("classification heads only"),
    "label2id": _ignored("classification heads only"),
    "problem_type": _ignored("classification heads only"),
    "use_cache": _ignored("the runtime always keeps a KV cache"),
    "initializer_range": _ignored("initialisation only; trained weights are read"),
    "bos_token_id": _ignored("the tokenizer adds BOS; it does not change logits"),
    "eos_token_id": _impl("read as the bundle's EOS ids"),
    "pad_token_id": _ignored("batch padding; the runtime runs batch 1"),
    "tie_word_embeddings": _impl("tied models read the embedding as the output layer"),
    "vocab_size": _impl("logit width"),
    "auto_map": _ignored("custom-code classes are never imported (trust_remote_code is off); transformers' own "
                         "class for model_type loads the weights"),
    "tokenizer_class": _ignored("the tokenizer is exported from tokenizer.json"),
    "task_specific_params": _ignored("generation presets of pipelines"),
    "custom_pipelines": _ignored("pipeline registry"),
    "quantization_config": _checked("must be absent: a pre-quantized checkpoint (GPTQ, AWQ, bitsandbytes) is "
                                    "refused; export the float checkpoint with --precision int4/int8"),
}

_LLAMA_FIELDS = {
    **_BASE_FIELDS,
    "hidden_size": _impl("model width"),
    "intermediate_size": _impl("MLP width"),
    "num_hidden_layers": _impl("layer count"),
    "num_attention_heads": _impl("query heads"),
    "num_key_value_heads": _impl("KV heads (grouped-query attention)"),
    "head_dim": _impl("per-head width, may differ from hidden/heads"),
    "hidden_act": _checked(f"MLP activation; implemented: {', '.join(ACTIVATIONS)}"),
    "rms_norm_eps": _impl("RMSNorm epsilon"),
    "max_position_embeddings": _checked("trained context: a larger --max-context warns; with rope type "
                                        "'dynamic' it is the exact limit and a larger one is refused"),
    "rope_parameters": _checked(f"rope_theta and rope_type; types {', '.join(STATIC_ROPE_TYPES)} implemented, "
                                "'dynamic' exact up to max_position_embeddings, others refused"),
    "rope_scaling": _checked("older name of rope_parameters"),
    "rope_theta": _impl("rotary base (older configs)"),
    "attention_bias": _impl("q/k/v/o biases"),
    "mlp_bias": _impl("gate/up/down biases"),
    "attention_dropout": _ignored("dropout is off at inference"),
    "pretraining_tp": _ignored("tensor-parallel training split; transformers 5 computes the same product"),
    # Sliding windows: one window per layer, from the family's rule.
    "sliding_window": _impl("sliding-window attention (banded causal mask / GQA local_window_size)"),
    "use_sliding_window": _impl("qwen2: switches its windowed layers on"),
    "max_window_layers": _impl("qwen2: layers from this index on use the window"),
    "layer_types": _checked(f"per-layer attention kind; implemented: {', '.join(LAYER_TYPES)}"),
}

_GPT2_FIELDS = {
    **_BASE_FIELDS,
    "n_embd": _impl("model width"),
    "n_layer": _impl("layer count"),
    "n_head": _impl("heads"),
    "n_inner": _impl("MLP width (default 4 x n_embd)"),
    "n_positions": _checked("learned position table: --max-context above it is refused"),
    "activation_function": _checked(f"MLP activation; implemented: {', '.join(ACTIVATIONS)}"),
    "layer_norm_epsilon": _impl("LayerNorm epsilon"),
    "scale_attn_weights": _impl("1/sqrt(head_dim) attention scale on or off"),
    "scale_attn_by_inverse_layer_idx": _checked("must be false (per-layer 1/(i+1) scale not implemented)"),
    "reorder_and_upcast_attn": _ignored("fp32 upcast of the attention product; the graph's softmax is fp32 anyway"),
    "add_cross_attention": _checked("must be false (decoder-only)"),
    "resid_pdrop": _ignored("dropout is off at inference"),
    "embd_pdrop": _ignored("dropout is off at inference"),
    "attn_pdrop": _ignored("dropout is off at inference"),
    "summary_type": _ignored("sequence-summary head, not the LM head"),
    "summary_use_proj": _ignored("sequence-summary head, not the LM head"),
    "summary_activation": _ignored("sequence-summary head, not the LM head"),
    "summary_proj_to_labels": _ignored("sequence-summary head, not the LM head"),
    "summary_first_dropout": _ignored("sequence-summary head, not the LM head"),
}

FIELDS: dict[str, dict[str, Field]] = {**{f: _LLAMA_FIELDS for f in LLAMA_FAMILY}, "gpt2": _GPT2_FIELDS}


@dataclass(frozen=True)
class ModelFeatures:
    """The config facts that decide the graph and the context limits, read once."""

    model_type: str
    activation: str  # one of ACTIVATIONS
    # Per layer: the sliding-window length in tokens (a query at position p sees keys p-W+1..p,
    # transformers' `kv_idx > q_idx - W`), or 0 for full causal attention.
    layer_windows: tuple[int, ...]
    rope_type: str  # "" for learned positions (gpt2)
    trained_context: int  # max_position_embeddings / n_positions
    exact_context: int | None  # the longest context computed exactly, or None for unbounded
    unknown_fields: tuple[str, ...] = ()  # set away from their defaults, not in FIELDS (see module doc)

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows, ascending (empty: every layer attends fully)."""
        return tuple(sorted({w for w in self.layer_windows if w}))


def rope_parameters(config: Any) -> dict:
    """The config's rope dict (transformers 5 ``rope_parameters``, older ``rope_scaling``), or {}."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"rope_parameters {params!r} is not a dict; cannot read the rope type")
    if params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type rope (gemma3-style {"full_attention": {...}, "sliding_attention": {...}}).
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported for this family")
    return params


def read_features(config: Any) -> ModelFeatures:
    """Check every config field against FIELDS; raise UnsupportedModelError naming what is not implemented."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FIELDS:
        raise UnsupportedModelError(f"architecture {model_type!r} is not supported yet; supported: "
                                    f"{', '.join(SUPPORTED)}")
    unknown = _unknown_fields(config, FIELDS[model_type])
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("is_encoder_decoder=True: only decoder-only models are supported")
    if getattr(config, "quantization_config", None):
        raise UnsupportedModelError("quantization_config is set: pre-quantized checkpoints are not supported; export "
                                    "the float checkpoint and pass --precision int4 or int8")
    features = _gpt2_features(config) if model_type == "gpt2" else _llama_features(config)
    if unknown:
        warnings.warn(f"{model_type} config field(s) {', '.join(unknown)} are not read by the exporter; export "
                      "validation (to max_context) decides whether they change the logits",
                      UnknownConfigFieldWarning, stacklevel=2)
    return replace(features, unknown_fields=unknown)


class UnknownConfigFieldWarning(UserWarning):
    """The config sets a field the exporter does not know."""


def _unknown_fields(config: Any, known: dict[str, Field]) -> tuple[str, ...]:
    values = config.to_dict()
    defaults = type(config)().to_dict()
    # Special-token ids (unk, sep, ...) only name tokens for the tokenizer.
    return tuple(sorted(k for k, v in values.items() if k not in known and not k.endswith("_token_id")
                        and v != defaults.get(k, _MISSING)))


_MISSING = object()


def _activation(name: Any, field_name: str) -> str:
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"{field_name}={name!r} is not supported; implemented: {', '.join(ACTIVATIONS)}")
    return "silu" if name == "swish" else name


def _llama_features(config: Any) -> ModelFeatures:
    activation = _activation(getattr(config, "hidden_act", "silu"), "hidden_act")
    params = rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    trained = int(config.max_position_embeddings)
    exact: int | None = None
    if rope_type == "dynamic":
        # Dynamic NTK recomputes the frequencies from the longest position of each forward call once it
        # passes max_position_embeddings, and keys already cached keep their old rotation: a prefill, a step
        # and a verify then rotate the same position differently. Below the limit the frequencies are the
        # default ones, so the graph is exact up to it and nowhere past it.
        exact = trained
    elif rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported: implemented are {', '.join(STATIC_ROPE_TYPES)} and "
            "'dynamic' (up to max_position_embeddings)")
    for key in ("partial_rotary_factor",):
        value = params.get(key, getattr(config, key, 1.0))
        if value not in (None, 1.0):
            raise UnsupportedModelError(f"{key}={value!r} is not supported (rotary over the whole head only)")
    return ModelFeatures(model_type=config.model_type, activation=activation,
                         layer_windows=_layer_windows(config), rope_type=rope_type,
                         trained_context=trained, exact_context=exact)


def _layer_windows(config: Any) -> tuple[int, ...]:
    """Per-layer sliding window (0 = full), by each family's rule in transformers."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise UnsupportedModelError(f"sliding_window={window!r} must be a positive integer or null")
    if config.model_type == "mistral":
        # transformers' Mistral applies its window (when set) to every layer and ignores layer_types.
        return (window or 0,) * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (0,) * n
    if len(layer_types) != n:
        raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for {n} layers")
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedModelError(f"layer_types {bad} are not supported; implemented: {', '.join(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and window is None:
        raise UnsupportedModelError("layer_types names sliding_attention layers but sliding_window is null")
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


def _gpt2_features(config: Any) -> ModelFeatures:
    activation = _activation(getattr(config, "activation_function", "gelu_new"), "activation_function")
    for name in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if getattr(config, name, False):
            raise UnsupportedModelError(f"{name}=True is not supported")
    positions = int(config.n_positions)
    return ModelFeatures(model_type="gpt2", activation=activation, layer_windows=(0,) * config.n_layer,
                         rope_type="", trained_context=positions, exact_context=positions)


class ContextBeyondTrainingWarning(UserWarning):
    """--max-context exceeds the context the checkpoint was trained for."""


def check_context(features: ModelFeatures, max_context: int) -> str | None:
    """Refuse a max_context the graph cannot compute exactly; return (and warn) when it passes training.

    Returns the warning text, or None when max_context is within the trained context.
    """
    if features.exact_context is not None and max_context > features.exact_context:
        why = ("learned positions" if features.model_type == "gpt2" else
               f"positions computed exactly (rope type {features.rope_type!r} rescales its frequencies by each "
               "forward call's length past max_position_embeddings, so cached and speculative decoding there "
               "cannot match transformers)")
        raise InvalidParameterError(f"max_context {max_context} exceeds this {features.model_type} model's "
                                    f"{features.exact_context} {why}; export with --max-context "
                                    f"{features.exact_context} or less")
    if max_context <= features.trained_context:
        return None
    message = (f"max_context {max_context} exceeds the {features.trained_context} positions this checkpoint was "
               f"trained for (max_position_embeddings): the graph computes positions past it exactly as "
               "transformers does, but the model's quality there is untested")
    warnings.warn(message, ContextBeyondTrainingWarning, stacklevel=2)
    return message


def validation_edges(features: ModelFeatures, max_context: int) -> tuple[int, ...]:
    """Positions export validation straddles with a verify block on a cached prefix, ascending.

    Every window length and the trained context below max_context (where attention or positions
    change behaviour), and the last position the cache holds (max_context - 1), so every rotary
    angle, position-table row and cache slot a bundle can ever use is computed once against PyTorch.
    """
    edges = set(features.windows) | {features.trained_context, max_context - 1}
    return tuple(sorted(e for e in edges if 0 < e < max_context))


def fields_table(model_type: str) -> list[tuple[str, str, str]]:
    """(field, handling, note) for every config field the exporter reads for ``model_type``."""
    return [(name, f.handling, f.note) for name, f in sorted(FIELDS[model_type].items())]

