"""The shared base of every family builder: config fields, features, spec and weight mapping.

A family states only what differs from the base decoder (a Llama-layout, pre-norm, gated-MLP,
rotary transformer): its config fields, where its tensors live, and the DecoderSpec fields
it sets. The graph builder (export/graph.py) reads only DecoderSpec fields and canonical
weight names, so a family never adds a branch there.

Canonical weight names (linear weights [in, out], so the graph is MatMul(x, W)):
``embed``, ``norm`` (+``norm_bias``), ``lm_head`` (untied only), ``pos_embed`` (learned positions),
and per layer ``layers.{i}.`` + ``qkv``, ``o``, ``gate_up`` or ``fc``, ``down`` (each with an
optional ``_bias``), ``attn_norm``, ``mlp_norm``, ``attn_post_norm``, ``mlp_post_norm``,
``q_norm``, ``k_norm`` (each optional, with an optional ``_bias``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from ...errors import UnsupportedModelError
from ..graph import DecoderSpec
from ..lazy_weights import Lazy


@dataclass(frozen=True)
class Field:
    handling: str  # "implemented" | "checked" | "ignored"
    note: str


def impl(note: str) -> Field:
    return Field("implemented", note)


def checked(note: str) -> Field:
    return Field("checked", note)


def ignored(note: str) -> Field:
    return Field("ignored", note)


# Activations the graph builder implements, by transformers' ACT2FN name.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# Rope types whose inverse frequencies transformers computes once, from the config: a pure
# function of position, so every forward (prefill, step, verify) rotates a position alike.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Rope types whose frequencies transformers recomputes from each forward call's longest position
# once it passes a limit; exact up to that limit (see ``Decoder.exact_context``), refused past it.
LIMITED_ROPE_TYPES = ("dynamic", "longrope")
# Attention layer kinds of ``config.layer_types`` the graph builds.
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    unknown_fields: tuple[str, ...] = ()  # set away from their defaults, not in the family's fields

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows, ascending (empty: every layer attends fully)."""
        return tuple(sorted({w for w in self.layer_windows if w}))


# PretrainedConfig's own fields: metadata and output switches of the PyTorch module.
BASE_FIELDS = {
    "_name_or_path": ignored("where transformers loaded the config from"),
    "_model_name_or_path": ignored("where a GGUF conversion came from (metadata)"),
    "architectures": ignored("the PyTorch class name; model_type decides the family"),
    "model_type": checked("selects the family (export/families)"),
    "transformers_version": ignored("metadata"),
    "dtype": ignored("storage dtype; weights are read as float32, the graph's precision is --precision"),
    "torch_dtype": ignored("storage dtype (older name)"),
    "return_dict": ignored("PyTorch output container"),
    "output_attentions": ignored("PyTorch debug output"),
    "output_hidden_states": ignored("PyTorch debug output"),
    "chunk_size_feed_forward": ignored("a PyTorch memory trade-off; the result is the same"),
    "is_encoder_decoder": checked("must be false (decoder-only)"),
    "id2label": ignored("classification heads only"),
    "label2id": ignored("classification heads only"),
    "problem_type": ignored("classification heads only"),
    "use_cache": ignored("the runtime always keeps a KV cache"),
    "initializer_range": ignored("initialisation only; trained weights are read"),
    "bos_token_id": ignored("the tokenizer adds BOS; it does not change logits"),
    "eos_token_id": impl("read as the bundle's EOS ids"),
    "pad_token_id": ignored("batch padding; the runtime runs batch 1"),
    "tie_word_embeddings": impl("tied models read the embedding as the output layer"),
    "vocab_size": impl("logit width"),
    "auto_map": ignored("custom-code classes are never imported (trust_remote_code is off); transformers' own "
                        "class for model_type loads the weights"),
    "tokenizer_class": ignored("the tokenizer is exported from tokenizer.json"),
    "task_specific_params": ignored("generation presets of pipelines"),
    "custom_pipelines": ignored("pipeline registry"),
    "quantization_config": checked("must be absent: a pre-quantized checkpoint (GPTQ, AWQ, bitsandbytes) is "
                                   "refused; export the float checkpoint with --precision int4/int8"),
}

