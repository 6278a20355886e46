"""Prompt lookup: the n-gram drafter (no model; its proposals cost microseconds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidParameterError
from .drafting import ANY_SOURCE, NO_LOOKUP, DraftModel, LookupOffer
from .verify import Proposal

if TYPE_CHECKING:
    from .options import GenerationConfig


class NGramDrafter:
    """Prompt lookup: propose the continuation of the most recent earlier match of the last n tokens.

    n goes from ``max_ngram`` down to ``min_ngram``. The index maps every n-gram to the
    position right after its most recent occurrence and is extended incrementally as
    tokens are committed (O(max_ngram) work per committed token, no rescans).
    """

    name = "ngram"
    catchup_s = 0.0  # a lookup reads nothing it has not indexed: no catch-up ever
    catchup_tokens = 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        from .options import check  # options imports the drafters

        check("min_ngram", min_ngram)
        check("max_ngram", max_ngram)  # one dict per n: the option's bound keeps memory bounded
        if not min_ngram <= max_ngram:
            raise InvalidParameterError(f"n-gram sizes need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._tokens: list[int] = []
        self._matched: tuple[int, int | None] = (-1, None)  # (sequence length, _match_start) last computed
        # _index[n][gram] = position following the most recent occurrence of gram that is
        # not the sequence's own suffix (the suffix is indexed one token late, see _extend).
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    def begin(self, prompt: np.ndarray) -> None:
        self._matched = (-1, None)
        self._tokens = []
        self._index = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self._extend(prompt)

    def _extend(self, tokens) -> None:
        seq = self._tokens
        for token in tokens:
            seq.append(int(token))
            end = len(seq) - 1  # the gram ending just before the new token now has a continuation
            for n in self._index:
                if end - n >= 0:
                    self._index[n][tuple(seq[end - n:end])] = end

    def _sync(self, history: np.ndarray) -> None:
        if len(history) < len(self._tokens):
            self.begin(history)  # history shrank (a new conversation without begin): rebuild
        elif len(history) > len(self._tokens):
            self._extend(history[len(self._tokens):])

    def propose(self, history: np.ndarray, k: int, source: str = ANY_SOURCE) -> Proposal:
        """Every proposal is a lookup, whatever ``source``."""
        self._sync(history)
        seq = self._tokens
        start = self._match_start()
        return Proposal.empty() if start is None else Proposal(np.array(seq[start:start + k], np.int64))

    def _match_start(self) -> int | None:
        """Where the continuation of the longest matching suffix starts, or None. A step asks up to
        three times (lookup_offer, pending_tokens, propose) on the same history: computed once."""
        seq = self._tokens
        if self._matched[0] == len(seq):
            return self._matched[1]
        found = None
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            found = self._index[n].get(tuple(seq[len(seq) - n:]))
            if found is not None:
                break
        self._matched = (len(seq), found)
        return found

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self._sync(history)

    def pending_tokens(self, history) -> int:
        return 0

    def lookup_offer(self, history, limit: int) -> LookupOffer:
        """Every proposal is a lookup: the match's continuation, capped at ``limit`` (its match
        length is not tracked: 0)."""
        self._sync(history)
        start = self._match_start()
        tokens = 0 if start is None else min(limit, len(self._tokens) - start)
        return LookupOffer(tokens) if tokens > 0 else NO_LOOKUP


def build(config: "GenerationConfig", draft: DraftModel | None) -> NGramDrafter:
    """The registry's constructor."""
    return NGramDrafter(config.max_ngram, config.min_ngram)
