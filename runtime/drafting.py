"""The drafter contract: what the loop may call and read on every drafter.

Every drafter has three methods (as in llama.cpp's common_speculative):

- ``begin(prompt)``: a new generation starts; ``prompt`` int64 ``[P]``.
- ``propose(history, k, source) -> Proposal``: up to k tokens continuing ``history``
  (int64 ``[H]``, every committed token, prompt included), from ``source`` (a drafter with
  several sources, the default's lookup and draft model, drafts from the one the controller
  chose; ``ANY_SOURCE``: its own order). May return fewer.
- ``accept(history, n_accepted)``: the step committed; ``history`` is the new
  committed sequence, of which the last token came from the target.

and declares what its lookup has ready (``lookup_offer``: tokens a lookup would draft, which
runs no model and costs microseconds, and the length of the match they continue) and its
catch-up accounting, which the cost model weighs: a draft model
must read history it has not seen (its deferred prompt prefill, or tokens committed
by plain steps) before it can propose, a one-off that only the rest of the reply can
repay. A drafter with no such cost (prompt lookup) reports 0 throughout.

A drafter owns its state (a draft model's KV cache, an n-gram index) and never
touches the target's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:  # standard library only at run time: the CLI's options read the registry's names
    import numpy as np

    from ..engines.base import Engine, KVCache
    from .options import GenerationConfig
    from .slots import DraftPrefix
    from .suffix import ReplyMemory
    from .verify import Proposal


# Where a step's draft comes from (the controller's DraftPlan.source, runtime/policies).
ANY_SOURCE = "any"  # the drafter's own order (a controller that does not choose between sources)
LOOKUP_SOURCE = "lookup"  # a lookup: no model runs
MODEL_SOURCE = "model"  # the draft model
SOURCES = (ANY_SOURCE, LOOKUP_SOURCE, MODEL_SOURCE)

# The shortest match a lookup drafts from on its own: a single repeated token predicts the next one
# badly (the n-gram drafter measured 0.0-0.2 acceptance on chat and voice replies, below the
# break-even of a k-token verify). A 1-token match is only a *guess*: the default drafts one where a
# plain step would run anyway, on an exact 2-row step whose second row is otherwise a recompute
# (engines/invariant.py), and learns its acceptance apart (runtime/policies/default.py DefaultK).
STRONG_MATCH = 2


@dataclass(frozen=True)
class LookupOffer:
    """What a drafter's lookup has ready for the next step (``Drafter.lookup_offer``)."""

    tokens: int = 0  # tokens it would draft (0: none; the drafter would run its model, or nothing)
    match: int = 0  # length of the matched context they continue (0: not known, e.g. n-gram lookup)

    @property
    def guess(self) -> bool:
        """A lookup continuing a match shorter than ``STRONG_MATCH``: drafted only when chosen."""
        return 0 < self.match < STRONG_MATCH


NO_LOOKUP = LookupOffer()


class Drafter(Protocol):
    name: str  # the registry key that built it (stats, and what the Generator learns per drafter)

    @property
    def catchup_s(self) -> float:
        """Seconds the last propose spent reading unseen history (0 for the usual 1-2 tokens)."""
        ...

    @property
    def catchup_tokens(self) -> int:
        """Tokens that catch-up read (0 when it was the usual 1-2)."""
        ...

    def begin(self, prompt: "np.ndarray") -> None: ...

    def propose(self, history: "np.ndarray", k: int, source: str = ANY_SOURCE) -> "Proposal":
        """Up to ``k`` tokens continuing ``history``, from ``source`` (``ANY_SOURCE``: the drafter's own
        order); ``Proposal.from_model`` says whether a draft model made them."""
        ...

    def accept(self, history: "np.ndarray", n_accepted: int) -> None: ...

    def pending_tokens(self, history: Sequence[int]) -> int:
        """Tokens the next ``propose(history, k)`` reads before its first draft token (an upper
        bound); 0 for a drafter that reads nothing. Only ``len(history)`` may be relied on."""
        ...

    def lookup_offer(self, history: Sequence[int], limit: int) -> LookupOffer:
        """What the next ``propose(history, k, LOOKUP_SOURCE)`` would take from a lookup, which runs
        no model: at most ``limit`` tokens (``NO_LOOKUP``: it would run its draft model, or propose
        nothing). ``history``: the committed sequence (the loop's list). The default policy weighs
        it against its draft model; other controllers read only whether it exists."""
        ...


@dataclass(frozen=True)
class DraftModel:
    """The loaded draft model a drafter may use (None for a bundle without one)."""

    engine: "Engine"
    cache: "KVCache"  # preallocated once per Generator, reused by every call
    head_ids: "np.ndarray | None"  # int64 [head_size]: a vocabulary-truncated head's token ids, else None
    vocab_size: int  # the target's vocabulary: p_draft is placed on it
    # What the draft cache holds, kept across calls by the model drafter so a conversation's next
    # turn reuses it (runtime/slots.py DraftPrefix); mutated in place. None: nothing is kept.
    prefix: "DraftPrefix | None" = None


@dataclass(frozen=True)
class DrafterSpec:
    """One registry entry: how to build a drafter and what it needs."""

    # build(config, draft, replies): draft is not None when needs_draft_model; replies (the
    # Generator's ReplyMemory, runtime/suffix.py) is None unless reads_replies and the call's
    # reply_memory option is on.
    build: Callable[["GenerationConfig", DraftModel | None, "ReplyMemory | None"], Drafter]
    needs_draft_model: bool  # the only place this rule is stated
    help: str  # one line, shown by the CLI
    reads_replies: bool = False  # drafts from earlier replies too: the Generator feeds it each finished reply
    # Runs the draft model when the bundle has one, and drafts without it otherwise (the default
    # drafter): its cost model starts from the draft's measured costs.
    optional_draft_model: bool = False
    # Drafts from a lookup and from the draft model, the source chosen per step: adaptive, it runs
    # under the default controller (runtime/policies/default.py DefaultK), which learns each source's
    # acceptance apart. One shared estimate let a few rejected model drafts switch off lookups that
    # were right (traced on `specedge demo`: 3 rejected model steps, then 15 plain steps on a
    # reply the n-gram lookup copies from the prompt, 0.79x plain).
    per_source: bool = False