# The base decoder's fields (Llama's names); families add, rename or drop entries.
DECODER_FIELDS = {
    **BASE_FIELDS,
    "hidden_size": impl("model width"),
    "intermediate_size": impl("MLP width"),
    "num_hidden_layers": impl("layer count"),
    "num_attention_heads": impl("query heads"),
    "num_key_value_heads": impl("KV heads (grouped-query attention)"),
    "head_dim": impl("per-head width, may differ from hidden/heads"),
    "hidden_act": checked(f"MLP activation; implemented: {', '.join(ACTIVATIONS)}"),
    "rms_norm_eps": impl("RMSNorm epsilon"),
    "max_position_embeddings": checked("trained context: a larger --max-context warns; with rope type "
                                       "'dynamic' it is the exact limit and a larger one is refused"),
    "rope_parameters": checked(f"rope_theta, rope_type, partial_rotary_factor; types "
                               f"{', '.join(STATIC_ROPE_TYPES)} implemented, 'dynamic' exact up to "
                               "max_position_embeddings, 'longrope' up to original_max_position_embeddings, "
                               "others refused"),
    "rope_scaling": checked("older name of rope_parameters"),
    "rope_theta": impl("rotary base (older configs)"),
    "attention_bias": impl("q/k/v/o biases"),
    "mlp_bias": impl("gate/up/down biases"),
    "attention_dropout": ignored("dropout is off at inference"),
    "pretraining_tp": ignored("tensor-parallel training split; transformers 5 computes the same product"),
}

WINDOW_FIELDS = {
    "sliding_window": impl("sliding-window attention (banded causal mask / GQA local_window_size)"),
    "use_sliding_window": impl("switches the windowed layers on (qwen2 family)"),
    "max_window_layers": impl("layers from this index on use the window (qwen2 family)"),
    "layer_types": checked(f"per-layer attention kind; implemented: {', '.join(LAYER_TYPES)}"),
}


def to_numpy(t: Any) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def read_lazily(sd: Mapping, key: str, *, transpose: bool = False) -> Lazy:
    """``sd[key]`` as float32 (transposed to [in, out] if asked), read each time the builder reads it.

    With an in-memory model this is a view of the parameter (no copy); with a streamed one
    (export/streamed.py) a read from disk, so no matrix is held between the builder's uses."""
    return Lazy(lambda: to_numpy(sd[key]).T if transpose else to_numpy(sd[key]))


