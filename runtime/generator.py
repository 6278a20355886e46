"""The Python API: ``Generator.from_bundle(path)``, ``.generate(...)``, ``.stream(...)``.

Everything that can be checked is checked at construction or at the start of a
call, before a session runs: the manifest and checksums, parameters, the prompt
length against max_context.

Thread safety: one Generator owns one KV cache per model, so calls from several
threads are serialised by an internal lock; each call's output equals what it
would give alone. A stream holds the lock from its first delta until it is
exhausted or closed.

Reproducibility: greedy output is deterministic. A sampling seed reproduces a run
for the same draft-length schedule (speculation off, or a fixed ``draft_tokens``);
adaptive k follows measured step times, so seeded sampled text can differ between
runs while its distribution stays the target's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..engines import EngineOptions, backend_for, create_engine
from ..errors import BundleError, ContextOverflowError, InvalidParameterError, SpecedgeError
from ..manifest import Manifest, load_head_tokens, load_manifest, resolve_inside
from . import loop
from . import profile as cost_profile
from . import costs as step_costs
from .controller import AdaptiveK, Controller, FixedK
from .costs import CostModel
from .drafters import DRAFTER_CHOICES, DRAFTERS, NO_DRAFTER, DraftModel, Drafter, ModelDrafter, needs_draft_model
from .horizon import ReplyLengths
from .sampling import SamplingConfig
from .stats import GenerationStats
from .text import StreamDecoder, TextCodec
from .verify import near_tie_gap
from .model_drafter import DEFAULT_DRAFT_WINDOW


@dataclass(frozen=True)
class GenerationConfig:
    """Per-call settings. ``None`` means "the bundle's default"."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the text ends before the first one
    speculation: bool = True  # False = plain decoding, the baseline
    drafter: str | None = None  # none | model | ngram | composite
    draft_tokens: int | None = None  # fixed k; None = bundle default (adaptive or its draft_tokens)
    adaptive: bool | None = None  # adaptive k (the cost model); None = bundle default
    p_min: float = 0.0  # stop drafting when the draft's top probability is below this
    max_ngram: int = 3  # n-gram drafter: longest suffix to match
    # n-gram drafter: shortest suffix to match. 2, not 1: a single repeated token predicts the next
    # one badly (measured acceptance 0.0-0.2 on chat and voice replies), below the break-even
    # v(2) - 1 = 0.1-0.35 of a verify step, so 1-token matches only slowed decoding down.
    min_ngram: int = 2
    chat: bool = True  # wrap a plain prompt in the chat template when the bundle has one
    # Control-token text inside chat messages ("<|im_end|>") becomes control tokens. Off: it is
    # encoded as plain text, as the OpenAI API does, so user text cannot forge a system turn.
    allow_special_tokens: bool = False
    mode: str = "sequential"  # sequential | pipelined (verify-while-draft) | auto (measured per step)
    max_latency_s: float | None = None  # cap k so each block commits within this (None = no cap)
    # The draft model catches up on at most this many unseen tokens at once (see DEFAULT_DRAFT_WINDOW);
    # None = read everything (slower start, best acceptance).
    draft_window: int | None = DEFAULT_DRAFT_WINDOW

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise InvalidParameterError(f"max_new_tokens must be an integer >= 1; got {self.max_new_tokens!r}")
        if self.drafter is not None and self.drafter not in DRAFTER_CHOICES:
            raise InvalidParameterError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}; got {self.drafter!r}")
        if self.draft_tokens is not None and (isinstance(self.draft_tokens, bool)
                                              or not isinstance(self.draft_tokens, int) or self.draft_tokens < 0):
            raise InvalidParameterError(f"draft_tokens must be an integer >= 0; got {self.draft_tokens!r}")
        if not 0.0 <= self.p_min < 1.0:
            raise InvalidParameterError(f"p_min must be in [0, 1); got {self.p_min!r}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InvalidParameterError(f"n-gram sizes need 1 <= min_ngram <= max_ngram; got "
                                        f"{self.min_ngram}, {self.max_ngram}")
        if self.max_latency_s is not None and not (isinstance(self.max_latency_s, (int, float))
                                                   and self.max_latency_s > 0):
            raise InvalidParameterError(f"max_latency_s must be a number > 0 (seconds) or None; "
                                        f"got {self.max_latency_s!r}")
        ModelDrafter.check_window(self.draft_window)
        if self.mode not in loop.MODES:
            raise InvalidParameterError(f"mode must be one of {', '.join(loop.MODES)}; got {self.mode!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        self.sampling  # validates temperature / top_k / top_p / seed

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens (EOS included when it ended generation)
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or max_context), "cancelled"
    stats: GenerationStats = field(default_factory=GenerationStats)
    prompt_ids: list[int] = field(default_factory=list)
    message: str = ""  # why it finished, in words, when that is not obvious

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "message": self.message, "prompt_tokens": len(self.prompt_ids), "stats": self.stats.to_dict()}


