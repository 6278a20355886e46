"""The drafter contract: what the loop may call and read on every drafter.

Every drafter has three methods (as in llama.cpp's common_speculative):

- ``begin(prompt)``: a new generation starts; ``prompt`` int64 ``[P]``.
- ``propose(history, k) -> Proposal``: up to k tokens continuing ``history``
  (int64 ``[H]``, every committed token, prompt included). May return fewer.
- ``accept(history, n_accepted)``: the step committed; ``history`` is the new
  committed sequence, of which the last token came from the target.

and declares whether its next proposal is a lookup (``lookup_tokens``: no model runs,
the draft costs microseconds) and its catch-up accounting, which the cost model weighs: a draft model
must read history it has not seen (its deferred prompt prefill, or tokens committed
by plain steps) before it can propose, a one-off that only the rest of the reply can
repay. A drafter with no such cost (prompt lookup) reports 0 throughout.

A drafter owns its state (a draft model's KV cache, an n-gram index) and never
touches the target's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:  # standard library only at run time: manifest.py reads the registry's names
    import numpy as np

    from ..engines.base import Engine, KVCache
    from .options import GenerationConfig
    from .slots import DraftPrefix
    from .suffix import ReplyMemory
    from .verify import Proposal


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

    def propose(self, history: "np.ndarray", k: int) -> "Proposal": ...

    def accept(self, history: "np.ndarray", n_accepted: int) -> None: ...

    def pending_tokens(self, history: Sequence[int]) -> int:
        """Tokens the next ``propose(history, k)`` reads before its first draft token (an upper
        bound); 0 for a drafter that reads nothing. Only ``len(history)`` may be relied on."""
        ...

    def lookup_tokens(self, history: Sequence[int], limit: int) -> int:
        """How many tokens (<= ``limit``) the next ``propose(history, k)`` would take from a
        lookup, which runs no model (0: it would run its draft model, or propose nothing).
        ``history``: the committed sequence (the loop's list). The default policy drafts a
        lookup whenever one exists; other controllers ignore it."""
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
    # drafter): its cost model starts from the draft's measured costs, and the default controller
    # (runtime/controller.py DefaultK) chooses between its lookup and its model per step.
    optional_draft_model: bool = False