def rope_parameters(config: Any) -> dict:
    """The config's rope dict (transformers 5 ``rope_parameters``, older ``rope_scaling``), or {}."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"rope_parameters {params!r} is not a dict; cannot read the rope type")
    return params


def activation(name: Any, field_name: str) -> str:
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"{field_name}={name!r} is not supported; implemented: {', '.join(ACTIVATIONS)}")
    return "silu" if name == "swish" else name


def refuse_if(condition: Any, message: str) -> None:
    if condition:
        raise UnsupportedModelError(message)


class Family(ABC):
    """One architecture family: what its config fields mean and where its weights live.

    Subclasses set the class attributes and override the few methods whose behaviour differs.
    """

    model_types: ClassVar[tuple[str, ...]]  # config.model_type values this builder serves
    config_classes: ClassVar[tuple[str, ...]]  # transformers config classes (their fields must all be declared)
    architecture: ClassVar[str]  # DecoderSpec.architecture (recorded in the manifest)
    fields: ClassVar[Mapping[str, Field]]
    variants: ClassVar[str] = ""  # what the family covers, for the README table

    @abstractmethod
    def features(self, config: Any) -> ModelFeatures:
        """Read the config (already checked against ``fields`` for unknown names); refuse what is not built."""

    @abstractmethod
    def extract(self, model: Any, features: ModelFeatures) -> tuple[DecoderSpec, dict[str, np.ndarray]]:
        """The spec and canonical float32 weights (module docstring) of a transformers model of this family."""


class Decoder(Family):
    """The base decoder: Llama's layout (``model.layers.{i}.self_attn.q_proj`` ...), RMSNorm pre-norms,
    gated MLP, rotary positions. Families override the class attributes and hooks below."""

    architecture = "llama"
    fields = {**DECODER_FIELDS, **WINDOW_FIELDS}
    activation_field: ClassVar[str] = "hidden_act"
    norm: ClassVar[str] = "rms"  # DecoderSpec.norm
    norm_eps_field: ClassVar[str] = "rms_norm_eps"
    # Added to every norm weight at extraction: Gemma's RMSNorm multiplies by (1 + w).
    norm_offset: ClassVar[float] = 0.0
    # Canonical norm name -> the module name under model.layers.{i}.
    layer_norms: ClassVar[Mapping[str, str]] = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    qk_norm: ClassVar[str] = ""  # DecoderSpec.qk_norm; weights self_attn.q_norm / k_norm

    # ------------------------------------------------------------------ config -> features

    def features(self, config: Any) -> ModelFeatures:
        self.check(config)
        act = activation(getattr(config, self.activation_field), self.activation_field)
        rope_type = self.rope_type(config)
        return ModelFeatures(model_type=config.model_type, activation=act, layer_windows=self.layer_windows(config),
                             rope_type=rope_type, trained_context=int(config.max_position_embeddings),
                             exact_context=self.exact_context(config, rope_type))

    def check(self, config: Any) -> None:
        """Refuse, by name, config values the graph does not implement (family-specific)."""

    def rope_type(self, config: Any) -> str:
        params = rope_parameters(config)
        refuse_if(params and all(isinstance(v, dict) for v in params.values()),
                  f"per-layer-type rope_parameters are not supported for {config.model_type}")
        return self._check_rope(params)

    @staticmethod
    def _check_rope(params: dict) -> str:
        rope_type = params.get("rope_type", params.get("type", "default"))
        refuse_if(rope_type not in STATIC_ROPE_TYPES + LIMITED_ROPE_TYPES,
                  f"rope type {rope_type!r} is not supported: implemented are {', '.join(STATIC_ROPE_TYPES)}, "
                  "'dynamic' (up to max_position_embeddings) and 'longrope' (up to original_max_position_embeddings)")
        return rope_type

    def exact_context(self, config: Any, rope_type: str) -> int | None:
        if rope_type == "dynamic":
            # Dynamic NTK recomputes the frequencies from the longest position of each forward call once it
            # passes max_position_embeddings, and keys already cached keep their old rotation: a prefill, a
            # step and a verify then rotate the same position differently. Below the limit the frequencies
            # are the default ones, so the graph is exact up to it and nowhere past it.
            return int(config.max_position_embeddings)
        if rope_type == "longrope":
            # Longrope switches from its short to its long factors once a forward call's longest position
            # passes original_max_position_embeddings: the same hazard as 'dynamic', at that limit.
            params = rope_parameters(config)
            return int(params.get("original_max_position_embeddings")
                       or getattr(config, "original_max_position_embeddings", None)
                       or config.max_position_embeddings)
        return None

    def layer_windows(self, config: Any) -> tuple[int, ...]:
        """Per-layer sliding window (0 = full): ``layer_types`` with ``sliding_window`` (transformers' rule for
        most families); families with another rule override this."""
        n = config.num_hidden_layers
        window = self.window(config)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            return (0,) * n
        refuse_if(len(layer_types) != n, f"layer_types has {len(layer_types)} entries for {n} layers")
        bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
        refuse_if(bad, f"layer_types {bad} are not supported; implemented: {', '.join(LAYER_TYPES)}")
        refuse_if("sliding_attention" in layer_types and window is None,
                  "layer_types names sliding_attention layers but sliding_window is null")
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)

    @staticmethod
    def window(config: Any) -> int | None:
        window = getattr(config, "sliding_window", None)
        refuse_if(window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1),
                  f"sliding_window={window!r} must be a positive integer or null")
        return window

    # ------------------------------------------------------------------ model -> spec, weights

    def extract(self, model: Any, features: ModelFeatures) -> tuple[DecoderSpec, dict[str, np.ndarray]]:
        cfg = model.config
        sd = model.state_dict()
        n_heads = cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        w = self.global_weights(sd, cfg)
        tied = "lm_head" not in w
        for i in range(cfg.num_hidden_layers):
            w.update({f"layers.{i}.{k}": v for k, v in self.layer_weights(sd, cfg, i, n_heads, n_kv, head_dim).items()})
        for key in [k for k in w if k == "norm" or k.endswith(("_norm",))]:
            if self.norm_offset:
                w[key] = w[key] + self.norm_offset
        fields = dict(
            architecture=self.architecture, n_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=self.intermediate_size(cfg),
            vocab_size=cfg.vocab_size, norm_eps=float(getattr(cfg, self.norm_eps_field)),
            attn_scale=float(head_dim ** -0.5), tied_embeddings=tied, activation=features.activation,
            layer_windows=features.layer_windows, norm=self.norm, qk_norm=self.qk_norm,
            **self.rope(model, features))
        return DecoderSpec(**{**fields, **self.spec_fields(cfg)}), w

    def intermediate_size(self, cfg: Any) -> int:
        return cfg.intermediate_size

    def spec_fields(self, cfg: Any) -> dict:
        """Further DecoderSpec fields (scales, soft-caps, residual layout) of this family."""
        return {}

    def rope(self, model: Any, features: ModelFeatures) -> dict:
        """DecoderSpec rope fields from the PyTorch rotary module, which already applied any static scaling
        (linear, llama3, yarn) to inv_freq. 'dynamic' and 'longrope' may have rescaled inv_freq after a long
        forward; their original frequencies are the exact ones up to their limit, the only range such a bundle
        is exported for."""
        rotary = self.body(model).rotary_emb
        return {"inv_freq": tuple(float(f) for f in to_numpy(rotary.original_inv_freq)),
                "rope_scaling": float(getattr(rotary, "attention_scaling", 1.0))}

    def body(self, model: Any) -> Any:
        return model.model

    def global_weights(self, sd: Mapping, cfg: Any) -> dict[str, np.ndarray]:
        w = {"embed": read_lazily(sd, "model.embed_tokens.weight"), "norm": to_numpy(sd["model.norm.weight"])}
        if "model.norm.bias" in sd:
            w["norm_bias"] = to_numpy(sd["model.norm.bias"])
        if not getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" in sd:
            w["lm_head"] = read_lazily(sd, "lm_head.weight", transpose=True)
        return w

    def layer_weights(self, sd: Mapping, cfg: Any, i: int, n_heads: int, n_kv: int,
                      head_dim: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}"
        w = {**self.attention_weights(sd, p, n_heads, n_kv, head_dim), **self.mlp_weights(sd, p)}
        for canonical, module in self.layer_norms.items():
            w.update(linear(sd, f"{p}.{module}", canonical, transpose=False))
        if self.qk_norm:
            w.update(linear(sd, f"{p}.self_attn.q_norm", "q_norm", transpose=False))
            w.update(linear(sd, f"{p}.self_attn.k_norm", "k_norm", transpose=False))
        return w

    def attention_weights(self, sd: Mapping, p: str, n_heads: int, n_kv: int, head_dim: int) -> dict[str, np.ndarray]:
        """q|k|v fused into one [hidden, (H + 2 kvh) hd] weight (+ bias), and o."""
        return {**fuse(sd, [f"{p}.self_attn.{n}_proj" for n in "qkv"], "qkv"),
                **linear(sd, f"{p}.self_attn.o_proj", "o")}

    def mlp_weights(self, sd: Mapping, p: str) -> dict[str, np.ndarray]:
        """gate|up fused into one [hidden, 2 intermediate] weight (+ bias), and down."""
        return {**fuse(sd, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], "gate_up"),
                **linear(sd, f"{p}.mlp.down_proj", "down")}


def linear(sd: Mapping, module: str, name: str, transpose: bool = True) -> dict[str, np.ndarray]:
    """``{name: weight (transposed to [in, out] for linears), name_bias: bias}`` of one HF module."""
    # Matrices are read when the graph builder asks (a streamed source reads them from disk then); norm
    # vectors are small and are read now (a family may offset them).
    w = {name: read_lazily(sd, f"{module}.weight", transpose=True) if transpose else to_numpy(sd[f"{module}.weight"])}
    if f"{module}.bias" in sd:
        w[f"{name}_bias"] = to_numpy(sd[f"{module}.bias"])
    return w


def fuse(sd: Mapping, modules: list[str], name: str) -> dict[str, np.ndarray]:
    """Linears that read the same input, concatenated along the output axis (one GEMM)."""
    # A fused copy is made when the graph builder reads it (export/lazy_weights.py), not held all export long.
    w = {name: Lazy(lambda: np.concatenate([to_numpy(sd[f"{m}.weight"]).T for m in modules], axis=1))}
    if all(f"{m}.bias" in sd for m in modules):
        w[f"{name}_bias"] = np.concatenate([to_numpy(sd[f"{m}.bias"]) for m in modules])
    return w


