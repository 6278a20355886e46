"""The composite drafter: prompt lookup (n-gram) or the draft model.

Adaptive, it runs under the default controller (:class:`~.policies.DefaultK`), which chooses
each step's source from each one's own acceptance and cost, as for the default drafter
(runtime/auto_drafter.py, whose lookup is the suffix drafter with earlier replies). With a
fixed k (``ANY_SOURCE``) it drafts the n-gram match when there is one, else the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import model_drafter
from .drafting import ANY_SOURCE, LOOKUP_SOURCE, MODEL_SOURCE, DraftModel, LookupOffer
from .model_drafter import ModelDrafter
from .ngram_drafter import NGramDrafter
from .verify import Proposal

if TYPE_CHECKING:
    from .options import GenerationConfig


class ModelCatchupOfLastProposal:
    """Catch-up accounting for a drafter that proposes from a lookup or from ``self.model``:
    only a proposal the draft model made (``last_source == "model"``) paid its catch-up."""

    model: ModelDrafter | None
    last_source: str

    @property
    def catchup_s(self) -> float:
        return self.model.catchup_s if self.last_source == "model" else 0.0

    @property
    def catchup_tokens(self) -> int:
        return self.model.catchup_tokens if self.last_source == "model" else 0


class CompositeDrafter(ModelCatchupOfLastProposal):
    """The n-gram proposal when the history repeats itself, else the draft model.

    The model drafter's cache stays consistent either way: its ``accept`` runs every
    step, and its next ``propose`` catches up on whatever committed tokens it missed.
    """

    name = "composite"

    def __init__(self, ngram: NGramDrafter, model: ModelDrafter) -> None:
        self.ngram = ngram
        self.model = model
        self.last_source = "none"

    def begin(self, prompt: np.ndarray) -> None:
        self.ngram.begin(prompt)
        self.model.begin(prompt)

    def propose(self, history: np.ndarray, k: int, source: str = ANY_SOURCE) -> Proposal:
        """The n-gram lookup's tokens when it has a match (unless ``source`` is the model), else the
        model's (unless ``source`` is the lookup)."""
        proposal = self.ngram.propose(history, k) if source != MODEL_SOURCE else Proposal.empty()
        if len(proposal.tokens) or source == LOOKUP_SOURCE:
            self.last_source = "ngram" if len(proposal.tokens) else "none"
            return proposal
        self.last_source = "model"
        return self.model.propose(history, k)

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self.ngram.accept(history, n_accepted)
        self.model.accept(history, n_accepted)

    def pending_tokens(self, history) -> int:
        # What a model proposal would read first. A step the n-gram side serves feeds the model
        # nothing: the controller (DefaultK) weighs the catch-up only for the model source.
        return self.model.pending_tokens(history)

    def lookup_offer(self, history, limit: int) -> LookupOffer:
        return self.ngram.lookup_offer(history, limit)


def build(config: "GenerationConfig", draft: DraftModel | None) -> CompositeDrafter:
    """The registry's constructor. In the composite, a 1-token match is too weak to beat the
    model's own guess: the n-gram side needs a suffix of >= 2 tokens (a repeated phrase) to take over."""
    return CompositeDrafter(NGramDrafter(max(config.max_ngram, 2), max(config.min_ngram, 2)),
                            model_drafter.build(config, draft))
