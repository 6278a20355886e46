"""Drafters, and the registry that names them.

Adding a drafter is one new module in runtime/ (a class meeting :class:`Drafter` and a
``build(config, draft)`` function, or ``build(config, draft, replies)`` for a drafter that
reads the Generator's cross-reply memory) plus one entry in :data:`DRAFTERS`. The CLI's
``--drafter`` choices, the server's ``specedge.drafter``, the bench's configuration
names and loading (which checks the manifest's ``speculation.drafter``) all read their names from it.

This module imports only the standard library (the CLI's options read it before anything heavy
loads): each entry names its module, imported when a drafter is first built.
"""

from __future__ import annotations

import importlib

from .drafting import DraftModel, Drafter, DrafterSpec


def _entry(module: str, *, needs_draft_model: bool, help: str, reads_replies: bool = False,
           optional_draft_model: bool = False, per_source: bool = False) -> DrafterSpec:
    """The registry entry of runtime/<module>.py, whose ``build`` is imported on first use. Its
    ``build(config, draft)`` gets ``replies`` as a third argument only when ``reads_replies``."""
    def build(config, draft, replies):
        make = importlib.import_module(f"{__package__}.{module}").build
        return make(config, draft, replies) if reads_replies else make(config, draft)

    return DrafterSpec(build, needs_draft_model=needs_draft_model, reads_replies=reads_replies, help=help,
                       optional_draft_model=optional_draft_model, per_source=per_source)

NO_DRAFTER = "none"  # speculation off: every step is a plain target step

DEFAULT_DRAFTER = "auto"  # what a bundle runs unless its manifest or the call names another

DRAFTERS: dict[str, DrafterSpec] = {
    "auto": _entry("auto_drafter", needs_draft_model=False, reads_replies=True, optional_draft_model=True, per_source=True,
                   help="the default: per step, the suffix lookup (with earlier replies; 1-token guesses on free "
                        "rows), the draft model (if the bundle has one) or a plain step, whichever the cost "
                        "model expects to be fastest"),
    "model": _entry("model_drafter", needs_draft_model=True,
                    help="the bundle's draft model proposes (best on free-form text)"),
    "ngram": _entry("ngram_drafter", needs_draft_model=False,
                    help="prompt lookup: continue an earlier occurrence of the last tokens (code, quoting)"),
    "composite": _entry("composite_drafter", needs_draft_model=True, per_source=True,
                        help="prompt lookup or the draft model, per step whichever the cost model expects to be "
                             "fastest (with a fixed k: the lookup when the text repeats itself, else the model)"),
    "suffix": _entry("suffix_drafter", needs_draft_model=False, reads_replies=True,
                     help="suffix lookup over the prompt, the output and earlier replies (agents, read-backs)"),
}
DRAFTER_CHOICES = (NO_DRAFTER, *DRAFTERS)  # what --drafter, specedge.drafter and the manifest accept


def reads_replies(name: str) -> bool:
    """Whether drafter ``name`` (a DRAFTER_CHOICES value) reads the cross-reply memory (so finished
    replies are fed to it)."""
    return name in DRAFTERS and DRAFTERS[name].reads_replies


def uses_draft_model(name: str, has_draft: bool) -> bool:
    """Whether drafter ``name`` runs a draft model on a bundle that has one (``has_draft``) or not."""
    return needs_draft_model(name) or (has_draft and name in DRAFTERS and DRAFTERS[name].optional_draft_model)


def needs_draft_model(name: str) -> bool:
    """Whether drafter ``name`` (a DRAFTER_CHOICES value) runs the draft model."""
    return name in DRAFTERS and DRAFTERS[name].needs_draft_model


_CLASSES = {"AutoDrafter": "auto_drafter", "ModelDrafter": "model_drafter", "NGramDrafter": "ngram_drafter", "CompositeDrafter": "composite_drafter",
            "SuffixDrafter": "suffix_drafter"}


def __getattr__(name: str):
    """The drafter classes, importable from here without importing them for the manifest."""
    if name in _CLASSES:
        return getattr(importlib.import_module(f"{__package__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_DRAFTER", "DRAFTERS", "DRAFTER_CHOICES", "NO_DRAFTER", "DraftModel", "Drafter", "DrafterSpec", "needs_draft_model",
           "reads_replies", "uses_draft_model"]
