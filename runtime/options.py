"""The one source of options: :class:`GenerationConfig` (per call), :class:`LoadConfig` (per
process: how a bundle is loaded) and what each field allows.

Every field carries an :class:`Option` (type, bounds, choices, help) in its dataclass
metadata. Both configs validate themselves from it; the CLI's click options
(``cli/options.py``: ``generate``, ``serve``, ``info``, ``eval``, ``tune`` and every bench
subcommand), the server's ``specedge`` request extension (``server/protocol.py``) and the
bench's configurations read the same metadata, so an option is written once, here, and its
bound is stated once.

This module sits below the loop and the drafters: the constants an option needs (the loop's
modes, the draft window) are defined here and imported by them, never the other way round.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..engines.base import PROVIDERS, EngineOptions
from ..errors import InvalidParameterError
from ..bundle.manifest import MAX_CONTEXT, MAX_DRAFT_TOKENS
from .drafters import DRAFTER_CHOICES, DRAFTERS, NO_DRAFTER
from .sampling import SamplingConfig

# Each stop string is searched for after every committed block: bound the work per block.
MAX_STOP_STRINGS = 16
# A repeated phrase longer than 64 tokens is found by its last 64 tokens just as well, while the
# n-gram index keeps one dict per n and inserts into each for every committed token: without a
# bound, --max-ngram 10**9 built dicts until the process was killed (24 GB).
MAX_NGRAM = 64
# Past a minute per block a latency cap caps nothing a caller could notice.
MAX_LATENCY_S = 60.0
# OpenAI's range: above 2 the warped distribution is close to uniform noise over the vocabulary.
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1 << 20  # above any vocabulary: the cap is then no cap
MAX_CACHE_SALT_CHARS = 256  # a salt is an identifier (a hash, a tenant id), not a payload kept per slot
MAX_SEED = (1 << 63) - 1  # numpy's generators take any int, but a seed past int64 is a typo

# How the loop runs (runtime/loop.py): draft then verify, or verify while the next block is drafted.
MODES = ("sequential", "pipelined", "auto")
# The draft model's catch-up window (runtime/model_drafter.py): a stretch of history longer than
# this is bridged to the first 4 + the most recent tokens. Why 64: it holds the
# last user turn and the start of the reply, which is what a draft's next-token guess leans
# on, while a catch-up token costs about a third of a draft step (0.30-0.34 measured on a
# 2-core AVX2 EPYC), so 64 tokens cost ~20 draft steps where a 300-token prompt cost ~100.
# It is also the catch-up `specedge tune` times: the one a long prompt actually costs.
DEFAULT_DRAFT_WINDOW = 64
# Attention sinks: the first tokens of a sequence draw a large share of every head's
# attention (Xiao et al. 2023, StreamingLLM); a context that drops them degrades far
# more than one that drops the same number of middle tokens. 4 is their measured choice.
SINK_TOKENS = 4

# More threads than CPUs only contend for them (engines/base.py EngineOptions refuses them).
MAX_THREADS = os.cpu_count() or 1
# Conversations whose caches `specedge serve` keeps: a voice agent talks to a few callers at once,
# and each slot costs the target's and the draft's caches at max_context (`specedge info` prices them).
DEFAULT_CACHE_SLOTS = 4
MAX_CACHE_SLOTS = 256  # far past the callers one device serves at once: a larger count is a typo


@dataclass(frozen=True)
class Option:
    """What one GenerationConfig field accepts, and how the CLI and the server spell it."""

    help: str
    kind: type  # int, float, bool, str, or tuple (of str)
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, ...] rather than [low, ...]
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    nullable: bool = False  # None is allowed (the bundle's default, or "off")
    zero_is_none: bool = False  # the CLI and the server spell None as 0
    cli: tuple[str, ...] | None = ()  # click declarations; () = --name-with-dashes; None = not a CLI option
    invert: bool = False  # the CLI flag turns the (default True) field off: --no-speculation, --raw
    server: bool = False  # accepted in the server's "specedge" request extension
    max_items: int | None = None  # tuple fields: at most this many
    max_chars: int | None = None  # free-text str fields (no choices): at most this many characters


def option(default: Any, help: str, kind: type, **kw) -> Any:
    return field(default=default, metadata={"option": Option(help, kind, **kw)})


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def interval(opt: Option) -> str:
    """The option's bounds as an interval, e.g. ``[1, 64]`` or ``(0, 1]``."""
    low = "-inf" if opt.low is None else _number(opt.low)
    high = "inf" if opt.high is None else _number(opt.high)
    return f"{'(' if opt.low_open else '['}{low}, {high}{')' if opt.high_open else ']'}"


def _in_bounds(opt: Option, value: float) -> bool:
    if opt.low is not None and (value < opt.low or (opt.low_open and value == opt.low)):
        return False
    return opt.high is None or not (value > opt.high or (opt.high_open and value == opt.high))


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (e.g. from undecodable bytes): not text
        return False
    return True


