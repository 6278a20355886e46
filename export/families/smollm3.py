"""SmolLM3: the base decoder with NoPE layers (no_rope_layers[i] == 0: no rotary on that layer)."""

from __future__ import annotations

from typing import Any

from .base import DECODER_FIELDS, WINDOW_FIELDS, Decoder, checked, ignored, refuse_if


class SmolLM3(Decoder):
    model_types = ("smollm3",)
    config_classes = ("SmolLM3Config",)
    architecture = "smollm3"
    variants = "NoPE layers (no_rope_layers); sliding window on layers >= max_window_layers"
    fields = {**{k: v for k, v in DECODER_FIELDS.items() if k not in ("head_dim", "pretraining_tp")},
              **WINDOW_FIELDS,
              "no_rope_layers": checked("per layer 1 = rotary, 0 = no position encoding (NoPE); one entry per "
                                        "layer"),
              "no_rope_layer_interval": ignored("the default pattern no_rope_layers is built from; the list is read")}

    def check(self, config: Any) -> None:
        layers = getattr(config, "no_rope_layers", None)
        refuse_if(layers is None or len(layers) != config.num_hidden_layers or set(layers) - {0, 1},
                  f"no_rope_layers={layers!r} must have one 0/1 entry per layer ({config.num_hidden_layers})")

    def rope(self, model: Any, features) -> dict:
        return {**super().rope(model, features),
                "layer_rope": tuple(0 if use else -1 for use in model.config.no_rope_layers)}
