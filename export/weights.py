"""Map a transformers model's parameters to the graph builder's canonical names.

One builder per architecture family (export/families/), each declaring where its tensors
live; the graph builder never branches on HF parameter names. Linear weights are
transposed to [in, out] so the graph is ``MatMul(x, W)``, which is also the form ONNX
Runtime's weight-only quantizer rewrites to MatMulNBits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .families import FAMILIES
from .features import ModelFeatures, read_features
from .graph import DecoderSpec


def extract(model: Any) -> tuple[DecoderSpec, dict[str, np.ndarray], ModelFeatures]:
    """Return the architecture spec, float32 weights and config features of an HF causal LM (torch).

    The config is checked field by field first (export/features.py): a feature the graph does
    not implement is refused by name before any weight is copied.
    """
    features = read_features(model.config)
    spec, weights = FAMILIES[features.model_type].extract(model, features)
    return spec, weights, features
