"""What a checkpoint's config asks of the graph, read field by field before any graph is built.

Every config field of a supported family is declared in its builder (export/families/) with
what the exporter does with it:

- ``implemented``: the graph computes it (and export validation compares it with PyTorch);
- ``checked``: some values are implemented, any other value is refused by name;
- ``ignored``: it cannot change inference logits (training-only, metadata, output flags),
  and the reason is written next to it.

A field the table does not know, set away from its config class's default, is named in a
warning and in the manifest: it may be metadata (GGUF conversions add some) or a feature.
Export validation then decides, and it runs to the last position the bundle can hold
(export/validate.py), so a feature that changes logits anywhere in that range fails there.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from ..errors import InvalidParameterError, UnsupportedModelError
from .families import FAMILIES, REFUSED, SUPPORTED
from .families.base import (ACTIVATIONS, LAYER_TYPES, LIMITED_ROPE_TYPES, STATIC_ROPE_TYPES, Field,
                            ModelFeatures, rope_parameters)

# Defined with the family builders; importable from here, the module the exporter and the tests read.
__all__ = ["ACTIVATIONS", "LAYER_TYPES", "LIMITED_ROPE_TYPES", "STATIC_ROPE_TYPES", "FIELDS", "Field", "ModelFeatures",
           "SUPPORTED", "ContextBeyondTrainingWarning", "UnknownConfigFieldWarning", "check_context", "fields_table",
           "read_features", "rope_parameters", "validation_edges"]

# Every supported model_type's field table (export/families/<family>.py declares it).
FIELDS: dict[str, dict[str, Field]] = {model_type: dict(family.fields) for model_type, family in FAMILIES.items()}


def read_features(config: Any) -> ModelFeatures:
    """Check every config field against its family's table; raise UnsupportedModelError naming what is not
    implemented."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise UnsupportedModelError(f"architecture {model_type!r}: {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(f"architecture {model_type!r} is not supported yet; supported: "
                                    f"{', '.join(SUPPORTED)}")
    unknown = _unknown_fields(config, FIELDS[model_type])
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("is_encoder_decoder=True: only decoder-only models are supported")
    if getattr(config, "quantization_config", None):
        raise UnsupportedModelError("quantization_config is set: pre-quantized checkpoints are not supported; export "
                                    "the float checkpoint and pass --precision int4 or int8")
    features = FAMILIES[model_type].features(config)
    if unknown:
        warnings.warn(f"{model_type} config field(s) {', '.join(unknown)} are not read by the exporter; export "
                      "validation (to max_context) decides whether they change the logits",
                      UnknownConfigFieldWarning, stacklevel=2)
    return replace(features, unknown_fields=unknown)


class UnknownConfigFieldWarning(UserWarning):
    """The config sets a field the exporter does not know."""


def _unknown_fields(config: Any, known: dict[str, Field]) -> tuple[str, ...]:
    values = config.to_dict()
    defaults = type(config)().to_dict()
    # Special-token ids (unk, sep, ...) only name tokens for the tokenizer.
    return tuple(sorted(k for k, v in values.items() if k not in known and not k.endswith("_token_id")
                        and v != defaults.get(k, _MISSING)))


_MISSING = object()


class ContextBeyondTrainingWarning(UserWarning):
    """--max-context exceeds the context the checkpoint was trained for."""


def check_context(features: ModelFeatures, max_context: int) -> str | None:
    """Refuse a max_context the graph cannot compute exactly; return (and warn) when it passes training.

    Returns the warning text, or None when max_context is within the trained context.
    """
    if features.exact_context is not None and max_context > features.exact_context:
        why = ("learned positions" if features.model_type == "gpt2" else
               f"positions computed exactly (rope type {features.rope_type!r} rescales its frequencies by each "
               "forward call's length past that limit, so cached and speculative decoding there cannot match "
               "transformers)")
        raise InvalidParameterError(f"max_context {max_context} exceeds this {features.model_type} model's "
                                    f"{features.exact_context} {why}; export with --max-context "
                                    f"{features.exact_context} or less")
    if max_context <= features.trained_context:
        return None
    message = (f"max_context {max_context} exceeds the {features.trained_context} positions this checkpoint was "
               f"trained for (max_position_embeddings): the graph computes positions past it exactly as "
               "transformers does, but the model's quality there is untested")
    warnings.warn(message, ContextBeyondTrainingWarning, stacklevel=2)
    return message


def validation_edges(features: ModelFeatures, max_context: int) -> tuple[int, ...]:
    """Positions export validation straddles with a verify block on a cached prefix, ascending.

    Every window length and the trained context below max_context (where attention or positions
    change behaviour), and the last position the cache holds (max_context - 1), so every rotary
    angle, position-table row and cache slot a bundle can ever use is computed once against PyTorch.
    """
    edges = set(features.windows) | {features.trained_context, max_context - 1}
    return tuple(sorted(e for e in edges if 0 < e < max_context))


def fields_table(model_type: str) -> list[tuple[str, str, str]]:
    """(field, handling, note) for every config field the exporter reads for ``model_type``."""
    return [(name, f.handling, f.note) for name, f in sorted(FIELDS[model_type].items())]

