"""StableLM: LayerNorm with bias, partial rotary (0.25 by default), optional q/k/v biases, optional per-head
LayerNorm on q and k (qk_layernorm), optional parallel residual sharing one input norm."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .base import DECODER_FIELDS, Decoder, ignored, impl, to_numpy


class StableLm(Decoder):
    model_types = ("stablelm",)
    config_classes = ("StableLmConfig",)
    architecture = "stablelm"
    variants = "LayerNorm; partial rotary; use_qkv_bias; per-head q/k LayerNorm; parallel residual"
    norm = "layer"
    norm_eps_field = "layer_norm_eps"
    qk_norm = "head"
    fields = {**{k: v for k, v in DECODER_FIELDS.items()
                 if k not in ("attention_bias", "head_dim", "mlp_bias", "pretraining_tp", "rms_norm_eps")},
              "layer_norm_eps": impl("LayerNorm epsilon (layer norms and per-head q/k norms)"),
              "use_qkv_bias": impl("q/k/v biases"),
              "qk_layernorm": impl("per-head LayerNorm (one weight per head) on q and k before rotary"),
              "use_parallel_residual": impl("x + attn(ln(x)) + mlp(ln(x)), one shared input norm"),
              "hidden_dropout": ignored("dropout is off at inference")}

    def layer_weights(self, sd: Mapping, cfg: Any, i: int, n_heads: int, n_kv: int,
                      head_dim: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}"
        w = {**self.attention_weights(sd, p, n_heads, n_kv, head_dim), **self.mlp_weights(sd, p)}
        norms = {"attn_norm": "input_layernorm",
                 # The parallel residual feeds the MLP the same normed input as attention.
                 "mlp_norm": "input_layernorm" if cfg.use_parallel_residual else "post_attention_layernorm"}
        for canonical, module in norms.items():
            w[canonical] = to_numpy(sd[f"{p}.{module}.weight"])
            w[f"{canonical}_bias"] = to_numpy(sd[f"{p}.{module}.bias"])
        if cfg.qk_layernorm:
            for name, heads in (("q", n_heads), ("k", n_kv)):
                # One LayerNorm (weight only) per head: stacked to [heads, head_dim].
                w[f"{name}_norm"] = np.stack([to_numpy(sd[f"{p}.self_attn.{name}_layernorm.norms.{h}.weight"])
                                              for h in range(heads)])
        return w

    def spec_fields(self, cfg: Any) -> dict:
        return {"parallel_residual": bool(cfg.use_parallel_residual), "qk_norm": "head" if cfg.qk_layernorm else ""}
