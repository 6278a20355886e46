"""Map a transformers model's parameters to the graph builder's canonical names.

One small adapter per architecture family, each declaring where its tensors
live; the graph builder never branches on HF parameter names. Linear weights
are transposed to [in, out] so the graph is ``MatMul(x, W)``, which is also the
form ONNX Runtime's weight-only quantizer rewrites to MatMulNBits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .features import LLAMA_FAMILY, ModelFeatures, read_features
from .graph import DecoderSpec


def _np(t: Any) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def extract(model: Any) -> tuple[DecoderSpec, dict[str, np.ndarray], ModelFeatures]:
    """Return the architecture spec, float32 weights and config features of an HF causal LM (torch).

    The config is checked field by field first (export/features.py): a feature the graph does
    not implement is refused by name before any weight is copied.
    """
    features = read_features(model.config)
    if features.model_type in LLAMA_FAMILY:
        return (*_llama(model, features), features)
    return (*_gpt2(model, features), features)


def _llama(model: Any, features: ModelFeatures) -> tuple[DecoderSpec, dict[str, np.ndarray]]:
    cfg = model.config
    sd = model.state_dict()
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rotary = model.model.rotary_emb
    w: dict[str, np.ndarray] = {"embed": _np(sd["model.embed_tokens.weight"]), "norm": _np(sd["model.norm.weight"])}
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) or "lm_head.weight" not in sd
    if not tied:
        w["lm_head"] = _np(sd["lm_head.weight"]).T
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        q, k, v = (_np(sd[f"{p}.self_attn.{n}_proj.weight"]).T for n in "qkv")
        w[f"layers.{i}.qkv"] = np.concatenate([q, k, v], axis=1)
        if f"{p}.self_attn.q_proj.bias" in sd:  # qwen2 has q/k/v biases
            w[f"layers.{i}.qkv_bias"] = np.concatenate([_np(sd[f"{p}.self_attn.{n}_proj.bias"]) for n in "qkv"])
        w[f"layers.{i}.o"] = _np(sd[f"{p}.self_attn.o_proj.weight"]).T
        if f"{p}.self_attn.o_proj.bias" in sd:
            w[f"layers.{i}.o_bias"] = _np(sd[f"{p}.self_attn.o_proj.bias"])
        w[f"layers.{i}.attn_norm"] = _np(sd[f"{p}.input_layernorm.weight"])
        w[f"layers.{i}.mlp_norm"] = _np(sd[f"{p}.post_attention_layernorm.weight"])
        gate, up = (_np(sd[f"{p}.mlp.{n}_proj.weight"]).T for n in ("gate", "up"))
        w[f"layers.{i}.gate_up"] = np.concatenate([gate, up], axis=1)
        w[f"layers.{i}.down"] = _np(sd[f"{p}.mlp.down_proj.weight"]).T
        if f"{p}.mlp.gate_proj.bias" in sd:  # mlp_bias=True
            w[f"layers.{i}.gate_up_bias"] = np.concatenate([_np(sd[f"{p}.mlp.{n}_proj.bias"]) for n in ("gate", "up")])
            w[f"layers.{i}.down_bias"] = _np(sd[f"{p}.mlp.down_proj.bias"])
    spec = DecoderSpec(
        architecture="llama", n_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        norm_eps=float(cfg.rms_norm_eps), attn_scale=float(head_dim ** -0.5),
        # The rotary module already applied any static rope scaling (linear, llama3, yarn) to inv_freq.
        # 'dynamic' may have rescaled inv_freq after a long forward; its original frequencies are the
        # exact ones up to max_position_embeddings, the only range such a bundle is exported for.
        inv_freq=tuple(float(f) for f in _np(rotary.original_inv_freq if features.rope_type == "dynamic"
                                             else rotary.inv_freq)),
        rope_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        tied_embeddings=tied, activation=features.activation, layer_windows=features.layer_windows,
    )
    return spec, w


def _gpt2(model: Any, features: ModelFeatures) -> tuple[DecoderSpec, dict[str, np.ndarray]]:
    cfg = model.config
    sd = model.state_dict()
    head_dim = cfg.n_embd // cfg.n_head
    w: dict[str, np.ndarray] = {
        "embed": _np(sd["transformer.wte.weight"]), "pos_embed": _np(sd["transformer.wpe.weight"]),
        "norm": _np(sd["transformer.ln_f.weight"]), "norm_bias": _np(sd["transformer.ln_f.bias"]),
    }
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}"
        # GPT-2's Conv1D already stores weights as [in, out].
        w[f"layers.{i}.qkv"] = _np(sd[f"{p}.attn.c_attn.weight"])
        w[f"layers.{i}.qkv_bias"] = _np(sd[f"{p}.attn.c_attn.bias"])
        w[f"layers.{i}.o"] = _np(sd[f"{p}.attn.c_proj.weight"])
        w[f"layers.{i}.o_bias"] = _np(sd[f"{p}.attn.c_proj.bias"])
        w[f"layers.{i}.attn_norm"] = _np(sd[f"{p}.ln_1.weight"])
        w[f"layers.{i}.attn_norm_bias"] = _np(sd[f"{p}.ln_1.bias"])
        w[f"layers.{i}.mlp_norm"] = _np(sd[f"{p}.ln_2.weight"])
        w[f"layers.{i}.mlp_norm_bias"] = _np(sd[f"{p}.ln_2.bias"])
        w[f"layers.{i}.fc"] = _np(sd[f"{p}.mlp.c_fc.weight"])
        w[f"layers.{i}.fc_bias"] = _np(sd[f"{p}.mlp.c_fc.bias"])
        w[f"layers.{i}.down"] = _np(sd[f"{p}.mlp.c_proj.weight"])
        w[f"layers.{i}.down_bias"] = _np(sd[f"{p}.mlp.c_proj.bias"])
    scale = head_dim ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
    spec = DecoderSpec(
        architecture="gpt2", n_layers=cfg.n_layer, hidden_size=cfg.n_embd, n_heads=cfg.n_head,
        n_kv_heads=cfg.n_head, head_dim=head_dim, intermediate_size=cfg.n_inner or 4 * cfg.n_embd,
        vocab_size=cfg.vocab_size, norm_eps=float(cfg.layer_norm_epsilon), attn_scale=float(scale),
        tied_embeddings=True, max_positions=cfg.n_positions, activation=features.activation,
        layer_windows=features.layer_windows,
    )
    return spec, w
