"""Suffix structures for model-free drafting: a counted, depth-limited suffix trie.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) drafts from suffix trees built over
the current prompt and output and over earlier outputs: find the longest suffix of the
context that occurred before, then follow the continuations that occurred most often.
The draft costs microseconds and needs no model. This module is our own implementation of
that idea for token ids:

- :class:`SuffixTrie` holds every substring of up to ``depth`` tokens of the sequences
  inserted into it, each node counting its occurrences. Sequences are appended token by
  token (O(depth) work per token, no rescans) and whole sequences can be removed again,
  so a bounded memory can evict its oldest sequences.
- :class:`ReplyMemory` is a bounded FIFO of earlier replies over one trie (cross-reply
  memory: greetings, confirmations, tool-call JSON and read-back numbers recur).
- :func:`best_chain` scores candidate continuations by frequency and picks the chain with
  the most expected accepted tokens. :meth:`SuffixTrie.continuations` returns every child
  with its empirical probability, so a token-tree verifier can use the same scores later.

Memory: a node is a slot in three parallel lists (children dict or None for a leaf, count,
depth); :meth:`SuffixTrie.nbytes` estimates it.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

_ROOT = 0
NODE_BYTES = 260  # approx_nbytes(): what nbytes() measured per live node (a slot plus a small dict)


@dataclass(frozen=True)
class Match:
    """Where the context's longest earlier-seen suffix ends in a trie.

    ``node``: the trie node of the matched suffix; ``length``: its length in tokens (0 = no
    match); ``total``: how many times a continuation followed it.
    """

    node: int
    length: int
    total: int


@dataclass(frozen=True)
class Chain:
    """A drafted chain: ``tokens`` and each token's empirical probability given the ones before."""

    tokens: tuple[int, ...]
    probs: tuple[float, ...]
    match_length: int

    @property
    def expected_accepted(self) -> float:
        """Expected accepted tokens if token i is accepted with probability probs[i] given i-1 were:
        sum over i of prod(probs[:i+1]) (the chain stops at the first rejection)."""
        total, running = 0.0, 1.0
        for p in self.probs:
            running *= p
            total += running
        return total


EMPTY_CHAIN = Chain((), (), 0)