def check(name: str, value: Any, *, where: str | None = None) -> Any:
    """Validate ``value`` for GenerationConfig (or LoadConfig) field ``name``; return it normalised (a
    stop string becomes a 1-tuple). Raises InvalidParameterError naming ``where`` (default: the field)."""
    opt = OPTIONS[name] if name in OPTIONS else LOAD_OPTIONS[name]
    where = where or name
    none = " or None" if opt.nullable else ""
    if value is None:
        if opt.nullable:
            return None
        raise InvalidParameterError(f"{where} must not be None")
    if opt.kind is bool:
        if not isinstance(value, bool):
            raise InvalidParameterError(f"{where} must be true or false (a bool){none}; got {value!r}")
    elif opt.kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not _in_bounds(opt, value):
            raise InvalidParameterError(f"{where} must be an integer in {interval(opt)}{none}; got {value!r}")
        value = int(value)
    elif opt.kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                or not _in_bounds(opt, value):
            raise InvalidParameterError(f"{where} must be a number in {interval(opt)}{none}; got {value!r}")
    elif opt.kind is str and opt.choices is None:  # free text (cache_salt)
        if not isinstance(value, str) or not value or not _valid_text(value):
            raise InvalidParameterError(f"{where} must be a non-empty string{none}; got {value!r}")
        if len(value) > opt.max_chars:
            raise InvalidParameterError(f"{where} holds {len(value)} characters; at most {opt.max_chars} are allowed")
    elif opt.kind is str:
        if not isinstance(value, str) or value not in opt.choices:
            raise InvalidParameterError(f"{where} must be one of {', '.join(opt.choices)}{none}; got {value!r}")
    elif opt.kind is tuple:
        value = (value,) if isinstance(value, str) else value
        if not isinstance(value, (tuple, list)) or not all(isinstance(s, str) and s for s in value):
            raise InvalidParameterError(f"{where} must be a string or a list of non-empty strings; got {value!r}")
        if len(value) > opt.max_items:
            raise InvalidParameterError(f"{where} holds {len(value)} strings; at most {opt.max_items} are allowed")
        if not all(_valid_text(s) for s in value):
            raise InvalidParameterError(f"{where} holds a string that is not valid text (a lone surrogate: "
                                        "undecodable bytes?)")
        value = tuple(value)
    return value


