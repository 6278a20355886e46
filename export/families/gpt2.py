"""GPT-2: learned positions, LayerNorm, Conv1D weights stored [in, out], plain gelu MLP."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import DecoderSpec
from .base import ACTIVATIONS, BASE_FIELDS, Family, ModelFeatures, activation, checked, ignored, impl, refuse_if, \
    to_numpy


class Gpt2(Family):
    model_types = ("gpt2",)
    config_classes = ("GPT2Config",)
    architecture = "gpt2"
    variants = "learned positions (max_context <= n_positions); standard attention only"
    fields = {
        **BASE_FIELDS,
        "n_embd": impl("model width"),
        "n_layer": impl("layer count"),
        "n_head": impl("heads"),
        "n_inner": impl("MLP width (default 4 x n_embd)"),
        "n_positions": checked("learned position table: --max-context above it is refused"),
        "activation_function": checked(f"MLP activation; implemented: {', '.join(ACTIVATIONS)}"),
        "layer_norm_epsilon": impl("LayerNorm epsilon"),
        "scale_attn_weights": impl("1/sqrt(head_dim) attention scale on or off"),
        "scale_attn_by_inverse_layer_idx": checked("must be false (per-layer 1/(i+1) scale not implemented)"),
        "reorder_and_upcast_attn": ignored("fp32 upcast of the attention product; the graph's softmax is fp32 "
                                           "anyway"),
        "add_cross_attention": checked("must be false (decoder-only)"),
        "resid_pdrop": ignored("dropout is off at inference"),
        "embd_pdrop": ignored("dropout is off at inference"),
        "attn_pdrop": ignored("dropout is off at inference"),
        "summary_type": ignored("sequence-summary head, not the LM head"),
        "summary_use_proj": ignored("sequence-summary head, not the LM head"),
        "summary_activation": ignored("sequence-summary head, not the LM head"),
        "summary_proj_to_labels": ignored("sequence-summary head, not the LM head"),
        "summary_first_dropout": ignored("sequence-summary head, not the LM head"),
    }

    def features(self, config: Any) -> ModelFeatures:
        act = activation(getattr(config, "activation_function", "gelu_new"), "activation_function")
        for name in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            refuse_if(getattr(config, name, False), f"{name}=True is not supported")
        positions = int(config.n_positions)
        return ModelFeatures(model_type="gpt2", activation=act, layer_windows=(0,) * config.n_layer,
                             rope_type="", trained_context=positions, exact_context=positions)

    def extract(self, model: Any, features: ModelFeatures) -> tuple[DecoderSpec, dict[str, np.ndarray]]:
        cfg = model.config
        sd = model.state_dict()
        head_dim = cfg.n_embd // cfg.n_head
        w: dict[str, np.ndarray] = {
            "embed": to_numpy(sd["transformer.wte.weight"]), "pos_embed": to_numpy(sd["transformer.wpe.weight"]),
            "norm": to_numpy(sd["transformer.ln_f.weight"]), "norm_bias": to_numpy(sd["transformer.ln_f.bias"]),
        }
        # GPT-2's Conv1D already stores weights as [in, out].
        names = {"qkv": "attn.c_attn", "o": "attn.c_proj", "attn_norm": "ln_1", "mlp_norm": "ln_2",
                 "fc": "mlp.c_fc", "down": "mlp.c_proj"}
        for i in range(cfg.n_layer):
            for canonical, module in names.items():
                w[f"layers.{i}.{canonical}"] = to_numpy(sd[f"transformer.h.{i}.{module}.weight"])
                w[f"layers.{i}.{canonical}_bias"] = to_numpy(sd[f"transformer.h.{i}.{module}.bias"])
        scale = head_dim ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        spec = DecoderSpec(
            architecture="gpt2", n_layers=cfg.n_layer, hidden_size=cfg.n_embd, n_heads=cfg.n_head,
            n_kv_heads=cfg.n_head, head_dim=head_dim, intermediate_size=cfg.n_inner or 4 * cfg.n_embd,
            vocab_size=cfg.vocab_size, norm_eps=float(cfg.layer_norm_epsilon), attn_scale=float(scale),
            tied_embeddings=True, max_positions=cfg.n_positions, activation=features.activation,
            layer_windows=features.layer_windows, norm="layer", mlp="plain",
        )
        return spec, w
