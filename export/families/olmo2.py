"""OLMo 2: no pre-norms; RMSNorm after attention and after the MLP; q/k RMSNorm over the whole projection."""

from __future__ import annotations

from .base import DECODER_FIELDS, Decoder, impl


class Olmo2(Decoder):
    model_types = ("olmo2",)
    config_classes = ("Olmo2Config",)
    architecture = "olmo2"
    variants = "post-norms without pre-norms; q/k RMSNorm over the full projection"
    fields = {**{k: v for k, v in DECODER_FIELDS.items() if k not in ("head_dim", "mlp_bias", "pretraining_tp")},
              "rms_norm_eps": impl("RMSNorm epsilon (post-norms and q/k norms)")}
    qk_norm = "full"
    layer_norms = {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
