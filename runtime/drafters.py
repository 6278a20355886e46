"""Drafters: cheap proposers of the next k tokens.

Every drafter has three methods (as in llama.cpp's common_speculative):

- ``begin(prompt)``: a new generation starts; ``prompt`` int64 ``[P]``.
- ``propose(history, k) -> Proposal``: up to k tokens continuing ``history``
  (int64 ``[H]``, every committed token, prompt included). May return fewer.
- ``accept(history, n_accepted)``: the step committed; ``history`` is the new
  committed sequence, of which the last token came from the target.

A drafter owns its state (a draft model's KV cache, an n-gram index) and never
touches the target's cache.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from ..engines.base import Engine
from .sampling import SamplingConfig, sample, warp
from .verify import Proposal


class Drafter(Protocol):
    name: str

    def begin(self, prompt: np.ndarray) -> None: ...

    def propose(self, history: np.ndarray, k: int) -> Proposal: ...

    def accept(self, history: np.ndarray, n_accepted: int) -> None: ...


class ModelDrafter:
    """A draft model through an Engine, with its own KV cache.

    The drafter remembers which token ids its cache holds (``self.cached``, one per
    cached position). ``propose(history, k)`` first feeds whatever part of ``history``
    the cache lacks (the target's correction or bonus token, and after a fully accepted
    block also the last draft token, which was proposed but never fed), then drafts one
    token per forward. ``accept`` keeps the longest cached prefix that agrees with the
    committed history and rewinds the rest. Because the rule compares token ids rather
    than assuming what the last step did, it also holds when the pipelined loop drafted
    ahead on a guess.
    """

    name = "model"

    def __init__(self, engine: Engine, sampling: SamplingConfig, *, p_min: float = 0.0, seed: int | None = None,
                 cache=None, head_ids: np.ndarray | None = None, vocab_size: int | None = None) -> None:
        self.engine = engine
        # A vocabulary-truncated draft head scores only head_ids (int64 [head_size]); proposals stay
        # inside that subset, and p_draft is the head's distribution placed on those ids (zero
        # elsewhere), which is exactly the distribution the tokens were drawn from.
        self.head_ids = head_ids
        self.vocab_size = vocab_size or engine.vocab_size
        self.sampling = sampling
        self.p_min = p_min  # stop drafting when the draft's top probability falls below this
        self.cache = cache if cache is not None else engine.new_cache()
        self.cached: list[int] = []  # token id at each cached position (len == cache.length)
        self._verified = 0  # cached[:_verified] is known to be committed history
        self.catchup_s = 0.0  # time the last propose spent feeding missed history (prefill, probes)
        self.rng = np.random.default_rng(seed)
        self.last_top_probs: list[float] = []  # confidence of each proposed token, for stats/controllers

    def begin(self, prompt: np.ndarray) -> None:
        # The draft's prefill is deferred to the first propose(): when the controller never
        # drafts (speculation does not pay), the draft costs nothing at all.
        self.cache.reset()
        self.cached = []
        self._verified = 0

    def _feed(self, tokens: np.ndarray) -> np.ndarray:
        logits = self.engine.forward(tokens, self.cache, num_logits=1)[-1]
        self.cached.extend(int(t) for t in tokens)
        return logits

    def _sync(self, history: np.ndarray) -> None:
        """Rewind to the longest cached prefix of ``history``, leaving >= 1 token to feed."""
        limit = min(len(self.cached), len(history) - 1)
        # Committed history only grows within a generation, so the prefix verified last
        # time still matches: compare only the tail (O(k) per step, not O(context)).
        keep = min(self._verified, limit)
        while keep < limit and self.cached[keep] == history[keep]:
            keep += 1
        self._verified = keep
        if keep < len(self.cached):
            self.cache.rewind(len(self.cached) - keep)
            del self.cached[keep:]

    def propose(self, history: np.ndarray, k: int) -> Proposal:
        self.last_top_probs = []
        # Never draft past the draft's own context: the verify needs the same room in the target.
        k = min(k, self.cache.capacity - len(history))
        if k <= 0:
            return Proposal.empty()
        self._sync(history)
        pending = np.asarray(history[len(self.cached):], np.int64)
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        self.catchup_s = 0.0
        for i in range(k):
            start = time.perf_counter()
            logits = self._feed(pending)
            if i == 0 and len(pending) > 2:  # more than the usual correction (+ last draft token)
                self.catchup_s = time.perf_counter() - start
            if self.sampling.greedy:
                index = int(np.argmax(logits))
                top = _top_prob(logits) if self.p_min > 0 else 1.0
            else:
                p_head = warp(logits, self.sampling)
                index = sample(p_head, self.rng)
                top = float(p_head.max())
                if self.head_ids is None:
                    probs.append(p_head)
                else:
                    p_draft = np.zeros(self.vocab_size)
                    p_draft[self.head_ids] = p_head
                    probs.append(p_draft)
            token = index if self.head_ids is None else int(self.head_ids[index])
            if top < self.p_min:
                if probs:
                    probs.pop()
                break
            tokens.append(token)
            self.last_top_probs.append(top)
            if i + 1 < k:
                pending = np.array([token], np.int64)
        draft_probs = np.stack(probs) if probs and not self.sampling.greedy else None
        return Proposal(np.array(tokens, np.int64), draft_probs)

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self._sync(history)


def _top_prob(logits: np.ndarray) -> float:
    """max softmax(logits) without materialising the distribution twice."""
    z = logits - logits.max()
    return float(1.0 / np.exp(z, dtype=np.float64).sum())


class NGramDrafter:
    """Prompt lookup: propose the continuation of the most recent earlier match of the last n tokens.

    n goes from ``max_ngram`` down to ``min_ngram``. The index maps every n-gram to the
    position right after its most recent occurrence and is extended incrementally as
    tokens are committed (O(max_ngram) work per committed token, no rescans).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            from ..errors import InvalidParameterError

            raise InvalidParameterError(f"n-gram sizes need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._tokens: list[int] = []
        # _index[n][gram] = position following the most recent occurrence of gram that is
        # not the sequence's own suffix (the suffix is indexed one token late, see _extend).
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    def begin(self, prompt: np.ndarray) -> None:
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

    def propose(self, history: np.ndarray, k: int) -> Proposal:
        self._sync(history)
        seq = self._tokens
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = self._index[n].get(tuple(seq[len(seq) - n:]))
            if start is not None:
                return Proposal(np.array(seq[start:start + k], np.int64))
        return Proposal.empty()

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self._sync(history)


class CompositeDrafter:
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

    def propose(self, history: np.ndarray, k: int) -> Proposal:
        proposal = self.ngram.propose(history, k)
        if len(proposal.tokens):
            self.last_source = "ngram"
            return proposal
        self.last_source = "model"
        return self.model.propose(history, k)

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self.ngram.accept(history, n_accepted)
        self.model.accept(history, n_accepted)

    @property
    def catchup_s(self) -> float:
        return self.model.catchup_s if self.last_source == "model" else 0.0
