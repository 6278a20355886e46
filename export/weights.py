"""Map a transformers model's parameters to the graph builder's canonical names.

One builder per architecture family (export/families/), each declaring where its tensors
live; the graph builder never branches on HF parameter names. Linear weights are
transposed to [in, out] so the graph is ``MatMul(x, W)``, which is also the form ONNX
Runtime's weight-only quantizer rewrites to MatMulNBits.
"""

from __future__ import annotations

from typing import Any


from .families import FAMILIES
from .features import ModelFeatures, read_features
from .graph import DecoderSpec
from .lazy_weights import Weights


def extract(model: Any) -> tuple[DecoderSpec, Weights, ModelFeatures]:
    """Return the architecture spec, float32 weights and config features of an HF causal LM (torch).

    The weights are a read-only Mapping whose fused entries are made on each read (export/lazy_weights.py).

    The config is checked field by field first (export/features.py): a feature the graph does
    not implement is refused by name before any weight is copied.
    """
    features = read_features(model.config)
    spec, weights = FAMILIES[features.model_type].extract(model, features)
    return spec, Weights(weights), features
