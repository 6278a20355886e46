"""Granite: the base decoder with four multipliers (embedding, attention scale, residual, logits)."""

from __future__ import annotations

from typing import Any

from .base import DECODER_FIELDS, Decoder, impl


class Granite(Decoder):
    model_types = ("granite",)
    config_classes = ("GraniteConfig",)
    architecture = "granite"
    variants = "embedding_multiplier, attention_multiplier (the attention scale), residual_multiplier, logits_scaling"
    fields = {**{k: v for k, v in DECODER_FIELDS.items() if k not in ("head_dim", "pretraining_tp")},
              "embedding_multiplier": impl("multiplies the token embeddings"),
              "attention_multiplier": impl("the attention scale (replaces 1/sqrt(head_dim))"),
              "residual_multiplier": impl("scales each block's output before the residual add"),
              "logits_scaling": impl("logits are divided by it")}

    def spec_fields(self, cfg: Any) -> dict:
        return {"embed_scale": float(cfg.embedding_multiplier), "attn_scale": float(cfg.attention_multiplier),
                "residual_scale": float(cfg.residual_multiplier), "logit_scale": 1.0 / float(cfg.logits_scaling)}
