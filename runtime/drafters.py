"""Drafters, and the registry that names them.

Adding a drafter is one new module in runtime/ (a class meeting :class:`Drafter` and a
``build(config, draft)`` function) plus one entry in :data:`DRAFTERS`. The CLI's
``--drafter`` choices, the server's ``specedge.drafter``, the bench's configuration
names and the manifest's ``speculation.drafter`` all read their names from it.

This module imports only the standard library (the manifest reads it, and the manifest
must load with nothing else installed): each entry names its module, imported when a
drafter is first built.
"""

from __future__ import annotations

import importlib
from typing import Callable

from .drafting import DraftModel, Drafter, DrafterSpec


def _built_by(module: str) -> Callable:
    """The ``build(config, draft)`` of runtime/<module>.py, imported on first use."""
    def build(config, draft):
        return importlib.import_module(f"{__package__}.{module}").build(config, draft)

    return build

NO_DRAFTER = "none"  # speculation off: every step is a plain target step

DRAFTERS: dict[str, DrafterSpec] = {
    "model": DrafterSpec(_built_by("model_drafter"), needs_draft_model=True,
                         help="the bundle's draft model proposes (best on free-form text)"),
    "ngram": DrafterSpec(_built_by("ngram_drafter"), needs_draft_model=False,
                         help="prompt lookup: continue an earlier occurrence of the last tokens (code, quoting)"),
    "composite": DrafterSpec(_built_by("composite_drafter"), needs_draft_model=True,
                             help="prompt lookup when the text repeats itself, else the draft model"),
}
DRAFTER_CHOICES = (NO_DRAFTER, *DRAFTERS)  # what --drafter, specedge.drafter and the manifest accept


def needs_draft_model(name: str) -> bool:
    """Whether drafter ``name`` (a DRAFTER_CHOICES value) runs the draft model."""
    return name in DRAFTERS and DRAFTERS[name].needs_draft_model


_CLASSES = {"ModelDrafter": "model_drafter", "NGramDrafter": "ngram_drafter", "CompositeDrafter": "composite_drafter"}


def __getattr__(name: str):
    """The drafter classes, importable from here without importing them for the manifest."""
    if name in _CLASSES:
        return getattr(importlib.import_module(f"{__package__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DRAFTERS", "DRAFTER_CHOICES", "NO_DRAFTER", "DraftModel", "Drafter", "DrafterSpec", "needs_draft_model"]
