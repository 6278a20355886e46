"""The default drafter: a suffix lookup and the bundle's draft model (if any), one per step.

Two sources, as llama.cpp's speculative example runs several drafters and keeps the one
expected to yield the most accepted tokens (common/speculative.cpp):

- **lookup**: the suffix drafter (runtime/suffix_drafter.py; SuffixDecoding, Oliaro et al.,
  arXiv 2411.04975) over the prompt, the reply so far and, unless ``reply_memory`` is off,
  this Generator's earlier replies. A lookup runs no model: its draft costs microseconds. It
  also offers 1-token *guesses* (a 1-token match, ``LookupOffer.guess``), drafted only when the
  controller chooses them: on an exact 2-row step a guess costs almost nothing.
- **model**: the bundle's draft model, when it has one. It costs draft steps and a catch-up on
  history it has not read.

The default controller (:class:`~.policies.DefaultK`) chooses the source of each step
(``propose``'s ``source``) from each one's expected tokens per second, and pays the model's
probes from a budget. A controller that does not choose (``ANY_SOURCE``: a fixed or plain
adaptive k) gets a strong lookup whenever one exists, else the model. Without a draft model
this is the lookup drafter alone. Either way every proposal is verified by the target: the
output is the target's, whatever the sources hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import model_drafter
from .composite_drafter import ModelCatchupOfLastProposal
from .drafting import ANY_SOURCE, LOOKUP_SOURCE, MODEL_SOURCE, STRONG_MATCH, DraftModel, LookupOffer
from .model_drafter import ModelDrafter
from .suffix import ReplyMemory
from .suffix_drafter import SuffixDrafter
from .verify import Proposal

if TYPE_CHECKING:
    from .options import GenerationConfig


class AutoDrafter(ModelCatchupOfLastProposal):
    """The suffix lookup's proposal or the draft model's (None: nothing), as the controller chooses.

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

    def lookup_offer(self, history, limit: int) -> LookupOffer:
        return self.lookup.lookup_offer(history, limit)

    def propose(self, history: np.ndarray, k: int, source: str = ANY_SOURCE) -> Proposal:
        """Up to ``k`` tokens (int64 ``[k']``) continuing ``history`` (int64 ``[H]``): the lookup's
        point masses (``LOOKUP_SOURCE``, guesses included) or the draft model's tokens and p_draft
        (``MODEL_SOURCE``). ``ANY_SOURCE``: a strong lookup when there is one, else the model (a
        guess only without a model)."""
        if self._use_lookup(history, k, source):
            proposal = self.lookup.propose(history, k)
            self.last_source = "lookup" if len(proposal.tokens) else "none"
            return proposal
        self.last_source = "model"
        return self.model.propose(history, k)

    def _use_lookup(self, history: np.ndarray, k: int, source: str) -> bool:
        if self.model is None or source == LOOKUP_SOURCE:
            return True
        if source == MODEL_SOURCE:
            return False
        # best(), not lookup_offer(): a pipelined step proposes past committed history, which must
        # not enter the local trie.
        chain = self.lookup.best(history, k)[1]
        return len(chain.tokens) > 0 and chain.match_length >= STRONG_MATCH

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self.lookup.accept(history, n_accepted)
        if self.model is not None:
            self.model.accept(history, n_accepted)

    def pending_tokens(self, history) -> int:
        # What a model proposal would read first. A step the lookup serves feeds the model nothing:
        # the controller weighs the catch-up only for the model source.
        return 0 if self.model is None else self.model.pending_tokens(history)


def build(config: "GenerationConfig", draft: DraftModel | None, replies: ReplyMemory | None) -> AutoDrafter:
    """The registry's constructor: ``draft`` None (a bundle without a draft model) leaves the lookup
    alone; ``replies`` is the Generator's cross-reply memory, or None when ``reply_memory`` is off.
    The lookup offers guesses (1-token matches, ``min_match=1``): the controller decides whether
    one is worth its verify row."""
    return AutoDrafter(SuffixDrafter(replies, min_match=1),
                       None if draft is None else model_drafter.build(config, draft))
