"""Gemma 2 and Gemma 3 (text): RMSNorm of (1 + w), pre- and post-norms around attention and MLP,
sqrt(hidden)-scaled embeddings, query_pre_attn_scalar as the attention scale, soft-capping,
alternating sliding-window layers; Gemma 3 adds per-head q/k norms and per-layer-type rope."""

from __future__ import annotations

from typing import Any

from .base import ACTIVATIONS, DECODER_FIELDS, WINDOW_FIELDS, Decoder, checked, ignored, impl, refuse_if, \
    rope_parameters, to_numpy
from ..graph import RopeTable

_GEMMA_FIELDS = {
    **{k: v for k, v in DECODER_FIELDS.items() if k not in ("hidden_act", "mlp_bias", "pretraining_tp")},
    "hidden_activation": checked(f"MLP activation; implemented: {', '.join(ACTIVATIONS)}"),
    "rms_norm_eps": impl("RMSNorm epsilon; the (1 + w) weights are folded at extraction"),
    "query_pre_attn_scalar": impl("attention scale query_pre_attn_scalar ** -0.5"),
    "attn_logit_softcapping": impl("c tanh(scores / c) before the mask (GQA softcap attribute)"),
    "final_logit_softcapping": impl("c tanh(logits / c) on the output"),
    "sliding_window": WINDOW_FIELDS["sliding_window"],
    "layer_types": WINDOW_FIELDS["layer_types"],
    "use_bidirectional_attention": checked("must be false/null: bidirectional (embedding) models are not "
                                           "decoders"),
}


class Gemma2(Decoder):
    model_types = ("gemma2",)
    config_classes = ("Gemma2Config",)
    architecture = "gemma2"
    variants = ("(1 + w) RMSNorm folded; post-attention/post-feedforward norms; sqrt(hidden) embedding scale; "
                "attention and final logit soft-capping; alternating sliding windows; gelu-tanh")
    fields = _GEMMA_FIELDS
    activation_field = "hidden_activation"
    norm_offset = 1.0
    layer_norms = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                   "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}

    def check(self, config: Any) -> None:
        refuse_if(getattr(config, "use_bidirectional_attention", None),
                  "use_bidirectional_attention=True is not supported (not a causal decoder)")

    def spec_fields(self, cfg: Any) -> dict:
        return {"attn_scale": float(cfg.query_pre_attn_scalar) ** -0.5,
                "embed_scale": float(cfg.hidden_size) ** 0.5,
                "attn_softcap": float(cfg.attn_logit_softcapping or 0.0),
                "final_softcap": float(cfg.final_logit_softcapping or 0.0)}


class Gemma3Text(Gemma2):
    model_types = ("gemma3_text",)
    config_classes = ("Gemma3TextConfig",)
    architecture = "gemma3_text"
    variants = Gemma2.variants + "; per-head q/k norms; separate rope for sliding and full layers"
    fields = {**_GEMMA_FIELDS,
              "rope_parameters": checked("per layer type (sliding_attention / full_attention): rope_theta and "
                                         "a static rope_type each (default, linear, llama3, yarn)"),
              "_sliding_window_pattern": ignored("older form of layer_types, which transformers derives from it")}
    qk_norm = "head"

    def rope_type(self, config: Any) -> str:
        params = rope_parameters(config)
        kinds = sorted(set(config.layer_types))
        per_type = {kind: params[kind] if kind in params and isinstance(params[kind], dict) else params
                    for kind in kinds}
        types = {kind: self._check_rope(p) for kind, p in per_type.items()}
        refuse_if(any(t in ("dynamic", "longrope") for t in types.values()),
                  f"rope types {types} are not supported for gemma3_text: only static types per layer type")
        return types.get("full_attention", next(iter(types.values())))

    def rope(self, model: Any, features) -> dict:
        """One rope table per layer type (Gemma 3's local base 10k for sliding layers, 1M for full ones)."""
        rotary = model.model.rotary_emb
        kinds = sorted(set(model.config.layer_types))
        tables = [RopeTable(tuple(float(f) for f in to_numpy(getattr(rotary, f"{k}_original_inv_freq"))),
                            float(getattr(rotary, f"{k}_attention_scaling"))) for k in kinds]
        return {"inv_freq": tables[0].inv_freq, "rope_scaling": tables[0].scaling, "rope_tables": tuple(tables[1:]),
                "layer_rope": tuple(kinds.index(t) for t in model.config.layer_types)}
