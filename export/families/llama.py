"""Llama 2/3.x, Qwen2 and Mistral: the base decoder as it is."""

from __future__ import annotations

from typing import Any

from .base import DECODER_FIELDS, WINDOW_FIELDS, Decoder


class Llama(Decoder):
    model_types = ("llama",)
    config_classes = ("LlamaConfig",)
    variants = ("rope default / linear / llama3 / yarn / longrope, dynamic up to max_position_embeddings; "
                "attention and MLP biases; head_dim != hidden/heads; any ACT2FN gelu/silu/relu")
    fields = {**DECODER_FIELDS, **WINDOW_FIELDS}


class Qwen2(Decoder):
    model_types = ("qwen2",)
    config_classes = ("Qwen2Config",)
    variants = "q/k/v biases; sliding window on layers >= max_window_layers"
    fields = {**DECODER_FIELDS, **WINDOW_FIELDS}


class Mistral(Decoder):
    model_types = ("mistral",)
    config_classes = ("MistralConfig",)
    variants = "sliding window on every layer"
    fields = {**DECODER_FIELDS, **WINDOW_FIELDS}

    def layer_windows(self, config: Any) -> tuple[int, ...]:
        # transformers' Mistral applies its window (when set) to every layer and ignores layer_types.
        return (self.window(config) or 0,) * config.num_hidden_layers
