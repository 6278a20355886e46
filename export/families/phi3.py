"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary (Phi-4-mini 0.75), longrope
(exact up to original_max_position_embeddings), a sliding window on every layer when set."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .base import DECODER_FIELDS, WINDOW_FIELDS, Decoder, checked, ignored, linear


class Phi3(Decoder):
    model_types = ("phi3",)
    config_classes = ("Phi3Config",)
    architecture = "phi3"
    variants = ("fused qkv / gate_up; partial rotary (Phi-4-mini); longrope exact up to "
                "original_max_position_embeddings; sliding window")
    fields = {**{k: v for k, v in DECODER_FIELDS.items()
                 if k not in ("attention_bias", "head_dim", "mlp_bias", "pretraining_tp")},
              "sliding_window": WINDOW_FIELDS["sliding_window"],
              "original_max_position_embeddings": checked("longrope: positions beyond it use the long factors, "
                                                          "recomputed per forward; the exact limit of a longrope "
                                                          "bundle"),
              "resid_pdrop": ignored("dropout is off at inference"),
              "embd_pdrop": ignored("dropout is off at inference")}

    def layer_windows(self, config: Any) -> tuple[int, ...]:
        # transformers' Phi3Attention applies config.sliding_window (when set) on every layer.
        return (self.window(config) or 0,) * config.num_hidden_layers

    def attention_weights(self, sd: Mapping, p: str, n_heads: int, n_kv: int, head_dim: int) -> dict[str, np.ndarray]:
        # qkv_proj's rows are already q | k | v, the canonical order.
        return {**linear(sd, f"{p}.self_attn.qkv_proj", "qkv"), **linear(sd, f"{p}.self_attn.o_proj", "o")}

    def mlp_weights(self, sd: Mapping, p: str) -> dict[str, np.ndarray]:
        # gate_up_proj's rows are gate | up (Phi3MLP chunks them in that order), the canonical order.
        return {**linear(sd, f"{p}.mlp.gate_up_proj", "gate_up"), **linear(sd, f"{p}.mlp.down_proj", "down")}
