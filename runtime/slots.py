"""Conversation cache slots: keep each conversation's KV cache across calls, reuse the longest prefix.

A voice-agent framework sends the whole conversation every turn (system prompt, earlier turns,
the new user turn). A slot remembers which token ids its target cache holds, position by
position; the next call keeps the longest common token prefix and prefills only the rest
(rewinding is a length change), and the draft model keeps its own prefix the same way. This is
llama.cpp's server ``cache_prompt`` and vLLM's prefix caching, for one device and batch 1.

A pool bounds the slots by count and by bytes. Slots follow conversations: a call takes a slot
only when its prompt *continues* what the slot holds (all but :data:`CONTINUATION_SLACK` of its
tokens), or branches off the slot's latest turn (an edited or regenerated last message, a final
transcript after an interim prefill), or extends the prompt of a call its client cancelled (a
preemptive request on an interim transcript: its few committed reply tokens are no part of the
next attempt); the longest such match wins, most recently used on ties.
Otherwise it takes a free slot, or else evicts the least recently used one (keeping whatever prefix
that slot shares with the prompt). A mere shared system prompt is no reason to take a slot: that
would throw away another conversation's cache to save the system prompt's prefill, and every
interleaved caller would end up in one slot. There is no conversation id to manage. The prefix is
not computed again either: where another slot holds a longer prefix of the prompt (a system prompt
every call shares, an earlier turn a regenerated reply branches from), it is copied into the new
slot, one copy per layer instead of a prefill, and the other slot keeps its conversation.

Isolation: each slot remembers the cache salt (namespace) it was written under. A call with another
salt reuses nothing of it, not even a prefix (so ``reused_tokens`` counts only tokens its own salt
wrote); None is a salt like any other. The one exception is a prefix the operator published (a
loaded prompt cache, :meth:`CacheSlot.publish`): every salt may reuse that, and only that.

Exactness: an exact call's slot was computed by the same graph with the same per-row kernels (every
exact target forward runs >= 2 rows, engines/invariant.py), so a reply that reuses it, or a copy of
it, is the reply a cold start gives. A slot written with 1-row steps (fast mode) is not reused by an
exact call, nor the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..engines.base import KVCache
from ..errors import InvalidParameterError
from ..bundle.manifest import Manifest, ModelEntry


# A prompt continues a slot's conversation when it keeps all but at most this many of the slot's
# tokens: a reply's last tokens can come back re-encoded differently, a stop string's tokens are
# dropped by the client, an interim transcript's last words change. A different conversation with
# the same system prompt discards the other's whole first turn (its reply alone is longer).
CONTINUATION_SLACK = 8


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cache_nbytes(entry: ModelEntry) -> int:
    """Bytes of one model's KV cache at max_context, as :class:`KVCache` allocates it:
    K and V, per layer, ``max_context * n_kv_heads * head_dim`` of ``kv_dtype`` (host layout; a device
    cache adds at most 256 bytes of alignment per buffer)."""
    per_position = entry.n_kv_heads * entry.head_dim * np.dtype(entry.kv_dtype).itemsize
    return 2 * entry.n_layers * entry.max_context * per_position


@dataclass(frozen=True)
class SlotCost:
    """What one conversation slot costs: the target's and the draft's caches at max_context (bytes)."""

    target_bytes: int
    draft_bytes: int  # 0 without a draft model
    max_context: int

    @property
    def bytes(self) -> int:
        return self.target_bytes + self.draft_bytes

    @classmethod
    def of(cls, manifest: Manifest, *, with_draft: bool = True) -> "SlotCost":
        draft = manifest.draft if with_draft else None
        return cls(cache_nbytes(manifest.target), cache_nbytes(draft) if draft is not None else 0,
                   manifest.target.max_context)

    def to_dict(self, slots: int = 1) -> dict:
        return {"target_bytes": self.target_bytes, "draft_bytes": self.draft_bytes, "slot_bytes": self.bytes,
                "max_context": self.max_context, "slots": slots, "total_bytes": slots * self.bytes}


def used_nbytes(kv: KVCache) -> int:
    """Bytes of ``kv`` holding committed positions (``length`` of ``capacity``)."""
    return kv.nbytes * kv.length // kv.capacity if kv.capacity else 0


@dataclass
class DraftPrefix:
    """What a slot's draft cache holds across calls, kept up to date by the model drafter.

    ``tokens[p]``: the token id at draft cache position p. A bridged catch-up (the draft window,
    runtime/model_drafter.py) leaves a gap: positions p < ``head`` hold history[p], positions
    p >= head hold history[p + ``skipped``] (skipped = 0: no gap). Keeping the gap with the tokens
    lets the next turn continue a bridged cache instead of bridging again, so the draft's catch-up is
    paid once per conversation, not once per turn.
    """

    tokens: list[int] = field(default_factory=list)
    head: int = 0
    skipped: int = 0

    def set(self, tokens: Sequence[int], head: int = 0, skipped: int = 0) -> None:
        self.tokens[:] = tokens
        self.head, self.skipped = (head, skipped) if skipped else (0, 0)

    def clear(self) -> None:
        self.set([])

    def contiguous(self) -> list[int]:
        """The held tokens at their true positions (those before any gap)."""
        return list(self.tokens[:self.head] if self.skipped else self.tokens)


@dataclass
class CacheSlot:
    """One conversation's caches and what they hold.

    ``tokens``: the token id at each position of ``target_kv`` (len == target_kv.length once a
    call has ended). ``draft_prefix``: what the draft cache holds (:class:`DraftPrefix`), kept up
    to date by the model drafter (runtime/model_drafter.py). ``exact``: whether the target cache was
    written with batch-invariant steps (None: empty). ``salt``: the cache salt of the calls that
    wrote it; ``shared``: its leading tokens any salt may reuse (a published prefix, else 0).
    ``base``: the tokens the latest call found already held when it continued this slot's
    conversation (0 when that call started a conversation here): its new material begins there.
    ``open_prompt``: the latest call's prompt length when its client cancelled it (0 otherwise).
    """

    target_kv: KVCache
    draft_kv: KVCache | None
    tokens: list[int] = field(default_factory=list)
    draft_prefix: DraftPrefix = field(default_factory=DraftPrefix)
    exact: bool | None = None
    last_used: int = 0
    salt: str | None = None
    shared: int = 0
    base: int = 0
    open_prompt: int = 0

    def drop(self) -> None:
        """Forget everything (after a failed forward: the cache may be half-written)."""
        self.target_kv.reset()
        if self.draft_kv is not None:
            self.draft_kv.reset()
        self.tokens.clear()
        self.draft_prefix.clear()
        self.exact = None
        self.salt, self.shared, self.base, self.open_prompt = None, 0, 0, 0

    def reusable(self, prompt: Sequence[int], exact: bool, salt: str | None = None) -> int:
        """How many leading prompt tokens this slot's target cache already holds for a call with
        cache salt ``salt`` (another salt may reuse only the published prefix; >= 1 token is always
        left to compute, so the call gets the last position's logits)."""
        if self.exact is not exact:
            return 0
        n = min(common_prefix(self.tokens, prompt), len(prompt) - 1, self.target_kv.length)
        return n if salt == self.salt else min(n, self.shared)

    def follows(self, reusable: int) -> bool:
        """Whether a prompt that reuses ``reusable`` of this slot's tokens is this slot's conversation:
        it continues what the slot holds (discarding at most CONTINUATION_SLACK tokens), or branches
        off inside the latest turn (it keeps everything that turn found held, and more), or, when the
        latest call was cancelled, continues that call's prompt (its reply tokens aside: a cancelled
        first attempt of a new conversation has no earlier turn to branch from, yet the next attempt
        extends its prompt)."""
        if reusable <= 0:
            return False
        if 0 < self.open_prompt and reusable >= self.open_prompt - CONTINUATION_SLACK:
            return True
        return reusable >= len(self.tokens) - CONTINUATION_SLACK or 0 < self.base < reusable

    def take(self, reusable: int, salt: str | None, *, continues: bool) -> None:
        """Hand this slot to a call with cache salt ``salt`` that reuses ``reusable`` of its tokens.
        Under another salt, everything past the reusable (published) prefix is forgotten at once,
        the draft cache's included, so nothing of it can reach the call, even as timing."""
        if salt != self.salt:
            del self.tokens[reusable:]
            self.draft_prefix.set(self.draft_prefix.contiguous()[:reusable])
            self.salt = salt
        self.shared = min(self.shared, reusable)
        self.open_prompt = 0  # the call's own keep() says whether it was cancelled
        # A call that reuses only the published prefix starts a conversation, as one in a free slot does.
        self.base = reusable if continues and reusable > self.shared else 0

    def adopt(self, donor: "CacheSlot", n: int, prompt: Sequence[int]) -> None:
        """Start a conversation here from the first ``n`` positions of ``donor`` (a prefix ``prompt``
        shares with it, under the donor's salt), copied: the target cache's, and the draft cache's as
        far as it holds the same tokens. What this slot held is forgotten first."""
        self.drop()
        self.target_kv.copy_prefix(donor.target_kv, n)
        self.tokens[:] = donor.tokens[:n]
        self.exact, self.salt, self.shared = donor.exact, donor.salt, min(donor.shared, n)
        if self.draft_kv is not None and donor.draft_kv is not None:
            m = min(common_prefix(donor.draft_prefix.contiguous(), prompt), n, donor.draft_kv.length)
            self.draft_kv.copy_prefix(donor.draft_kv, m)
            self.draft_prefix.set(list(prompt[:m]))

    def publish(self) -> None:
        """Let every salt reuse what this slot holds now (an operator's prefix: a loaded prompt cache)."""
        self.shared = len(self.tokens)

    def keep(self, committed: Sequence[int], exact: bool, *, cancelled_prompt: int = 0) -> None:
        """Record what the target cache holds after a call: the committed tokens it has K/V for.
        Anything past the committed sequence (a stop inside a block, a cancel) is rewound.
        ``cancelled_prompt``: the call's prompt length when its client cancelled it (else 0)."""
        held = min(self.target_kv.length, len(committed))
        self.target_kv.rewind(self.target_kv.length - held)
        self.tokens[:] = committed[:held]
        self.exact = exact
        self.shared = min(self.shared, held)
        self.open_prompt = min(cancelled_prompt, held)

    def nbytes(self) -> int:
        """Bytes allocated for this slot (both caches at max_context)."""
        return self.target_kv.nbytes + (self.draft_kv.nbytes if self.draft_kv is not None else 0)

    def used_nbytes(self) -> int:
        """Bytes of those holding committed positions (what the conversation actually fills)."""
        return used_nbytes(self.target_kv) + (used_nbytes(self.draft_kv) if self.draft_kv is not None else 0)

    def describe(self) -> dict:
        return {"held_tokens": len(self.tokens), "target_positions": self.target_kv.length,
                "draft_positions": self.draft_kv.length if self.draft_kv is not None else 0,
                "used_bytes": self.used_nbytes(), "allocated_bytes": self.nbytes()}


class SlotPool:
    """At most ``max_slots`` slots and ``max_bytes`` of cache, allocated on first need.

    ``new_slot()`` allocates one slot's caches (every slot costs the same bytes). ``copied(slot)`` is
    told of a slot whose target cache was just filled by copying another's prefix (the Generator
    records its tokens with the exact-mode engine, which continues only caches it knows).
    """

    def __init__(self, new_slot: Callable[[], CacheSlot], *, max_slots: int, max_bytes: int | None = None,
                 copied: Callable[[CacheSlot], None] | None = None) -> None:
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
            raise InvalidParameterError(f"cache_slots must be an integer >= 1; got {max_slots!r}")
        self._new_slot = new_slot
        self._copied = copied
        self.slots: list[CacheSlot] = [new_slot()]  # the first slot always exists (warm-up, one conversation)
        per_slot = self.slots[0].nbytes()
        if max_bytes is not None and max_bytes < per_slot:
            raise InvalidParameterError(f"cache_memory {max_bytes} bytes cannot hold one slot ({per_slot} bytes: "
                                        "the target and draft caches at max_context)")
        self.max_slots = max_slots if max_bytes is None else min(max_slots, max_bytes // per_slot)
        self._clock = 0

    def acquire(self, prompt: Sequence[int], exact: bool, *, salt: str | None = None,
                reuse: bool = True) -> tuple[CacheSlot, int]:
        """The slot for ``prompt`` (written under cache salt ``salt``) and how many of its tokens it
        already holds: the slot whose conversation the prompt follows (longest match, most recently
        used on ties); else a free slot; else the least recently used one."""
        self._clock += 1
        # What each slot holds of the prompt for this call: picks the follower, and the donor of a copy.
        held = [(slot.reusable(prompt, exact, salt), slot) for slot in self.slots] if reuse else []
        best, best_len = None, 0
        for n, slot in held:
            if slot.follows(n) and (n > best_len or (n == best_len and slot.last_used > best.last_used)):
                best, best_len = slot, n
        continues = best is not None
        if best is None:
            empty = [s for s in self.slots if not s.tokens]
            if empty:  # a slot that holds nothing (the first one, a dropped one) costs no eviction
                best = empty[0]
            elif len(self.slots) < self.max_slots:
                best = self._new_slot()
                self.slots.append(best)
            else:  # evict the least recently used; what it shares with the prompt is still good
                best = min(self.slots, key=lambda s: s.last_used)
                best_len = next((n for n, slot in held if slot is best), 0)
            if reuse and best.target_kv.copies_prefix:
                best_len = self._copy_shared_prefix(best, best_len, prompt, held)
        best.take(best_len, salt, continues=continues)
        if not reuse:
            best.draft_prefix.clear()  # a cold start for the draft model too
        best.last_used = self._clock
        return best, best_len

    def _copy_shared_prefix(self, slot: CacheSlot, have: int, prompt: Sequence[int],
                            held: list[tuple[int, CacheSlot]]) -> int:
        """Fill ``slot`` (which holds ``have`` tokens of ``prompt``) with the longest prefix of ``prompt``
        another slot holds for this call (``held``: each slot's reusable tokens), when that is longer:
        copied, not computed again. The other slot keeps its conversation. Returns the tokens ``slot``
        now holds of the prompt."""
        n, donor = max(((n, other) for n, other in held if other is not slot), key=lambda d: d[0], default=(0, None))
        if n <= have:
            return have
        slot.adopt(donor, n, prompt)
        if self._copied is not None:
            self._copied(slot)
        return n

    def clear(self) -> None:
        for slot in self.slots:
            slot.drop()

    def nbytes(self) -> int:
        return sum(slot.nbytes() for slot in self.slots)

    def describe(self) -> dict:
        """Slots in use, their held tokens and bytes (for /health): ``bytes`` is what is allocated
        now (a slot is allocated on first need), ``slot_bytes`` what each slot costs, ``per_slot`` each
        slot's held tokens, used and allocated bytes, most recently used first."""
        ordered = sorted(self.slots, key=lambda s: -s.last_used)
        return {"slots": len(self.slots), "max_slots": self.max_slots, "bytes": self.nbytes(),
                "slot_bytes": self.slots[0].nbytes(), "max_bytes": self.max_slots * self.slots[0].nbytes(),
                "used_bytes": sum(s.used_nbytes() for s in self.slots),
                "held_tokens": [len(s.tokens) for s in ordered], "per_slot": [s.describe() for s in ordered]}
