"""GPT-NeoX (Pythia): fused query_key_value laid out per head, LayerNorm with bias, partial rotary,
plain MLP with biases, parallel residual with two norms."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .base import DECODER_FIELDS, Decoder, ignored, impl, linear, refuse_if, to_numpy


class GptNeoX(Decoder):
    model_types = ("gpt_neox",)
    config_classes = ("GPTNeoXConfig",)
    architecture = "gpt_neox"
    variants = "per-head fused QKV; LayerNorm; partial rotary (rotary_pct); parallel or sequential residual"
    norm = "layer"
    norm_eps_field = "layer_norm_eps"
    layer_norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    fields = {**{k: v for k, v in DECODER_FIELDS.items()
                 if k not in ("head_dim", "mlp_bias", "num_key_value_heads", "pretraining_tp", "rms_norm_eps")},
              "layer_norm_eps": impl("LayerNorm epsilon"),
              "use_parallel_residual": impl("x + attn(ln1(x)) + mlp(ln2(x)) when true"),
              "hidden_dropout": ignored("dropout is off at inference"),
              "classifier_dropout": ignored("classification heads only"),
              "is_decoder": ignored("GPTNeoXForCausalLM is causal whatever this says (an encoder-decoder flag)")}

    def check(self, config: Any) -> None:
        refuse_if(getattr(config, "add_cross_attention", False), "add_cross_attention=True is not supported")

    def body(self, model: Any) -> Any:
        return model.gpt_neox

    def global_weights(self, sd: Mapping, cfg: Any) -> dict[str, np.ndarray]:
        w = {"embed": to_numpy(sd["gpt_neox.embed_in.weight"]),
             "norm": to_numpy(sd["gpt_neox.final_layer_norm.weight"]),
             "norm_bias": to_numpy(sd["gpt_neox.final_layer_norm.bias"])}
        if not cfg.tie_word_embeddings:
            w["lm_head"] = to_numpy(sd["embed_out.weight" if "embed_out.weight" in sd else "lm_head.weight"]).T
        return w

    def layer_weights(self, sd: Mapping, cfg: Any, i: int, n_heads: int, n_kv: int,
                      head_dim: int) -> dict[str, np.ndarray]:
        p = f"gpt_neox.layers.{i}"
        # query_key_value's output rows are [heads, 3 (q, k, v), head_dim]: regroup to q | k | v.
        qkv = to_numpy(sd[f"{p}.attention.query_key_value.weight"]).reshape(n_heads, 3, head_dim, -1)
        w = {"qkv": np.concatenate([qkv[:, j].reshape(n_heads * head_dim, -1) for j in range(3)]).T}
        if f"{p}.attention.query_key_value.bias" in sd:
            bias = to_numpy(sd[f"{p}.attention.query_key_value.bias"]).reshape(n_heads, 3, head_dim)
            w["qkv_bias"] = np.concatenate([bias[:, j].reshape(-1) for j in range(3)])
        w.update(linear(sd, f"{p}.attention.dense", "o"))
        w.update(linear(sd, f"{p}.mlp.dense_h_to_4h", "fc"))
        w.update(linear(sd, f"{p}.mlp.dense_4h_to_h", "down"))
        for canonical, module in self.layer_norms.items():
            w.update(linear(sd, f"{p}.{module}", canonical, transpose=False))
        return w

    def spec_fields(self, cfg: Any) -> dict:
        return {"mlp": "plain", "n_kv_heads": cfg.num_attention_heads,
                "parallel_residual": bool(cfg.use_parallel_residual)}
