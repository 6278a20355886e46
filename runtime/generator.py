"""The Python API: ``Generator.from_bundle(path)``, ``.generate(...)``, ``.stream(...)``.

Everything that can be checked is checked at construction or at the start of a
call, before a session runs: the manifest and checksums, parameters, the prompt
length against max_context.

Thread safety: one Generator owns one KV cache per model, so calls from several
threads are serialised by an internal lock (generate, stream, warmup, tune and
forget_replies all take it); each call's output equals what it would give alone.
A stream holds the lock from its first delta until it is exhausted or closed, and
releases it on every exit path (a raising callback included).

Reproducibility: greedy output is deterministic. A sampling seed reproduces a run
for the same draft-length schedule (speculation off, or a fixed ``draft_tokens``) and the
same proposals (the default and suffix drafters also draft from earlier replies: pass
``reply_memory=False`` for seeded runs that must repeat);
adaptive k follows measured step times, so seeded sampled text can differ between
runs while its distribution stays the target's.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..bundle.extra import CostProfile
from ..engines import EngineOptions
from ..engines.base import Interrupt, interrupting
from ..engines.invariant import BatchInvariantEngine
from ..errors import ForwardCancelled, InvalidParameterError, SpecedgeError
from . import inputs, loop, prefill_ahead, warmup
from . import prompt_cache
from .drafters import (DEFAULT_DRAFTER, DRAFTERS, NO_DRAFTER, DraftModel, Drafter, needs_draft_model, reads_replies,
                       uses_draft_model)
from .loading import LoadedBundle, load_bundle
from .memory import SpeculationMemory
from .policies import POLICIES, Controller, PolicySetup, policy_for
from .slots import CacheSlot, SlotPool
from .text import StreamDecoder
from .verify import near_tie_gap
from .options import GenerationConfig
from .results import GenerationResult, TextStream

__all__ = ["GenerationConfig", "GenerationResult", "Generator", "TextStream"]


class Generator:
    """The call path over a loaded bundle: encode, build the drafter, run the loop under the lock,
    map the outcome. Loading is :mod:`.loading`; what is learned across replies, :attr:`memory`."""

    def __init__(self, loaded: LoadedBundle, *, cache_slots: int = 1, cache_memory: int | None = None) -> None:
        self.loaded = loaded
        self.bundle = loaded.bundle
        self.manifest = loaded.manifest
        self.codec = loaded.codec
        self.target = BatchInvariantEngine(loaded.target)  # exact mode's engine; .inner is the bare (fast) one
        self.draft = loaded.draft
        self.threads = loaded.threads
        # Conversation slots: each keeps its caches (allocated once) and the tokens they hold, so a
        # call that continues an earlier one prefills only what is new (runtime/slots.py).
        # The pool calls back through a weak reference: a bound method stored in it would make a cycle
        # (Generator -> pool -> method -> Generator) that only the cyclic GC frees, so a dropped Generator
        # would keep its sessions and caches (hundreds of MB) until some later gc.collect().
        new_slot, copied = weakref.WeakMethod(self._new_slot), weakref.WeakMethod(self._copied_prefix)
        self.slots = SlotPool(lambda: new_slot()(), max_slots=cache_slots, max_bytes=cache_memory,
                              copied=lambda slot: copied()(slot))
        self.draft_head_ids = loaded.draft_head_ids
        self.max_context = self.manifest.target.max_context
        self.eos_token_ids = self.manifest.target.eos_token_ids
        self.near_tie_gap = near_tie_gap(self.manifest.target.precision, self.manifest.extra.target_batch_variance())
        self.memory = SpeculationMemory(loaded.cost_profile)
        self._lock = threading.Lock()
        self._owner: int | None = None  # id of the thread whose generation holds _lock

    def _new_slot(self) -> CacheSlot:
        return CacheSlot(self.target.new_cache(), self.draft.new_cache() if self.draft is not None else None)

    def _copied_prefix(self, slot: CacheSlot) -> None:
        """A slot's target cache now holds a copy of another's prefix: exact mode continues it only
        once the batch-invariant engine knows its tokens (fast mode runs the bare engine)."""
        if slot.exact:
            self.target.adopt(slot.target_kv, np.asarray(slot.tokens, np.int64))

    @property
    def target_kv(self):
        """The first conversation slot's target cache (every Generator has it)."""
        return self.slots.slots[0].target_kv

    @property
    def draft_kv(self):
        """The first conversation slot's draft cache, or None without a draft model."""
        return self.slots.slots[0].draft_kv

    @classmethod
    def from_bundle(cls, path: str | Path, *, provider: str = "cpu", threads: int = 0,
                    draft_threads: int | None = None, verify_checksums: bool = True,
                    load_draft: bool = True, engine_options: EngineOptions | None = None,
                    cache_slots: int = 1, cache_memory: int | None = None) -> "Generator":
        """Load a bundle folder written by ``specedge export``.

        ``cache_slots``: conversations whose KV caches are kept between calls (each costs the
        target's and the draft's cache at max_context; allocated on first need); ``cache_memory``:
        a byte limit on them. A call continuing one of them prefills only its new tokens.

        ``threads``: intra-op threads per session (0 = ORT default). ``verify_checksums``:
        hash every file against the manifest (on by default; off skips ~1 s per GB).
        """
        return cls(load_bundle(path, provider=provider, threads=threads, draft_threads=draft_threads,
                               verify_checksums=verify_checksums, load_draft=load_draft,
                               engine_options=engine_options), cache_slots=cache_slots, cache_memory=cache_memory)

    @property
    def cost_profile(self) -> CostProfile | None:
        """The measured step costs for this machine, if any (``tune()`` measures them)."""
        return self.memory.profile

    # --------------------------------------------------------------------- prompts
    def encode_prompt(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                      input_ids: Sequence[int] | None = None, chat: bool = True,
                      allow_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids, checked (runtime/inputs.py): exactly one of ``prompt``, ``messages`` or
        ``input_ids``; 1 <= length < max_context."""
        return inputs.encode_prompt(self.codec, vocab_size=self.manifest.target.vocab_size,
                                    max_context=self.max_context, prompt=prompt, messages=messages,
                                    input_ids=input_ids, chat=chat, allow_special_tokens=allow_special_tokens)

    # --------------------------------------------------------------------- drafting
    def _drafter_and_controller(self, config: GenerationConfig) -> tuple[str | None, Controller | None]:
        """The drafter's name and the controller for ``config``, checked before the run starts
        (the drafter itself is built under the lock, on the conversation slot's draft cache)."""
        spec = self.manifest.speculation
        name = config.drafter or spec.drafter
        if config.drafter is None and needs_draft_model(name) and self.draft is None:
            name = DEFAULT_DRAFTER  # the draft model was not loaded (load_draft=False): speculate without it
        if not config.speculation or name == NO_DRAFTER:
            return None, None
        if needs_draft_model(name) and self.draft is None:
            raise InvalidParameterError(f"drafter {name!r} needs a draft model, and this bundle has none "
                                        "(export with --draft, or use --drafter ngram)")
        adaptive = spec.adaptive if config.adaptive is None else config.adaptive
        if config.draft_tokens is not None and config.adaptive is None:
            adaptive = False  # an explicit k means "this k"
        has_model = uses_draft_model(name, self.draft is not None)
        policy = policy_for(adaptive=adaptive, per_source=DRAFTERS[name].per_source)
        setup = PolicySetup(draft_tokens=spec.draft_tokens if config.draft_tokens is None else config.draft_tokens,
                            start_k=config.draft_tokens or spec.draft_tokens,
                            max_draft_tokens=max(spec.max_draft_tokens, config.draft_tokens or 0),
                            costs=self.memory.costs_for(name, exact=config.exact, uses_model=has_model),
                            has_model=has_model)
        # Each policy rebuilds itself from what its own last controller for this drafter carried.
        return name, POLICIES[policy].from_snapshot(setup, self.memory.learned_for(name, policy))

    def _build_drafter(self, name: str, config: GenerationConfig, slot: CacheSlot) -> Drafter:
        draft = None if self.draft is None else DraftModel(self.draft, slot.draft_kv, self.draft_head_ids,
                                                           self.manifest.target.vocab_size, slot.draft_prefix)
        # The cross-reply memory is the Generator's (shared by every slot): replies never change tokens.
        replies = self.memory.replies if reads_replies(name) and config.reply_memory else None
        return DRAFTERS[name].build(config, draft, replies)

    # --------------------------------------------------------------------- the lock
    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the Generator (its caches and memory) for this thread; refuse re-entry instead of
        hanging (the lock is not reentrant). Released on every exit path, exceptions included."""
        if self._owner == threading.get_ident():
            raise SpecedgeError("this thread already has an unfinished generation on this Generator (a "
                                "stream() not yet exhausted or closed); finish, cancel() or close() it first: "
                                "a Generator runs one generation at a time")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    # --------------------------------------------------------------------- learning
    def forget_replies(self) -> None:
        """Forget what recent replies taught the adaptive controller (draft acceptance, reply
        lengths) and the suffix drafter's cross-reply memory (the replies' tokens), e.g. when
        this Generator starts serving another kind of traffic. Measured
        step costs are kept: they belong to the machine, not to the text."""
        with self._exclusive():
            self.memory.forget_replies()

    def tune(self, *, save: bool = False, context: int = 128) -> CostProfile:
        """Measure this machine's step costs (target 1..max_draft_tokens+1, draft 1) and use them.

        ``save=True`` records them in the bundle's manifest for later runs on this machine.
        """
        with self._exclusive():
            return self._tune(save, context)

    def _tune(self, save: bool, context: int) -> CostProfile:
        return warmup.tune(self.target, self.draft, self.memory, threads=self.threads, context=context,
                           max_draft_tokens=self.manifest.speculation.max_draft_tokens,
                           bundle=self.bundle if save else None)

    def warmup(self, *, tune: bool = True) -> None:
        """Run every session once (prefill, step, verify shapes) so the first request pays no setup.

        With ``tune`` and no usable cost profile for this machine, also measure one (seconds).
        """
        k = self.manifest.speculation.max_draft_tokens
        ids = warmup.warm_ids(self.manifest.target.vocab_size, self.max_context, k)
        with self._exclusive():
            # An empty slot if there is one; else scratch caches, so a held conversation (a loaded
            # prompt cache) survives a warm-up.
            slot = next((s for s in self.slots.slots if not s.tokens), None) or self._new_slot()
            warmup.warm_sessions(self.target, self.draft, slot.target_kv, slot.draft_kv, ids, k)
            slot.drop()  # what warm-up wrote is no conversation
            if tune and self.memory.profile is None:
                self._tune(False, 128)

    # --------------------------------------------------------------------- generation
    def _config(self, config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
        config = inputs.resolve_config(config, overrides)
        if config.exact:
            self.check_exact()
        return config

    def check_exact(self) -> None:
        """Exact mode needs a target whose 2-row plain steps equal its verify rows bit for bit; export
        checks that on its machine (``extra.exact_steps``). A target recorded without it is refused by
        name rather than silently losing the guarantee (older bundles without the record run)."""
        inputs.check_exact(self.manifest)

    def _start(self, ids: list[int], config: GenerationConfig, cancel: Interrupt | None
               ) -> tuple[GenerationResult, Iterator[str]]:
        """The one generation path behind generate() and stream(): the result it fills, and
        the iterator of text deltas that runs it. Drafter errors surface here, at the call;
        the run itself starts (and takes the lock) on the iterator's first next()."""
        name, controller = self._drafter_and_controller(config)
        state = loop.LoopResult()
        result = GenerationResult("", [], "length", state.stats, ids)
        return result, self._iterate(ids, config, name, controller, state, result, cancel)

    def _iterate(self, ids: list[int], config: GenerationConfig, drafter_name: str | None,
                 controller: Controller | None, state: loop.LoopResult, result: GenerationResult,
                 cancel: Interrupt | None) -> Iterator[str]:
        rng = np.random.default_rng(config.seed)
        decoder = StreamDecoder(self.codec, config.stop)
        pending: list[str] = []

        def on_block(tokens: list[int]) -> int | None:
            """Decode a block as it commits; a completed stop string ends the run inside it."""
            before = len(decoder.ids)
            delta = decoder.push(tokens)
            if delta:
                pending.append(delta)
            return None if decoder.stopped_at is None else decoder.stopped_at + 1 - before

        # A cancel reaches into the forward in progress (engines/base.py Interrupt); stream() passes one.
        with self._exclusive(), interrupting((self.target.inner, self.draft), cancel):
            slot, reuse = self.slots.acquire(ids, config.exact, salt=config.cache_salt, reuse=config.reuse_prefix)
            drafter = None if drafter_name is None else self._build_drafter(drafter_name, config, slot)
            # Exact: the batch-invariant target, whose plain steps take the verify's kernels; fast (default): 1 row.
            target = self.target if config.exact else self.target.inner
            blocks = loop.run(target, slot.target_kv, np.asarray(ids, np.int64),
                              max_new_tokens=config.max_new_tokens, eos_token_ids=self.eos_token_ids,
                              sampling=config.sampling, rng=rng, drafter=drafter, controller=controller,
                              result=state, mode=config.mode, stop=on_block, near_tie=self.near_tie_gap,
                              max_latency_s=config.max_latency_s,
                              horizon=self.memory.reply_lengths.expected_remaining,
                              costs=None if drafter is None else self.memory.costs_for(
                                  drafter.name, exact=config.exact, uses_model=uses_draft_model(drafter.name, self.draft is not None)),
                              reuse=reuse)
            failed = True
            try:
                for _ in blocks:
                    result.text = decoder.text
                    result.token_ids = list(state.tokens)
                    if pending:
                        yield "".join(pending)
                        pending.clear()
                    if cancel is not None and cancel.is_set():
                        state.finish_reason = "cancelled"
                        break
                failed = False
            except ForwardCancelled:  # a cancel stopped a forward midway: it advanced no cache length
                state.finish_reason = "cancelled"
                failed = False
            except GeneratorExit:  # the consumer closed the stream: a cancel, the caches are sound
                failed = False
                raise
            finally:
                blocks.close()
                if failed:
                    slot.drop()  # a forward (or the callback) raised mid-run: never keep a half-written cache
                else:  # the slot keeps exactly the committed tokens its cache holds
                    cancelled = state.finish_reason in (None, "cancelled")  # closed, or cancel()
                    slot.keep(ids + state.tokens, config.exact, cancelled_prompt=len(ids) if cancelled else 0)
                tail = decoder.push([], final=True) if decoder.stopped_at is None else ""
                self._finish(ids, config, state, result, decoder, drafter, controller)
        if tail:
            yield tail

    def _finish(self, ids: list[int], config: GenerationConfig, state: loop.LoopResult, result: GenerationResult,
                decoder: StreamDecoder, drafter: Drafter | None, controller: Controller | None) -> None:
        """Map the loop's outcome onto the result, and remember what the reply taught."""
        result.text = decoder.text
        result.token_ids = list(state.tokens)
        result.stats.new_tokens = len(state.tokens)
        reason = state.finish_reason or "cancelled"
        result.finish_reason = {"context": "length", "stop_string": "stop"}.get(reason, reason)
        if reason == "context":
            result.message = (f"reached max_context ({self.max_context} tokens: prompt "
                              f"{len(ids)} + {len(state.tokens)} generated)")
        learned = controller.snapshot() if controller is not None else None
        if learned is not None:
            result.stats.mode_s = dict(learned.mode_s)
            result.stats.catchup_deferred = learned.catchup_deferred
            result.stats.policy = learned.counters()  # the policy's own account, whatever it counts
        self.memory.remember(len(state.tokens), reason, drafter.name if drafter is not None else None, learned,
                             policy=controller.name if controller is not None else None)
        if drafter is not None and reads_replies(drafter.name) and config.reply_memory:
            self.memory.remember_reply(state.tokens, ids)  # a cancelled reply's committed tokens are text too
        result.stats.reply_memory_tokens = self.memory.replies.tokens
        result.stats.reply_memory_bytes = self.memory.replies.approx_nbytes()

    def prefill(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                input_ids: Sequence[int] | None = None, config: GenerationConfig | None = None,
                **overrides) -> dict:
        """Push the known part of the next turn into a conversation slot before the turn ends.

        A voice agent calls this with the history and the user's partial transcript (interim
        speech-to-text); the real request then computes only what changed since. Returns
        ``{"prompt_tokens", "reused_tokens", "computed_tokens", "draft_computed_tokens", "seconds"}``.
        Nothing is generated; the slot is the one the request will find by longest prefix. When
        the request will draft with the draft model, its cache is filled too (in full, not bounded
        by ``draft_window``: this runs before the turn ends, so the draft's catch-up is off the
        critical path and the draft then reads the whole conversation).
        """
        config = self._config(config, overrides)
        ids = self.encode_prompt(prompt, messages=messages, input_ids=input_ids, chat=config.chat,
                                 allow_special_tokens=config.allow_special_tokens)
        start = time.perf_counter()
        with self._exclusive():
            _, reuse, drafted = self._prefill(ids, config)
        return {"prompt_tokens": len(ids), "reused_tokens": reuse, "computed_tokens": len(ids) - reuse,
                "draft_computed_tokens": drafted, "seconds": time.perf_counter() - start}

    def _prefill(self, ids: list[int], config: GenerationConfig) -> tuple[CacheSlot, int, int]:
        """Fill a slot with ``ids`` (under the lock): the slot, the target tokens it already held and
        the draft tokens computed. A forward that raises drops the slot."""
        inputs.check_prefix_room(ids, self.max_context)
        slot, reuse = prefill_ahead.acquire(self.slots, ids, config)
        name, _ = self._drafter_and_controller(config)
        fill_draft = name is not None and uses_draft_model(name, self.draft is not None)
        drafted = prefill_ahead.fill(slot, reuse, ids, self.target if config.exact else self.target.inner,
                                     self.draft if fill_draft else None, exact=config.exact)
        return slot, reuse, drafted

    # --------------------------------------------------------------------- prompt cache
    def _prompt_cache_key(self, exact: bool) -> dict:
        return prompt_cache.cache_key(self.manifest, exact=exact, runtime=self.loaded.runtime,
                                      with_draft=self.draft is not None, threads=self.threads)

    def save_prompt_cache(self, path: str | Path, prompt: str | None = None, *, messages: list[dict] | None = None,
                          input_ids: Sequence[int] | None = None, config: GenerationConfig | None = None,
                          **overrides) -> dict:
        """Compute the K/V of a fixed prefix (a system prompt) and write them to ``path``, so a
        restart loads them (:meth:`load_prompt_cache`) instead of prefilling again.

        The prefix is encoded as a chat prompt would be; with ``messages=[{"role": "system", ...}]``
        the generation prompt is left off (the conversation continues after it). The slot holding it
        stays warm. Returns ``{"path", "tokens", "draft_tokens", "bytes"}``. The file is keyed by the
        bundle's graph hashes, precision, max_context, the exactness setting and the runtime
        (runtime/prompt_cache.py); PromptCacheError when the path cannot be written.
        """
        config = self._config(config, overrides)
        if messages is not None:
            ids = self.codec.encode_chat(messages, allow_special_tokens=config.allow_special_tokens,
                                         add_generation_prompt=False)
        else:
            ids = self.encode_prompt(prompt, input_ids=input_ids, chat=config.chat,
                                     allow_special_tokens=config.allow_special_tokens)
        with self._exclusive():
            slot, _, _ = self._prefill(ids, config)
            draft_tokens, size = prefill_ahead.save_filled(path, self._prompt_cache_key(config.exact), ids, slot)
        return {"path": str(path), "tokens": len(ids), "draft_tokens": draft_tokens, "bytes": size}

    def load_prompt_cache(self, path: str | Path, *, exact: bool = False) -> dict:
        """Load a prefix saved by :meth:`save_prompt_cache` into a free (or the least recently
        used) conversation slot; a request starting with that prefix then prefills only the rest.

        Refused with PromptCacheError, before any slot changes, when the file is missing,
        truncated, corrupt, or was saved for another bundle, precision, max_context, exactness
        (``exact``: the setting requests will run with) or runtime; the message names the field.
        Returns ``{"tokens", "draft_tokens", "token_ids"}`` (the prefix held).
        """
        if exact:
            self.check_exact()
        with self._exclusive():
            loaded = prefill_ahead.load_saved(self.slots, path, self._prompt_cache_key(exact), self.target,
                                              exact=exact, vocab_size=self.manifest.target.vocab_size)
        return {"tokens": len(loaded.tokens), "draft_tokens": len(loaded.draft_tokens),
                "token_ids": list(loaded.tokens)}

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 input_ids: Sequence[int] | None = None, config: GenerationConfig | None = None,
                 **overrides) -> GenerationResult:
        """Generate a completion. Keyword overrides are GenerationConfig fields
        (``max_new_tokens=64, temperature=0.7, draft_tokens=4, drafter="ngram"``...)."""
        config = self._config(config, overrides)
        ids = self.encode_prompt(prompt, messages=messages, input_ids=input_ids, chat=config.chat,
                                 allow_special_tokens=config.allow_special_tokens)
        result, deltas = self._start(ids, config, None)
        for _ in deltas:
            pass
        return result

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               input_ids: Sequence[int] | None = None, config: GenerationConfig | None = None,
               callback: Callable[[str], None] | None = None, **overrides) -> TextStream:
        """Yield text deltas as blocks commit. ``stream.result`` holds the GenerationResult
        once the iterator is exhausted; ``stream.cancel()`` stops the forward in progress (CPU) or the next block.
        With ``callback``, runs to completion calling it with each delta and returns the stream;
        a callback that raises ends the generation (the Generator is released) and the error
        propagates."""
        config = self._config(config, overrides)
        ids = self.encode_prompt(prompt, messages=messages, input_ids=input_ids, chat=config.chat,
                                 allow_special_tokens=config.allow_special_tokens)
        cancel = Interrupt()
        result, deltas = self._start(ids, config, cancel)
        stream = TextStream(deltas, result, cancel)
        if callback is not None:
            with stream:  # closes the run (and releases the Generator) however the loop ends
                for delta in stream:
                    callback(delta)
        return stream
