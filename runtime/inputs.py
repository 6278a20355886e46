"""Input checks for a Generator call: the prompt (text, chat messages or token ids) encoded and
bounded, the config resolved from keyword overrides, exact mode checked against the bundle.

Everything here runs before the Generator's lock is taken and before a session runs, so a bad
call fails fast with :class:`InvalidParameterError` (or :class:`ContextOverflowError`) and its
message, and leaves every cache untouched.
"""

from __future__ import annotations

import numbers
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..bundle.manifest import Manifest
from ..errors import ContextOverflowError, InvalidParameterError
from .options import GenerationConfig
from .text import TextCodec


def encode_prompt(codec: TextCodec, *, vocab_size: int, max_context: int, prompt: str | None = None,
                  messages: list[dict] | None = None, input_ids: Sequence[int] | None = None, chat: bool = True,
                  allow_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids (a list of n ints in [0, vocab_size), 1 <= n < max_context).

    Exactly one of ``prompt`` (text; wrapped in the chat template when ``chat`` and the bundle has
    one), ``messages`` (chat messages) or ``input_ids`` (token ids, checked against the vocabulary).
    """
    given = sum(x is not None for x in (prompt, messages, input_ids))
    if given != 1:
        raise InvalidParameterError("pass exactly one of prompt, messages or input_ids")
    if input_ids is not None:
        ids = token_ids(input_ids, vocab_size)
    elif messages is not None:
        ids = codec.encode_chat(messages, allow_special_tokens=allow_special_tokens)
    else:
        if not isinstance(prompt, str):
            raise InvalidParameterError(f"prompt must be a string; got {type(prompt).__name__}")
        if chat and codec.chat_template:
            ids = codec.encode_chat([{"role": "user", "content": prompt}], allow_special_tokens=allow_special_tokens)
        else:
            ids = codec.encode(prompt)
    if not ids:
        raise InvalidParameterError("the prompt is empty: it encodes to no tokens")
    if len(ids) >= max_context:
        raise ContextOverflowError(f"prompt is {len(ids)} tokens but max_context is {max_context}; "
                                   "shorten it or re-export with a larger --max-context")
    return ids


def token_ids(input_ids: Sequence[int], vocab_size: int) -> list[int]:
    """``input_ids`` (a sequence or 1-D array of integers, bools refused) as a list of ints, each in
    [0, vocab_size)."""
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence) and \
            not isinstance(input_ids, np.ndarray):
        raise InvalidParameterError(f"input_ids must be a list of token ids; got {type(input_ids).__name__}")
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in input_ids):
        bad = next(t for t in input_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool))
        raise InvalidParameterError(f"input_ids must hold integers (token ids); got {bad!r}")
    ids = [int(t) for t in input_ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError(f"input_ids holds ids outside [0, {vocab_size}): {bad[:5]}")
    return ids


def check_prefix_room(ids: Sequence[int], max_context: int) -> None:
    """A prefix filled ahead of a request (prefill, a saved prompt cache) must leave the request
    room for at least one more token."""
    if len(ids) >= max_context:
        raise ContextOverflowError(f"prompt of {len(ids)} tokens leaves no room in max_context {max_context}")


def resolve_config(config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    """``config`` (default: ``GenerationConfig()``) with keyword ``overrides`` applied; an override
    that names no GenerationConfig field is refused with the list of known ones."""
    if config is None:
        config = GenerationConfig()
    elif not isinstance(config, GenerationConfig):
        raise InvalidParameterError(f"config must be a GenerationConfig; got {type(config).__name__}")
    if overrides:
        unknown = set(overrides) - set(GenerationConfig.__dataclass_fields__)
        if unknown:
            raise InvalidParameterError(f"unknown generation parameter(s) {sorted(unknown)}; known: "
                                        f"{', '.join(GenerationConfig.__dataclass_fields__)}")
        config = replace(config, **overrides)
    return config


def check_exact(manifest: Manifest) -> None:
    """Exact mode needs a target whose 2-row plain steps equal its verify rows bit for bit; export
    checks that on its machine (``extra.exact_steps``). A target recorded without it is refused by
    name rather than silently losing the guarantee (older bundles without the record run)."""
    record = manifest.extra.exact_steps.get("target")
    if record is not None and not record.bit_identical:
        raise InvalidParameterError(
            "exact=True: this bundle's target is not row-invariant (on the machine it was exported on, its "
            "2-row plain steps differed from verify rows: manifest extra.exact_steps.target.bit_identical is "
            "false), so exact mode could not keep greedy output token-identical to plain decoding. Re-export "
            "with `specedge export --exact` (the row-invariant layout: int4 block 32, and with --tune only a "
            "layout measured invariant), or run without exact")