@dataclass(frozen=True)
class GenerationConfig:
    """Per-call settings. ``None`` means "the bundle's default"."""

    max_new_tokens: int = option(128, "Tokens to generate.", int, low=1, high=MAX_CONTEXT)
    temperature: float = option(0.0, "0 = greedy.", float, low=0.0, high=MAX_TEMPERATURE)
    top_k: int = option(0, "0 = off.", int, low=0, high=MAX_TOP_K)
    top_p: float = option(1.0, "1 = off.", float, low=0.0, high=1.0, low_open=True)
    seed: int | None = option(None, "Sampling seed.", int, low=0, high=MAX_SEED, nullable=True)
    stop: tuple[str, ...] = option((), "Stop string (repeatable); the text ends before the first one.", tuple,
                                   max_items=MAX_STOP_STRINGS)
    speculation: bool = option(True, "Plain decoding (the baseline).", bool, cli=("--no-speculation",),
                               invert=True, server=True)
    drafter: str | None = option(None, "Override the bundle's drafter: " + "; ".join(
        [f"{NO_DRAFTER} = plain decoding"] + [f"{n} = {d.help}" for n, d in DRAFTERS.items()]) + ".", str,
        choices=DRAFTER_CHOICES,
                                 nullable=True, server=True)
    draft_tokens: int | None = option(
        None, "Fixed draft length k (default: adaptive, which may choose 0 = no speculation).", int, low=0,
        high=MAX_DRAFT_TOKENS, nullable=True, cli=("--draft-tokens", "-k"), server=True)
    adaptive: bool | None = option(None, "Let the cost model choose k per step.", bool, nullable=True,
                                   cli=("--adaptive/--no-adaptive",))
    p_min: float = option(0.0, "Stop drafting when the draft's top probability is below this.", float, low=0.0,
                          high=1.0, high_open=True)
    max_ngram: int = option(3, "n-gram drafter: longest suffix to match.", int, low=1, high=MAX_NGRAM)
    # 2, not 1: a single repeated token predicts the next one badly (measured acceptance 0.0-0.2 on
    # chat and voice replies), below the break-even v(2) - 1 = 0.1-0.35 of a verify step, so 1-token
    # matches only slowed decoding down.
    min_ngram: int = option(2, "n-gram drafter: shortest repeated suffix that may propose (1-token matches "
                            "rarely predict the next token).", int, low=1, high=MAX_NGRAM)
    chat: bool = option(True, "Do not apply the chat template.", bool, cli=("--raw",), invert=True)
    # Control-token text inside chat messages ("<|im_end|>") becomes control tokens. Off: it is
    # encoded as plain text, as the OpenAI API does, so user text cannot forge a system turn.
    allow_special_tokens: bool = option(False, "Encode control-token text in messages as control tokens "
                                        "(off: as plain text, as the OpenAI API does).", bool, server=True)
    mode: str = option("sequential", "pipelined = verify-while-draft (draft and target run at once); auto = "
                       "measure both and use the faster.", str, choices=MODES)
    max_latency_s: float | None = option(
        None, "Cap the draft length so each block commits within this many seconds (steady streaming for "
        "voice agents).", float, low=0.0, low_open=True, high=MAX_LATENCY_S, nullable=True,
        cli=("--max-latency",), server=True)
    draft_window: int | None = option(
        DEFAULT_DRAFT_WINDOW, "Most unseen tokens the draft model reads at once (its prompt prefill): longer "
        f"history is bridged to its first {SINK_TOKENS} + most recent tokens, so a long prompt costs "
        "the draft little. Output is unchanged; only acceptance can drop. 0 = read everything.", int,
        low=SINK_TOKENS, low_open=True, high=MAX_CONTEXT, nullable=True, zero_is_none=True,
        server=True)
    # A conversation's next call reuses the K/V its slot holds for the longest common prefix
    # (runtime/slots.py): the reply is the cold reply, only its prefill is shorter.
    reuse_prefix: bool = option(True, "Prefill the whole prompt even when a conversation slot holds its "
                                "beginning (the cold-start baseline).", bool, cli=("--no-prefix-reuse",),
                                invert=True, server=True)
    # The suffix drafter also drafts from this Generator's earlier replies (per server, shared by
    # every conversation): speed only, the tokens are unchanged. Off: it neither reads nor records them.
    reply_memory: bool = option(True, "Do not draft from (or remember) earlier replies (the suffix drafter's "
                                "cross-reply memory).", bool, cli=("--no-reply-memory",), invert=True, server=True)
    # Fast by default: plain steps run one row, as ONNX Runtime GenAI and llama.cpp run them. A verify
    # row then goes through other kernels than a 1-row step (a GEMM, not a GEMV), so greedy speculative
    # output may differ from plain decoding where the target's top-2 logits nearly tie (below the
    # bundle's near-tie gap, runtime/verify.py). Exact: every target forward runs >= 2 rows
    # (engines/invariant.py), plain steps and verify rows compute the same bits and greedy output
    # equals plain decoding token for token; its price is the second row of every plain step (a 2-row
    # step costs 1.2-1.4x a 1-row one on int4 CPU bundles, about 1.05x on fp32: 2-core AVX2 and
    # AVX-512 EPYCs, docs/results). Sampling keeps the target's distribution either way.
    exact: bool = option(False, "Token-identical greedy output: every plain step runs 2 rows so it takes the "
                         "verify's kernels (costs 1.2-1.4x a plain step on int4 CPU bundles, ~1.05x on fp32). "
                         "Off: 1-row plain steps; greedy speculation then equals plain decoding up to near "
                         "ties of the target's top-2 logits.", bool, server=True)
    # Conversation slots (runtime/slots.py) written under one salt are never reused, not even their
    # prefix, by a call with another, so neither reused_tokens nor timing tells one tenant what another
    # sent. None is one namespace too. vLLM's request field; the server sends it top-level.
    cache_salt: str | None = option(None, "Only calls with the same cache salt share cached prompt prefixes.",
                                    str, nullable=True, cli=None, max_chars=MAX_CACHE_SALT_CHARS)

    def __post_init__(self) -> None:
        for name in OPTIONS:
            value = check(name, getattr(self, name))
            if value is not getattr(self, name):
                object.__setattr__(self, name, value)
        if self.min_ngram > self.max_ngram:
            raise InvalidParameterError(f"n-gram sizes need 1 <= min_ngram <= max_ngram; got "
                                        f"{self.min_ngram}, {self.max_ngram}")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(GenerationConfig)}


@dataclass(frozen=True)
class LoadConfig:
    """Per-process settings: how a bundle's sessions are made and how many conversations they keep.
    The CLI's ``generate``, ``serve``, ``info``, ``eval``, ``tune`` and the bench read them from here."""

    # The upper bound is this machine's CPU count; EngineOptions states the rule and its message.
    threads: int = option(0, "Intra-op threads per ONNX Runtime session (0 = ORT default; at most this machine's "
                          "CPU count).", int, low=0, high=MAX_THREADS)
    provider: str = option("cpu", "Execution provider (cuda/tensorrt need onnxruntime-gpu; `specedge doctor` says "
                           "which load).", str, choices=PROVIDERS)
    verify_checksums: bool = option(True, "Skip sha256 checks of bundle files at load.", bool,
                                    cli=("--no-verify-checksums",), invert=True)
    cache_slots: int = option(DEFAULT_CACHE_SLOTS, "Conversations whose KV caches are kept between requests "
                              "(`specedge info` prices them); a request continuing one prefills only its new "
                              "tokens, and a new one copies the prefix another holds, such as the system prompt "
                              "(least recently used evicted first).", int, low=1, high=MAX_CACHE_SLOTS)

    def __post_init__(self) -> None:
        self.engine_options()  # the thread count first, refused with the engines' own message
        for name in LOAD_OPTIONS:
            check(name, getattr(self, name))

    def engine_options(self) -> EngineOptions:
        return EngineOptions(provider=self.provider, intra_op_threads=self.threads)


LOAD_OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(LoadConfig)}
