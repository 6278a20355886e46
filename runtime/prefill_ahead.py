"""Filling a conversation slot before the request that will use it arrives.

Two ways, both under the Generator's lock and both leaving the slot exactly as a request would
find it by longest prefix (runtime/slots.py):

- computed now (:func:`acquire` + :func:`fill`): a voice agent's partial transcript
  (``Generator.prefill``), or a fixed prefix about to be saved (``Generator.save_prompt_cache``);
- read from a file written earlier (:func:`load_saved`, the ``--prompt-cache`` file of
  runtime/prompt_cache.py), so a restart does not pay for the prefix's prefill again;
  :func:`warm_from_file` is serve's startup step (load the file, or create it).

A forward (or a fill) that raises drops the slot: a half-written cache is never kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..engines.base import Engine
from ..engines.invariant import BatchInvariantEngine
from ..errors import PromptCacheError
from . import prompt_cache
from .loop import prefill
from .options import GenerationConfig
from .slots import CacheSlot, SlotPool, common_prefix


def acquire(slots: SlotPool, ids: list[int], config: GenerationConfig) -> tuple[CacheSlot, int]:
    """The slot a request starting with ``ids`` will find, and how many of ``ids`` it already holds."""
    # A request keeps >= 1 prompt token to compute (it needs the last logits); a prefill needs none, so
    # it asks as a request one token longer would (-1 is never a token id, so nothing matches it).
    return slots.acquire(ids + [-1], config.exact, salt=config.cache_salt, reuse=config.reuse_prefix)


def fill(slot: CacheSlot, reuse: int, ids: list[int], target: Engine, draft: Engine | None, *, exact: bool) -> int:
    """Compute the K/V of ``ids[reuse:]`` into ``slot``'s target cache, and, when ``draft`` is given
    (the request will draft with the draft model), of the part of ``ids`` its draft cache lacks
    (in full, not bounded by ``draft_window``: this runs before the turn ends, off the critical path).

    ``ids``: n token ids, n < max_context; ``target``: the engine the request's mode runs (exact:
    the batch-invariant one; fast: the bare one). Returns the draft tokens computed (0 without
    ``draft``). The slot keeps ``ids``; a forward that raises drops it.
    """
    drafted = 0
    try:
        slot.target_kv.rewind(slot.target_kv.length - reuse)
        if reuse < len(ids):
            prefill(target, slot.target_kv, np.asarray(ids[reuse:], np.int64))
        if draft is not None and slot.draft_kv is not None:
            keep = min(common_prefix(slot.draft_prefix.contiguous(), ids), slot.draft_kv.length, len(ids))
            slot.draft_kv.rewind(slot.draft_kv.length - keep)
            if keep < len(ids):
                draft.forward(np.asarray(ids[keep:], np.int64), slot.draft_kv, 1)
            drafted = len(ids) - keep
            slot.draft_prefix.set(ids)
    except BaseException:
        slot.drop()
        raise
    slot.keep(ids, exact)
    return drafted


def save_filled(path: str | Path, key: dict, ids: Sequence[int], slot: CacheSlot) -> tuple[int, int]:
    """Write a slot just filled with ``ids`` to ``path`` (runtime/prompt_cache.py's format, keyed by
    ``key``) and publish it: the operator's prefix may be reused under every cache salt, as a loaded
    one is. Returns (draft tokens written, file bytes)."""
    slot.publish()
    draft_tokens = slot.draft_prefix.contiguous()[:slot.draft_kv.length] if slot.draft_kv is not None else []
    size = prompt_cache.save(path, key, ids, slot.target_kv, draft_tokens, slot.draft_kv)
    return len(draft_tokens), size


def load_saved(slots: SlotPool, path: str | Path, key: dict, target: BatchInvariantEngine, *, exact: bool,
               vocab_size: int) -> prompt_cache.Loaded:
    """Load a saved prefix into a free (or the least recently used) slot and publish it.

    The file is read and checked against ``key`` and the slot's caches before anything is written into
    the slot (PromptCacheError names what differs). The slot is taken first, so a bad file still costs
    the least recently used slot its cached prefix when no slot was free (a cache: no reply changes).
    With ``exact``, ``target`` adopts the loaded positions as its own (engines/invariant.py). Returns
    what was loaded (``tokens``, ``draft_tokens``).
    """
    slot, _ = slots.acquire([-1], exact, reuse=False)  # matches nothing: a free or evicted slot
    loaded = prompt_cache.load(path, key, slot.target_kv, slot.draft_kv, vocab_size)
    slot.drop()
    try:
        loaded.fill("target", slot.target_kv)
        if exact:
            target.adopt(slot.target_kv, np.asarray(loaded.tokens, np.int64))
        if loaded.draft_tokens and slot.draft_kv is not None:
            loaded.fill("draft", slot.draft_kv)
            slot.draft_prefix.set(loaded.draft_tokens)
    except BaseException:
        slot.drop()
        raise
    slot.keep(loaded.tokens, exact)
    slot.publish()  # the operator's prefix: every cache salt may reuse it (only it)
    return loaded


def warm_from_file(generator, path: Path, system_prompt: str | None, *, exact: bool = False) -> str:
    """``serve --prompt-cache FILE [--system-prompt TEXT]`` at startup: load ``path`` into a
    conversation slot of ``generator`` (a :class:`~specedge.runtime.generator.Generator`), or,
    when there is no such file, compute the system prompt's K/V and write them there.

    Returns a line for the log. Raises PromptCacheError (the messages name serve's flags) when the
    file exists but cannot be used (another bundle or setting, truncated, corrupt, or holding
    another prompt than ``system_prompt``) — such a file is never overwritten: the path may be
    someone else's — and when there is neither a file nor a system prompt.
    """
    messages = None if system_prompt is None else [{"role": "system", "content": system_prompt}]
    if prompt_cache.exists(path):  # typed, where Path.exists raises OSError on a name too long
        loaded = generator.load_prompt_cache(path, exact=exact)
        if messages is not None:
            want = generator.codec.encode_chat(messages, add_generation_prompt=False)
            if loaded["token_ids"] != want:
                raise PromptCacheError(f"prompt cache {path} holds another prompt than --system-prompt; "
                                       "delete it to rebuild it, or give another path")
        return f"prompt cache {path}: loaded {loaded['tokens']} tokens"
    if messages is None:
        raise PromptCacheError(f"prompt cache {path} does not exist; pass --system-prompt to create it")
    saved = generator.save_prompt_cache(path, messages=messages, exact=exact)
    return f"prompt cache {path}: computed and saved {saved['tokens']} tokens ({saved['bytes'] / 1e6:.1f} MB)"
