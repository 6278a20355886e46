"""Drafters, and the registry that names them.

Adding a drafter is one new module in runtime/ (a class meeting :class:`Drafter` and a
``build(config, draft)`` function) plus one entry in :data:`DRAFTERS`. The CLI's
``--drafter`` choices, the server's ``specedge.drafter``, the bench's configuration
names and the manifest's ``speculation.drafter`` all read their names from it.
"""

from __future__ import annotations

from . import composite_drafter, model_drafter, ngram_drafter
from .drafting import DraftModel, Drafter, DrafterSpec
from .composite_drafter import CompositeDrafter
from .model_drafter import ModelDrafter
from .ngram_drafter import NGramDrafter

NO_DRAFTER = "none"  # speculation off: every step is a plain target step

DRAFTERS: dict[str, DrafterSpec] = {
    "model": DrafterSpec(model_drafter.build, needs_draft_model=True,
                         help="the bundle's draft model proposes (best on free-form text)"),
    "ngram": DrafterSpec(ngram_drafter.build, needs_draft_model=False,
                         help="prompt lookup: continue an earlier occurrence of the last tokens (code, quoting)"),
    "composite": DrafterSpec(composite_drafter.build, needs_draft_model=True,
                             help="prompt lookup when the text repeats itself, else the draft model"),
}
DRAFTER_CHOICES = (NO_DRAFTER, *DRAFTERS)  # what --drafter, specedge.drafter and the manifest accept


def needs_draft_model(name: str) -> bool:
    """Whether drafter ``name`` (a DRAFTER_CHOICES value) runs the draft model."""
    return name in DRAFTERS and DRAFTERS[name].needs_draft_model


__all__ = ["DRAFTERS", "DRAFTER_CHOICES", "NO_DRAFTER", "CompositeDrafter", "DraftModel", "Drafter",
           "DrafterSpec", "ModelDrafter", "NGramDrafter", "needs_draft_model"]
