"""The default drafter: a lookup whenever one exists, else the bundle's draft model (if any).

Two sources, as llama.cpp's speculative example now runs several drafters and keeps the one
expected to yield the most accepted tokens (common/speculative.cpp), here with a fixed order
because one source is free:

- **lookup**: the suffix drafter (runtime/suffix_drafter.py; SuffixDecoding, Oliaro et al.,
  arXiv 2411.04975) over the prompt, the reply so far and, unless ``reply_memory`` is off,
  this Generator's earlier replies. A lookup runs no model: its draft costs microseconds, so
  whenever it has a proposal it is drafted (the controller only caps its length).
- **model**: the bundle's draft model, when it has one. It costs draft steps and a catch-up on
  history it has not read, so the default controller (:class:`~.controller.DefaultK`) runs it
  only where the cost model predicts a gain, and pays its probes from a budget.

Without a draft model this is the lookup drafter alone. Either way every proposal is verified
by the target: the output is the target's, whatever the sources hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import model_drafter
from .composite_drafter import ModelCatchupOfLastProposal
from .drafting import DraftModel
from .model_drafter import ModelDrafter
from .suffix import ReplyMemory
from .suffix_drafter import SuffixDrafter
from .verify import Proposal

if TYPE_CHECKING:
    from .options import GenerationConfig


class AutoDrafter(ModelCatchupOfLastProposal):
    """The suffix lookup's proposal whenever it has one, else the draft model's (None: nothing).

    The model drafter's cache stays consistent either way: its ``accept`` runs every
    speculative step, and its next ``propose`` catches up on whatever committed tokens it
    missed (the catch-up the controller weighs through ``pending_tokens``).
    """

    name = "auto"

    def __init__(self, lookup: SuffixDrafter, model: ModelDrafter | None) -> None:
        self.lookup = lookup
        self.model = model
        self.last_source = "none"  # "lookup", "model" or "none": where the last proposal came from

    def begin(self, prompt: np.ndarray) -> None:
        self.lookup.begin(prompt)
        if self.model is not None:
            self.model.begin(prompt)

    def lookup_tokens(self, history, limit: int) -> int:
        return self.lookup.lookup_tokens(history, limit)

    def propose(self, history: np.ndarray, k: int) -> Proposal:
        """Up to ``k`` tokens (int64 ``[k']``) continuing ``history`` (int64 ``[H]``): the lookup's
        point masses when it has a match, else the draft model's tokens and p_draft."""
        proposal = self.lookup.propose(history, k)
        if len(proposal.tokens) or self.model is None:
            self.last_source = "lookup" if len(proposal.tokens) else "none"
            return proposal
        self.last_source = "model"
        return self.model.propose(history, k)

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self.lookup.accept(history, n_accepted)
        if self.model is not None:
            self.model.accept(history, n_accepted)

    def pending_tokens(self, history) -> int:
        # What a model proposal would read first. A step the lookup serves feeds the model nothing:
        # the controller knows that from lookup_tokens() and weighs no catch-up then.
        return 0 if self.model is None else self.model.pending_tokens(history)


def build(config: "GenerationConfig", draft: DraftModel | None, replies: ReplyMemory | None) -> AutoDrafter:
    """The registry's constructor: ``draft`` None (a bundle without a draft model) leaves the lookup
    alone; ``replies`` is the Generator's cross-reply memory, or None when ``reply_memory`` is off."""
    return AutoDrafter(SuffixDrafter(replies), None if draft is None else model_drafter.build(config, draft))
