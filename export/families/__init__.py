"""One builder per architecture family, on the shared base in ``base.py``.

Adding a family is one module: a ``Decoder`` subclass that states its config fields, where its
tensors live and the DecoderSpec fields it sets (see ``qwen3.py`` for a short one), plus its
entry in ``FAMILIES`` below and a tiny-checkpoint case in tests/integration/test_families.py.
"""

from __future__ import annotations

from .base import Family
from .gemma import Gemma2, Gemma3Text
from .gpt2 import Gpt2
from .gpt_neox import GptNeoX
from .granite import Granite
from .llama import Llama, Mistral, Qwen2
from .olmo2 import Olmo2
from .phi3 import Phi3
from .qwen3 import Qwen3
from .smollm3 import SmolLM3
from .stablelm import StableLm
from .starcoder2 import Starcoder2

FAMILIES: dict[str, Family] = {
    model_type: family
    for family in (Llama(), Qwen2(), Mistral(), Gpt2(), Qwen3(), Gemma3Text(), Phi3(), Gemma2(), SmolLM3(), Granite(),
                   Olmo2(), StableLm(), GptNeoX(), Starcoder2())
    for model_type in family.model_types
}

# Families users ask for that are refused by name, with what exporting them would take.
REFUSED: dict[str, str] = {
    "qwen3_moe": "mixture-of-experts is not supported yet: it needs a router (top-k softmax over experts) and "
                 "per-expert MLPs in the graph (ORT's MoE / QMoE contrib ops, or a Gather over stacked expert "
                 "weights), and int4 quantization of the expert weights",
    "mixtral": "mixture-of-experts is not supported yet: it needs a router (top-k softmax over experts) and "
               "per-expert MLPs in the graph (ORT's MoE / QMoE contrib ops, or a Gather over stacked expert "
               "weights), and int4 quantization of the expert weights",
    "gemma3": "the multimodal Gemma 3 checkpoint is not supported; export its text model (model_type "
              "gemma3_text, e.g. the 270m/1b checkpoints)",
}

SUPPORTED = tuple(FAMILIES)
