"""The draft-model drafter: a smaller model (or a quantized copy of the target) through an Engine."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..engines.base import Engine
from .sampling import SamplingConfig, sample, warp
from .drafting import ANY_SOURCE, NO_LOOKUP, DraftModel, LookupOffer
from .options import SINK_TOKENS, check
from .slots import DraftPrefix
from .verify import Proposal

if TYPE_CHECKING:
    from .options import GenerationConfig


def bridge(length: int, head: int, window: int) -> tuple[int, int]:
    """Where a catch-up over ``history[head:length]`` longer than ``window`` is bridged: returns
    (sink tokens still to feed after the ``head`` already cached, the first recent position), so the
    draft reads ``history[:head + sink_fill] + history[tail:]``, ``window`` tokens past ``head``."""
    sink_fill = max(SINK_TOKENS - head, 0)  # sink tokens still to feed before the gap
    return sink_fill, length - (window - sink_fill)


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

    Bounded catch-up (``window``): feeding a long stretch of history the draft has not
    seen (its prompt prefill, or tokens committed by plain steps) can cost more than a
    short reply ever wins back. With a window, such a stretch is bridged instead: the
    cache keeps its head (at least the first ``SINK_TOKENS`` tokens) and receives only the
    most recent tokens, so the draft sees ``history[:head] + history[tail:]`` at
    contiguous positions. RoPE attention depends on relative distance only, so the tail
    reads as a coherent recent context. The draft then proposes from a shortened
    context, which can only lower acceptance: every proposal is still verified by the
    target, so output is unchanged (and in sampling mode ``p_draft`` is the distribution
    the tokens were really drawn from, which is all the rejection rule needs).
    """

    name = "model"
    SINK_TOKENS = SINK_TOKENS  # attention sinks kept at the head of a bridged history (runtime/options.py)

    def __init__(self, engine: Engine, sampling: SamplingConfig, *, p_min: float = 0.0, seed: int | None = None,
                 cache=None, head_ids: np.ndarray | None = None, vocab_size: int | None = None,
                 window: int | None = None, prefix: DraftPrefix | None = None) -> None:
        self.check_window(window)
        self.engine = engine
        self.window = window  # most tokens fed to catch up in one go (None = everything)
        # A vocabulary-truncated draft head scores only head_ids (int64 [head_size]); proposals stay
        # inside that subset, and p_draft is the head's distribution placed on those ids (zero
        # elsewhere), which is exactly the distribution the tokens were drawn from.
        self.head_ids = head_ids
        self.vocab_size = vocab_size or engine.vocab_size
        self.sampling = sampling
        self.p_min = p_min  # stop drafting when the draft's top probability falls below this
        self.cache = cache if cache is not None else engine.new_cache()
        self.cached: list[int] = []  # token id at each cached position (len == cache.length)
        # What the cache holds, shared with a conversation slot that outlives this drafter (one of
        # its own when there is none).
        self._prefix = prefix if prefix is not None else DraftPrefix()
        self._verified = 0  # cached[:_verified] is known to be committed history
        # A bridged gap: cache position p holds history[p] for p < _head, else history[p + _skipped].
        self._head = 0
        self._skipped = 0
        self.catchup_s = 0.0  # time the last propose spent feeding missed history (prefill, probes)
        self.catchup_tokens = 0  # tokens that feed held (0 when it was the usual 1-2)
        self.rng = np.random.default_rng(seed)
        self.last_top_probs: list[float] = []  # confidence of each proposed token, for stats/controllers

    @classmethod
    def check_window(cls, window: int | None) -> None:
        """Refuse a draft window that could not hold the sink tokens plus one recent token
        (the bound is the draft_window option's, in runtime/options.py)."""
        check("draft_window", window)

    def begin(self, prompt: np.ndarray) -> None:
        # The draft's prefill is deferred to the first propose(): when the controller never
        # drafts (speculation does not pay), the draft costs nothing at all.
        # A conversation slot (runtime/slots.py) keeps what the cache held at the end of the last
        # call, bridged gap included: the longest part of it this prompt continues is kept, so the
        # draft's catch-up is paid once per conversation, not once per turn.
        held = self._prefix
        n = min(len(held.tokens), self.cache.length)
        self.cache.rewind(self.cache.length - n)
        self.cached = [int(t) for t in held.tokens[:n]]
        self._head, self._skipped = (held.head, held.skipped) if held.skipped and held.head < n else (0, 0)
        self._verified = 0
        self._sync(prompt)  # keep the longest held prefix of the prompt (through the gap), >= 1 token left
        self._publish()

    def _publish(self) -> None:
        """Share what the cache holds of the committed history (gap included) with the slot."""
        n = self._verified
        self._prefix.set(self.cached[:n], *((self._head, self._skipped) if n > self._head else (0, 0)))

    def _feed(self, tokens: np.ndarray, logits: bool = True) -> np.ndarray | None:
        out = self.engine.forward(tokens, self.cache, num_logits=1)[-1]
        self.cached.extend(int(t) for t in tokens)
        return out if logits else None

    def _history_index(self, position: int) -> int:
        return position if position < self._head else position + self._skipped

    def _sync(self, history: np.ndarray) -> None:
        """Rewind to the longest cached prefix of ``history``, leaving >= 1 token to feed."""
        limit = max(min(len(self.cached), len(history) - 1 - self._skipped), 0)
        # Committed history only grows within a generation, so the prefix verified last
        # time still matches: compare only the tail (O(k) per step, not O(context)).
        keep = min(self._verified, limit)
        while keep < limit and self.cached[keep] == history[self._history_index(keep)]:
            keep += 1
        if keep <= self._head:
            self._head = self._skipped = 0  # the bridged gap is gone with what followed it
        self._verified = keep
        self._truncate(keep)

    def _truncate(self, keep: int) -> None:
        if keep < len(self.cached):
            self.cache.rewind(len(self.cached) - keep)
            del self.cached[keep:]
            held = self._prefix
            if len(held.tokens) > keep:  # the next feed rewrites those positions, and a cancel may stop it
                held.set(held.tokens[:keep], *((held.head, held.skipped) if keep > held.head else (0, 0)))

    def lookup_offer(self, history, limit: int) -> LookupOffer:
        return NO_LOOKUP  # every proposal runs the draft model

    def pending_tokens(self, history) -> int:
        """How many tokens the next ``propose(history, k)`` feeds before its first draft token
        (an upper bound: a rejected tail it rewinds first is not counted). ``history``: any
        int sequence; only its length is read."""
        missing = max(len(history) - len(self.cached) - self._skipped, 1)
        return missing if self.window is None else min(missing, self.window)

    def _bridge(self, history: np.ndarray) -> int:
        """Replace a catch-up longer than ``window`` by head + the most recent tokens.
        Returns how many sink tokens it fed (the rest is left pending)."""
        if self.window is None or len(history) - len(self.cached) - self._skipped <= self.window:
            return 0
        head = len(self.cached) if self._skipped == 0 else self._head  # one gap at a time
        self._truncate(head)
        sink_fill, tail = bridge(len(history), head, self.window)
        self._head = head + sink_fill
        self._skipped = tail - self._head
        if sink_fill:
            self._feed(np.asarray(history[head:self._head], np.int64), logits=False)
        return sink_fill

    def propose(self, history: np.ndarray, k: int, source: str = ANY_SOURCE) -> Proposal:
        """Up to ``k`` draft-model tokens continuing ``history`` (int64 ``[H]``), with p_draft;
        every proposal runs the model, whatever ``source``."""
        self.last_top_probs = []
        # Never draft past the draft's own context: the verify needs the same room in the target.
        k = min(k, self.cache.capacity - len(history))
        if k <= 0:
            return Proposal.empty()
        start = time.perf_counter()
        self._sync(history)
        sink_fed = self._bridge(history)
        pending = np.asarray(history[len(self.cached) + self._skipped:], np.int64)
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        self.catchup_s = 0.0
        self.catchup_tokens = 0
        for i in range(k):
            logits = self._feed(pending)
            if i == 0 and sink_fed + len(pending) > 2:  # more than the usual correction + last draft token
                self.catchup_s = time.perf_counter() - start
                self.catchup_tokens = sink_fed + len(pending)
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
        return Proposal(np.array(tokens, np.int64), draft_probs, from_model=True)

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self._sync(history)
        self._publish()


def _top_prob(logits: np.ndarray) -> float:
    """max softmax(logits) without materialising the distribution twice."""
    z = logits - logits.max()
    return float(1.0 / np.exp(z, dtype=np.float64).sum())


def build(config: "GenerationConfig", draft: DraftModel | None) -> ModelDrafter:
    """The registry's constructor: a ModelDrafter on the Generator's draft model and cache."""
    assert draft is not None  # the registry entry says needs_draft_model: the Generator checked
    return ModelDrafter(draft.engine, config.sampling, p_min=config.p_min,
                        seed=None if config.seed is None else config.seed + 1, cache=draft.cache,
                        head_ids=draft.head_ids, vocab_size=draft.vocab_size, window=config.draft_window,
                        prefix=draft.prefix)
