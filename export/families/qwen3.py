"""Qwen3: the base decoder with per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from .base import DECODER_FIELDS, WINDOW_FIELDS, Decoder, impl


class Qwen3(Decoder):
    model_types = ("qwen3",)
    config_classes = ("Qwen3Config",)
    architecture = "qwen3"
    variants = "per-head q/k RMSNorm; sliding window on layers >= max_window_layers; attention bias"
    qk_norm = "head"
    fields = {**{k: v for k, v in DECODER_FIELDS.items() if k not in ("mlp_bias", "pretraining_tp")},
              **WINDOW_FIELDS, "rms_norm_eps": impl("RMSNorm epsilon (layer norms and per-head q/k norms)")}
