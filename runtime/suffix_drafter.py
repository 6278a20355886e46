"""The suffix drafter: suffix lookup over this reply and earlier ones (no model; microseconds).

SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", arXiv 2411.04975) drafts from suffix trees over the current prompt and output
and over earlier outputs: it matches the longest suffix of the context seen before, follows
the continuations seen most often, scales the speculation length with the match length, and
keeps the candidate (per tree) with the most expected accepted tokens. This is our
implementation of that idea over runtime/suffix.py's counted trie:

- a local trie over the prompt plus the committed output, appended as the reply grows;
- the Generator's :class:`ReplyMemory` (earlier replies, bounded, oldest evicted first);
- each proposes its best chain; the one matching the longer suffix of the context is drafted
  (the more specific evidence, as n-gram lookup backs off from its longest n), and on equal
  matches the one with the higher ``expected_accepted``.

Proposals are point masses (``draft_probs`` None): the sampling verifier then keeps the
target's distribution exactly, and greedy output equals plain decoding, whatever the tries hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import InvalidParameterError
from .drafting import ANY_SOURCE, NO_LOOKUP, STRONG_MATCH, DraftModel, LookupOffer
from .suffix import EMPTY_CHAIN, Appender, Chain, ReplyMemory, SuffixTrie, best_chain
from .verify import Proposal

if TYPE_CHECKING:
    from .options import GenerationConfig

# Longest substring a trie holds. A 23-token match is already a near-certain copy, and every
# committed token costs O(depth) trie work and up to depth new nodes, so deeper buys little.
DEFAULT_DEPTH = 24
# Stop a chain once its estimated probability (the product of its tokens' empirical
# probabilities) falls below 10%: past that, a drafted token costs a verify row for < 0.1
# expected accepted tokens.
DEFAULT_MIN_PROB = 0.1
# Draft at most length_factor x match length tokens: a long match predicts a long copy, a short
# one a short one (SuffixDecoding scales its speculation length with the match length too).
DEFAULT_LENGTH_FACTOR = 1.0
# Shortest match that may propose (runtime/drafting.py says why a 1-token match is only a guess).
DEFAULT_MIN_MATCH = STRONG_MATCH
# Cross-reply memory, in tokens (about 30 replies of 128 tokens; the oldest are evicted first).
# Text that never repeats costs about depth nodes per token: 4096 tokens measured 23 MB with
# ReplyMemory.nbytes() (CPython 3.11), repetitive text less. Voice and agent replies that recur
# (greetings, confirmations, tool-call JSON) fit many times over.
DEFAULT_MEMORY_TOKENS = 4096
# Prompt tokens remembered in front of each reply (ReplyMemory.add's cue): the longest match a
# chain starts from (depth // 2), so a question asked again is matched at full depth.
REPLY_CUE_TOKENS = DEFAULT_DEPTH // 2


class SuffixDrafter:
    """Propose the most frequent continuation of the longest earlier-seen suffix.

    Two sources: a local trie over ``history`` (prompt + committed output) and, when given,
    the Generator's cross-reply memory. The local trie is appended only with committed
    tokens (``begin`` and ``accept`` see committed history; ``propose`` may see tokens a
    pipelined step only guessed), so tokens committed by plain steps join it at the next
    ``accept``; a history shorter than what it holds (a new conversation) rebuilds it.
    """

    name = "suffix"
    catchup_s = 0.0  # a lookup reads nothing it has not indexed: no catch-up ever
    catchup_tokens = 0

    def __init__(self, replies: ReplyMemory | None = None, *, depth: int = DEFAULT_DEPTH,
                 min_prob: float = DEFAULT_MIN_PROB, length_factor: float = DEFAULT_LENGTH_FACTOR,
                 min_match: int = DEFAULT_MIN_MATCH) -> None:
        if depth < 2 or not 0.0 <= min_prob < 1.0 or length_factor <= 0.0 or not 1 <= min_match <= depth // 2:
            raise InvalidParameterError(f"suffix drafter needs depth >= 2, 0 <= min_prob < 1, length_factor > 0 "
                                        f"and 1 <= min_match <= depth // 2; got depth={depth}, min_prob={min_prob}, "
                                        f"length_factor={length_factor}, min_match={min_match}")
        self.replies = replies
        self.depth = depth
        self.min_prob = min_prob
        self.length_factor = length_factor
        self.min_match = min_match
        # Match on at most half the depth: a trie walk ends at its depth, so a longer match would
        # leave too few levels below it for the chain (a 23-token match in a 24-deep trie drafts 1
        # token per walk); a 12-token match is already strong evidence of a copy.
        self.max_match = depth // 2
        self.local = SuffixTrie(depth)
        self._appender: Appender = self.local.start()
        self.last_source = "none"  # "local", "replies" or "none": where the last proposal came from
        # The last best() answer, keyed by what decides it (context, k, what the local trie holds;
        # begin() starts a new trie and forgets it): lookup_offer() and the propose() that follows
        # it ask the same question.
        self._last: tuple[tuple, tuple[str, Chain]] | None = None

    def begin(self, prompt: np.ndarray) -> None:
        self._last = None
        self.local = SuffixTrie(self.depth)
        self._appender = self.local.start()
        self._appender.extend(np.asarray(prompt).tolist())

    def _sync(self, history: np.ndarray) -> None:
        held = self._appender.length
        if len(history) < held:
            self.begin(history)  # history shrank (a new conversation without begin): rebuild
        elif len(history) > held:
            self._appender.extend(np.asarray(history[held:]).tolist())

    def chain(self, trie: SuffixTrie, context: Sequence[int], k: int) -> Chain:
        """The best chain of at most ``k`` tokens continuing ``context`` in ``trie``.

        Follows :func:`best_chain` and, where the trie's depth cut the chain short, matches
        again on the context extended by what was drafted, so a long copy is drafted whole;
        the chain's probability (the product over all its tokens) stays >= min_prob and its
        length <= length_factor x the first match's length.
        """
        first = best_chain(trie, context, k, min_prob=self.min_prob, length_factor=self.length_factor)
        if first.match_length < self.min_match:
            return EMPTY_CHAIN
        budget = min(k, max(1, int(self.length_factor * first.match_length)))
        tokens, probs = list(first.tokens), list(first.probs)
        running = float(np.prod(probs)) if probs else 1.0
        while tokens and len(tokens) < budget:
            more = best_chain(trie, [*context, *tokens][-self.max_match:], budget - len(tokens),
                              min_prob=self.min_prob / running, length_factor=self.length_factor)
            # A chain is only extended by strong matches: a guess is one token, after nothing better.
            if not more.tokens or more.match_length < max(self.min_match, STRONG_MATCH):
                break
            tokens.extend(more.tokens)
            probs.extend(more.probs)
            running *= float(np.prod(more.probs))
        return Chain(tuple(tokens), tuple(probs), first.match_length)

    def best(self, history: np.ndarray, k: int) -> tuple[str, Chain]:
        """(source, chain): the candidate matching the longer suffix of ``history``, then the one with
        more expected accepted tokens (local on a full tie).

        Why the match first: both tries count continuations seen once as certain, so expected
        tokens alone prefer whichever chain is longer. On the bench's repeated questions a reply
        the memory held verbatim (an 8-token match) lost to a 7-token copy out of the system prompt
        (a 7-token match) that diverged at its third token; the longer match was right.
        """
        context = np.asarray(history[-self.max_match:]).tolist()
        key = (tuple(context), k, self._appender.length)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        best = ("none", EMPTY_CHAIN)
        sources = [("local", self.local)] + ([("replies", self.replies.trie)] if self.replies is not None else [])
        for source, trie in sources:
            candidate = self.chain(trie, context, k)
            if (candidate.match_length, candidate.expected_accepted) > (best[1].match_length,
                                                                      best[1].expected_accepted):
                best = (source, candidate)
        self._last = (key, best)
        return best

    def propose(self, history: np.ndarray, k: int, source: str = ANY_SOURCE) -> Proposal:
        """Up to ``k`` tokens (int64 ``[k']``, point masses) continuing ``history`` (int64 ``[H]``).
        Every proposal is a lookup, whatever ``source``."""
        if k < 1:
            return Proposal.empty()
        self.last_source, chain = self.best(history, k)
        return Proposal(np.asarray(chain.tokens, np.int64)) if chain.tokens else Proposal.empty()

    def accept(self, history: np.ndarray, n_accepted: int) -> None:
        self._sync(history)

    def pending_tokens(self, history) -> int:
        return 0

    def lookup_offer(self, history, limit: int) -> LookupOffer:
        """Every proposal is a lookup: the best chain for ``limit`` tokens (its length and match).
        ``history`` is committed, so the local trie first takes in what plain steps committed since
        the last accept."""
        if limit < 1:
            return NO_LOOKUP
        self._sync(history)
        chain = self.best(history, limit)[1]
        return LookupOffer(len(chain.tokens), chain.match_length) if chain.tokens else NO_LOOKUP


def build(config: "GenerationConfig", draft: DraftModel | None, replies: ReplyMemory | None) -> SuffixDrafter:
    """The registry's constructor: ``replies`` is the Generator's memory, or None when it is off."""
    return SuffixDrafter(replies)
