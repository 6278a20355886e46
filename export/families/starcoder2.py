"""Starcoder2: LayerNorm with bias, biases on every linear (use_bias), plain gelu-tanh MLP (c_fc, c_proj),
sliding window on every layer when set."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .base import DECODER_FIELDS, WINDOW_FIELDS, Decoder, ignored, impl, linear


class Starcoder2(Decoder):
    model_types = ("starcoder2",)
    config_classes = ("Starcoder2Config",)
    architecture = "starcoder2"
    variants = "LayerNorm; biases (use_bias); non-gated MLP; sliding window"
    norm = "layer"
    norm_eps_field = "norm_epsilon"
    fields = {**{k: v for k, v in DECODER_FIELDS.items()
                 if k not in ("attention_bias", "head_dim", "mlp_bias", "pretraining_tp", "rms_norm_eps")},
              "sliding_window": WINDOW_FIELDS["sliding_window"],
              "norm_epsilon": impl("LayerNorm epsilon"),
              "use_bias": impl("biases on q/k/v/o and the MLP"),
              "residual_dropout": ignored("dropout is off at inference"),
              "embedding_dropout": ignored("dropout is off at inference")}

    def layer_windows(self, config: Any) -> tuple[int, ...]:
        # transformers' Starcoder2 applies config.sliding_window (when set) on every layer.
        return (self.window(config) or 0,) * config.num_hidden_layers

    def mlp_weights(self, sd: Mapping, p: str) -> dict[str, np.ndarray]:
        return {**linear(sd, f"{p}.mlp.c_fc", "fc"), **linear(sd, f"{p}.mlp.c_proj", "down")}

    def spec_fields(self, cfg: Any) -> dict:
        return {"mlp": "plain"}