class TextStream:
    """Iterator of text deltas, one per committed block; ``cancel()`` stops at the next block.

    While a stream is being iterated it holds its Generator (one KV cache per model), so
    other calls wait: exhaust it, ``close()`` it, or use it as a context manager.
    """

    def __init__(self, deltas: Iterator[str]) -> None:
        self._deltas = deltas
        self._cancel = threading.Event()
        self.result: GenerationResult | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self) -> None:
        """Stop generating now; ``result`` keeps what was committed. Releases the Generator."""
        self._deltas.close()

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Generator:
    """A loaded bundle: target engine, optional draft engine, tokenizer, preallocated caches."""

    def __init__(self, bundle: Path, manifest: Manifest, codec: TextCodec, target, draft=None) -> None:
        self.bundle = bundle
        self.manifest = manifest
        self.codec = codec
        self.target = target
        self.draft = draft
        self.target_kv = target.new_cache()  # allocated once, reused by every call
        self.draft_kv = draft.new_cache() if draft is not None else None
        self.draft_head_ids = (load_head_tokens(bundle, manifest.draft)
                               if draft is not None and manifest.draft is not None else None)
        self.max_context = manifest.target.max_context
        self.eos_token_ids = manifest.target.eos_token_ids
        variance = manifest.extra.get("batch_variance", {}).get("target")
        self.near_tie_gap = near_tie_gap(manifest.target.precision,
                                         variance if isinstance(variance, (int, float)) else None)
        self._profiles: dict[str, CostModel] = {}  # learned step costs per drafter, kept across calls
        # Learned per-position acceptance per drafter, kept across calls: a deployment's drafts meet
        # similar text from one reply to the next, so the next reply's first (costly) catch-up is
        # judged on what drafting achieved last time rather than on an optimistic prior.
        self._acceptance: dict[str, tuple[list[float], int]] = {}
        self.reply_lengths = ReplyLengths()  # recent replies, to weigh a draft's catch-up against
        self._lock = threading.Lock()
        self._owner: int | None = None  # id of the thread whose generation holds _lock
        self.threads = 0  # intra-op threads the sessions were created with (0 = ORT default)
        self.cost_profile: dict | None = None  # measured step costs for this machine, if any
        recorded = manifest.extra.get(cost_profile.PROFILE_KEY)
        if isinstance(recorded, dict):
            self.cost_profile = recorded

    @classmethod
    def from_bundle(cls, path: str | Path, *, provider: str = "cpu", threads: int = 0,
                    draft_threads: int | None = None, verify_checksums: bool = True,
                    load_draft: bool = True, engine_options: EngineOptions | None = None) -> "Generator":
        """Load a bundle folder written by ``specedge export``.

        ``threads``: intra-op threads per session (0 = ORT default). ``verify_checksums``:
        hash every file against the manifest (on by default; off skips ~1 s per GB).
        """
        bundle = Path(path)
        manifest = load_manifest(bundle, verify_checksums=verify_checksums)
        # Two sessions alternate on the same cores when a draft is loaded; ORT's worker threads
        # spin after each run and would steal the other session's cores (measured here: the
        # int4 Qwen pair's k=4 speculation went from 9.4 to 14.8 tok/s with spinning off).
        two_sessions = manifest.draft is not None and load_draft
        options = engine_options or EngineOptions(provider=provider, intra_op_threads=threads,
                                                  allow_spinning=not two_sessions)
        tok = manifest.tokenizer
        template = None
        if tok.chat_template:
            try:
                template = resolve_inside(bundle, tok.chat_template).read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise BundleError(f"chat template {tok.chat_template!r} is not UTF-8 text: {exc.reason} at byte "
                                  f"{exc.start}") from None
        codec = TextCodec(resolve_inside(bundle, tok.file), template, bos_token=tok.bos_token,
                          eos_token=tok.eos_token, add_bos_token=tok.add_bos_token)
        if codec.vocab_size > manifest.target.vocab_size:
            raise InvalidParameterError(f"tokenizer has {codec.vocab_size} tokens but the target's vocab_size is "
                                        f"{manifest.target.vocab_size}")
        # The engine registry picks the backend per model: CPU, the device-resident ORT engine, or a
        # native TensorRT plan the bundle records.
        target_graph = resolve_inside(bundle, manifest.target.graph)
        target = create_engine(manifest.target, target_graph, options,
                               backend_for(manifest.target, target_graph, options.provider))
        draft = None
        if manifest.draft is not None and load_draft:
            draft_options = replace(options, intra_op_threads=draft_threads if draft_threads is not None
                                    else options.intra_op_threads)
            draft_graph = resolve_inside(bundle, manifest.draft.graph)
            draft = create_engine(manifest.draft, draft_graph, draft_options,
                                  backend_for(manifest.draft, draft_graph, options.provider))
        gen = cls(bundle, manifest, codec, target, draft)
        gen.threads = options.intra_op_threads
        if gen.cost_profile is not None and not cost_profile.usable(gen.cost_profile, gen.threads):
            gen.cost_profile = None  # taken on another machine or thread setting: re-measure in warmup()
        return gen

    # --------------------------------------------------------------------- prompts
    def encode_prompt(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                      input_ids: Sequence[int] | None = None, chat: bool = True,
                      allow_special_tokens: bool = False) -> list[int]:
        given = sum(x is not None for x in (prompt, messages, input_ids))
        if given != 1:
            raise InvalidParameterError("pass exactly one of prompt, messages or input_ids")
        if input_ids is not None:
            ids = [int(t) for t in input_ids]
            bad = [t for t in ids if not 0 <= t < self.manifest.target.vocab_size]
            if bad:
                raise InvalidParameterError(f"input_ids holds ids outside [0, {self.manifest.target.vocab_size}): "
                                            f"{bad[:5]}")
        elif messages is not None:
            ids = self.codec.encode_chat(messages, allow_special_tokens=allow_special_tokens)
        else:
            if not isinstance(prompt, str):
                raise InvalidParameterError(f"prompt must be a string; got {type(prompt).__name__}")
            if chat and self.codec.chat_template:
                ids = self.codec.encode_chat([{"role": "user", "content": prompt}],
                                             allow_special_tokens=allow_special_tokens)
            else:
                ids = self.codec.encode(prompt)
        if not ids:
            raise InvalidParameterError("the prompt is empty: it encodes to no tokens")
        if len(ids) >= self.max_context:
            raise ContextOverflowError(f"prompt is {len(ids)} tokens but max_context is {self.max_context}; "
                                       "shorten it or re-export with a larger --max-context")
        return ids

    # --------------------------------------------------------------------- drafting
    def _drafter_and_controller(self, config: GenerationConfig) -> tuple[Drafter | None, Controller | None]:
        spec = self.manifest.speculation
        name = config.drafter or spec.drafter
        if config.drafter is None and needs_draft_model(name) and self.draft is None:
            name = "ngram"  # the draft model was not loaded (load_draft=False): speculate without it
        if not config.speculation or name == NO_DRAFTER:
            return None, None
        if needs_draft_model(name) and self.draft is None:
            raise InvalidParameterError(f"drafter {name!r} needs a draft model, and this bundle has none "
                                        "(export with --draft, or use --drafter ngram)")
        draft = None if self.draft is None else DraftModel(self.draft, self.draft_kv, self.draft_head_ids,
                                                           self.manifest.target.vocab_size)
        drafter = DRAFTERS[name].build(config, draft)
        adaptive = spec.adaptive if config.adaptive is None else config.adaptive
        if config.draft_tokens is not None and config.adaptive is None:
            adaptive = False  # an explicit k means "this k"
        costs = self._costs_for(name)
        if adaptive:
            max_k = max(spec.max_draft_tokens, config.draft_tokens or 0)
            alpha, observed = self._acceptance.get(name, (None, 0))
            controller = AdaptiveK(max_k, costs=costs, start_k=config.draft_tokens or spec.draft_tokens,
                                   acceptance=alpha, observed=observed)
        else:
            k = spec.draft_tokens if config.draft_tokens is None else config.draft_tokens
            controller = FixedK(k)
        return drafter, controller

    def _costs_for(self, drafter: str) -> CostModel:
        """The drafter's learned step costs, started from the measured profile so the first steps run the right k."""
        costs = self._profiles.get(drafter)
        if costs is None:
            costs = self._profiles[drafter] = (
                CostModel.from_dict(self.cost_profile, uses_draft_model=needs_draft_model(drafter))
                if self.cost_profile else CostModel())
        return costs

    def _check_not_reentered(self) -> None:
        if self._owner == threading.get_ident():
            # _lock is not reentrant: waiting here would hang this thread forever.
            raise SpecedgeError("this thread already has an unfinished generation on this Generator (a "
                                "stream() not yet exhausted or closed); finish, cancel() or close() it first: "
                                "a Generator runs one generation at a time")

    def forget_replies(self) -> None:
        """Forget what recent replies taught the adaptive controller (draft acceptance, reply
        lengths), e.g. when this Generator starts serving another kind of traffic. Measured
        step costs are kept: they belong to the machine, not to the text."""
        self._acceptance.clear()
        self.reply_lengths = ReplyLengths()

    def tune(self, *, save: bool = False, context: int = 128) -> dict:
        """Measure this machine's step costs (target 1..max_draft_tokens+1, draft 1) and use them.

        ``save=True`` records them in the bundle's manifest for later runs on this machine.
        """
        self._check_not_reentered()
        with self._lock:
            profile = step_costs.measure(self.target, self.draft, threads=self.threads, context=context,
                                           max_verify=self.manifest.speculation.max_draft_tokens + 1)
        self.cost_profile = profile
        self._profiles.clear()
        if save:
            cost_profile.save(self.bundle, profile)
        return profile

    # --------------------------------------------------------------------- generation
    def _config(self, config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
        config = config or GenerationConfig()
        if overrides:
            unknown = set(overrides) - set(GenerationConfig.__dataclass_fields__)
            if unknown:
                raise InvalidParameterError(f"unknown generation parameter(s) {sorted(unknown)}; known: "
                                            f"{', '.join(GenerationConfig.__dataclass_fields__)}")
            config = replace(config, **overrides)
        return config

    def _run(self, ids: list[int], config: GenerationConfig, stream: TextStream | None) -> Iterator[str]:
        """The one generation path behind generate() and stream(): yields text deltas.

        Called (not iterated) at the start of generate()/stream(), so drafter errors
        surface at the call; the body below runs on the first next().
        """
        drafter, controller = self._drafter_and_controller(config)
        return self._iterate(ids, config, stream, drafter, controller)

    def _iterate(self, ids, config: GenerationConfig, stream: TextStream | None, drafter, controller
                 ) -> Iterator[str]:
        rng = np.random.default_rng(config.seed)
        decoder = StreamDecoder(self.codec, config.stop)
        state = loop.LoopResult()
        result = GenerationResult("", [], "length", state.stats, ids)
        if stream is not None:
            stream.result = result
        self._check_not_reentered()
        pending: list[str] = []

        def on_block(tokens: list[int]) -> int | None:
            """Decode a block as it commits; a completed stop string ends the run inside it."""
            before = len(decoder.ids)
            delta = decoder.push(tokens)
            if delta:
                pending.append(delta)
            return None if decoder.stopped_at is None else decoder.stopped_at + 1 - before

        with self._lock:
            self._owner = threading.get_ident()
            blocks = loop.run(self.target, self.target_kv, np.asarray(ids, np.int64),
                              max_new_tokens=config.max_new_tokens, eos_token_ids=self.eos_token_ids,
                              sampling=config.sampling, rng=rng, drafter=drafter, controller=controller,
                              result=state, mode=config.mode, stop=on_block, near_tie=self.near_tie_gap,
                              max_latency_s=config.max_latency_s,
                              horizon=self.reply_lengths.expected_remaining,
                              costs=None if drafter is None else self._costs_for(drafter.name))
            try:
                for _ in blocks:
                    result.text = decoder.text
                    result.token_ids = list(state.tokens)
                    if pending:
                        yield "".join(pending)
                        pending.clear()
                    if stream is not None and stream.cancelled:
                        state.finish_reason = "cancelled"
                        break
            finally:
                self._owner = None
                blocks.close()
                tail = decoder.push([], final=True) if decoder.stopped_at is None else ""
                result.text = decoder.text
                result.token_ids = list(state.tokens)
                result.stats.new_tokens = len(state.tokens)
                reason = state.finish_reason or "cancelled"
                result.finish_reason = {"context": "length", "stop_string": "stop"}.get(reason, reason)
                if reason == "context":
                    result.message = (f"reached max_context ({self.max_context} tokens: prompt "
                                      f"{len(ids)} + {len(state.tokens)} generated)")
                if controller is not None:
                    learned = controller.snapshot()
                    result.stats.mode_s = dict(learned.mode_s)
                    result.stats.catchup_deferred = learned.catchup_deferred
                    if learned.observed:  # keyed like _profiles: the drafter's name
                        self._acceptance[drafter.name] = (list(learned.acceptance), learned.observed)
                if reason != "cancelled":
                    self.reply_lengths.record(len(state.tokens), finished=reason in ("stop", "stop_string"))
        if tail:
            yield tail

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 input_ids: Sequence[int] | None = None, config: GenerationConfig | None = None,
                 **overrides) -> GenerationResult:
        """Generate a completion. Keyword overrides are GenerationConfig fields
        (``max_new_tokens=64, temperature=0.7, draft_tokens=4, drafter="ngram"``...)."""
        config = self._config(config, overrides)
        ids = self.encode_prompt(prompt, messages=messages, input_ids=input_ids, chat=config.chat,
                                 allow_special_tokens=config.allow_special_tokens)
        stream = TextStream(iter(()))
        for _ in self._run(ids, config, stream):
            pass
        return stream.result

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               input_ids: Sequence[int] | None = None, config: GenerationConfig | None = None,
               callback: Callable[[str], None] | None = None, **overrides) -> TextStream:
        """Yield text deltas as blocks commit. ``stream.result`` holds the GenerationResult
        once the iterator is exhausted; ``stream.cancel()`` stops at the next block boundary.
        With ``callback``, runs to completion calling it with each delta and returns the stream."""
        config = self._config(config, overrides)
        ids = self.encode_prompt(prompt, messages=messages, input_ids=input_ids, chat=config.chat,
                                 allow_special_tokens=config.allow_special_tokens)
        stream = TextStream(iter(()))
        stream._deltas = self._run(ids, config, stream)
        if callback is not None:
            for delta in stream:
                callback(delta)
        return stream

    def warmup(self, *, tune: bool = True) -> None:
        """Run every session once (prefill, step, verify shapes) so the first request pays no setup.

        With ``tune`` and no usable cost profile for this machine, also measure one (seconds).
        """
        k = self.manifest.speculation.max_draft_tokens
        ids = [int(t) % self.manifest.target.vocab_size for t in range(min(k + 1, self.max_context - k - 2))]
        for engine, cache in ((self.target, self.target_kv), (self.draft, self.draft_kv)):
            if engine is None:
                continue
            cache.reset()
            engine.forward(np.asarray(ids, np.int64), cache, 1)
            engine.forward(np.asarray(ids[:1], np.int64), cache, 1)
            engine.forward(np.asarray(ids[: k + 1], np.int64), cache, k + 1)
            cache.reset()
        if tune and self.cost_profile is None:
            self.tune()