class SuffixTrie:
    """A trie of every substring of up to ``depth`` tokens of the inserted sequences, with counts.

    ``count[node]`` is the number of occurrences of the node's string across the sequences
    inserted (counting each start position once). Children of a node are the tokens that
    followed one of its occurrences.
    """

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"depth must be >= 2; got {depth}")
        self.depth = depth
        self._children: list[dict[int, int] | None] = [None]
        self._count: list[int] = [0]
        self._free: list[int] = []  # recycled node slots (eviction)
        self.nodes = 1  # live nodes, root included

    # ------------------------------------------------------------------ building

    def _child(self, node: int, token: int, create: bool) -> int:
        children = self._children[node]
        if children is None:
            if not create:
                return -1
            children = self._children[node] = {}
        child = children.get(token, -1)
        if child < 0 and create:
            if self._free:
                child = self._free.pop()
                self._children[child] = None
                self._count[child] = 0
            else:
                child = len(self._count)
                self._children.append(None)
                self._count.append(0)
            children[token] = child
            self.nodes += 1
        return child

    def start(self) -> "Appender":
        """An appender for one new sequence: ``appender.extend(tokens)`` inserts it incrementally."""
        return Appender(self)

    def insert(self, tokens: Sequence[int]) -> None:
        """Insert a whole sequence (the same trie as appending its tokens one by one)."""
        self.start().extend(tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Remove a sequence inserted earlier: every count it added is taken back, emptied nodes freed."""
        tokens = [int(t) for t in tokens]
        for begin in range(len(tokens)):
            node = _ROOT
            for token in tokens[begin:begin + self.depth]:
                child = self._child(node, token, create=False)
                if child < 0:
                    raise ValueError("remove() of a sequence that was not inserted")
                self._count[child] -= 1
                if self._count[child] == 0:
                    self._drop(node, token, child)
                    break  # the rest of this suffix hung below the dropped node
                node = child

    def _drop(self, parent: int, token: int, node: int) -> None:
        """Unlink ``node`` (count 0) and free it and everything below it."""
        del self._children[parent][token]
        if not self._children[parent]:
            self._children[parent] = None
        stack = [node]
        while stack:
            current = stack.pop()
            if self._children[current]:
                stack.extend(self._children[current].values())
            self._children[current] = None
            self._count[current] = 0
            self._free.append(current)
            self.nodes -= 1

    # ------------------------------------------------------------------ lookup

    def walk(self, tokens: Sequence[int]) -> int:
        """The node of ``tokens`` (at most ``depth`` long), or -1 if it never occurred."""
        node = _ROOT
        for token in tokens:
            node = self._child(node, int(token), create=False)
            if node < 0:
                return -1
        return node

    def continuation_total(self, node: int) -> int:
        """How many occurrences of the node's string were followed by another token."""
        children = self._children[node]
        return sum(self._count[c] for c in children.values()) if children else 0

    def longest_match(self, context: Sequence[int]) -> Match:
        """The longest suffix of ``context`` (shorter than ``depth``) that was followed by a token before.

        Monotone (if a suffix of length m was followed by a token, so was its own suffix of
        length m - 1), so a binary search over the length finds it in O(depth log depth).
        """
        lo, hi = 0, min(len(context), self.depth - 1)
        best = Match(_ROOT, 0, 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.walk(context[len(context) - mid:])
            total = self.continuation_total(node) if node >= 0 else 0
            if total:
                best, lo = Match(node, mid, total), mid
            else:
                hi = mid - 1
        return best

    def continuations(self, node: int) -> list[tuple[int, float, int]]:
        """(token, empirical probability, child node) for every token that followed ``node``, most frequent
        first. The probability is the child's share of the occurrences that had a continuation."""
        children = self._children[node]
        if not children:
            return []
        total = sum(self._count[c] for c in children.values())
        ranked = sorted(children.items(), key=lambda item: (-self._count[item[1]], item[0]))
        return [(token, self._count[child] / total, child) for token, child in ranked]

    # ------------------------------------------------------------------ inspection

    def nbytes(self) -> int:
        """An estimate of the memory the trie holds (node slots plus children dicts)."""
        slots = len(self._count) * (2 * 8 + 28)  # two list pointers + a small int per node
        dicts = sum(sys.getsizeof(c) for c in self._children if c)
        return slots + dicts

    def approx_nbytes(self) -> int:
        """:meth:`nbytes` in O(1): 260 bytes per live node (nbytes() measured 256-260 per node on
        CPython 3.11 for random replies over vocabularies of 4 to 50000 tokens)."""
        return self.nodes * NODE_BYTES

    def dump(self) -> dict[tuple[int, ...], int]:
        """Every string in the trie with its count (for tests: tries are equal iff dumps are)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(_ROOT, ())]
        while stack:
            node, path = stack.pop()
            for token, child in (self._children[node] or {}).items():
                out[path + (token,)] = self._count[child]
                stack.append((child, path + (token,)))
        return out


class Appender:
    """Inserts one sequence into a trie incrementally, one token at a time.

    Keeps the nodes of the sequence's suffixes shorter than ``depth`` (at most depth - 1 of
    them): a new token extends each by one child and starts a new suffix at the root.
    """

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self._open: deque[int] = deque()  # nodes of the suffixes that can still grow, longest first
        self.length = 0

    def extend(self, tokens: Iterable[int]) -> None:
        trie = self.trie
        for token in tokens:
            token = int(token)
            grown = []
            for node in (*self._open, _ROOT):
                child = trie._child(node, token, create=True)
                trie._count[child] += 1
                grown.append(child)
            # The longest suffix reached the depth limit: it cannot grow any further.
            if len(grown) >= trie.depth:
                grown.pop(0)
            self._open = deque(grown)
            self.length += 1


class ReplyMemory:
    """Earlier replies in one trie, bounded to ``max_tokens``: the oldest replies are evicted first."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self._replies: deque[tuple[int, ...]] = deque()
        self.tokens = 0

    def add(self, reply: Sequence[int], cue: Sequence[int] = ()) -> None:
        """Remember a finished reply, after ``cue`` (the last prompt tokens before it), as one
        sequence: its last ``max_tokens`` tokens if it alone is longer. The cue and the reply both
        count towards the bound.

        Why the cue: a reply stored alone is matched only once its first tokens are out, so a
        repeated question's first draft could copy at most what a 2-token match allows; with the
        question's tail and the chat template's assistant header in front, the same question
        matches the cue at full depth from the reply's first token on.
        """
        if not len(reply):
            return  # a reply with no tokens (cancelled at once) teaches nothing, whatever its cue
        reply = tuple(int(t) for t in (*cue, *reply))[-self.max_tokens:]
        while self._replies and self.tokens + len(reply) > self.max_tokens:
            old = self._replies.popleft()
            self.trie.remove(old)
            self.tokens -= len(old)
        self.trie.insert(reply)
        self._replies.append(reply)
        self.tokens += len(reply)

    def clear(self) -> None:
        self.trie = SuffixTrie(self.trie.depth)
        self._replies.clear()
        self.tokens = 0

    @property
    def replies(self) -> int:
        return len(self._replies)

    def nbytes(self) -> int:
        return self.trie.nbytes() + sum(sys.getsizeof(r) for r in self._replies)

    def approx_nbytes(self) -> int:
        """:meth:`nbytes` in O(1) (for per-call stats): the trie's estimate plus 8 bytes per token held."""
        return self.trie.approx_nbytes() + 8 * self.tokens


def best_chain(trie: SuffixTrie, context: Sequence[int], max_tokens: int, *, min_prob: float,
               length_factor: float) -> Chain:
    """The greedy most-frequent continuation of ``context``'s longest earlier-seen suffix.

    Follows the most frequent child while the chain's cumulative probability stays at or
    above ``min_prob`` and it is shorter than ``length_factor x match length`` (a long match
    predicts a long copy; SuffixDecoding scales its speculation the same way) and
    ``max_tokens``. The walk also stops where the trie's depth ends.
    """
    match = trie.longest_match(context)
    if not match.length or max_tokens < 1:
        return EMPTY_CHAIN
    limit = min(max_tokens, max(1, int(length_factor * match.length)), trie.depth - match.length)
    tokens: list[int] = []
    probs: list[float] = []
    node, running = match.node, 1.0
    while len(tokens) < limit:
        options = trie.continuations(node)
        if not options:
            break
        token, prob, child = options[0]
        if running * prob < min_prob:
            break
        running *= prob
        tokens.append(token)
        probs.append(prob)
        node = child
    return Chain(tuple(tokens), tuple(probs), match.length)
