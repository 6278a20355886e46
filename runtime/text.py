"""Tokenizer, chat template and incremental detokenisation (no transformers).

Chat templates come from model files, so they are rendered in Jinja's immutable
sandbox: a template can format strings but cannot reach Python internals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..errors import BundleError, InvalidParameterError


class TextCodec:
    """tokenizer.json + chat template of a bundle."""

    def __init__(self, tokenizer_path: Path, chat_template: str | None, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos_token: bool = False) -> None:
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise BundleError(f"cannot read tokenizer {tokenizer_path.name}: {exc}") from None
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text. The bundle records whether the model wants a BOS first."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Apply the bundle's chat template to OpenAI-style ``[{"role", "content"}]`` messages."""
        if not self.chat_template:
            raise InvalidParameterError("this bundle has no chat template; pass a plain prompt with chat=False")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidParameterError(f"messages[{i}] must be an object with string 'role' and 'content'")
        from jinja2.exceptions import TemplateError

        try:
            if self._template is None:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                def raise_exception(message: str):
                    raise TemplateError(message)

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = raise_exception
                env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                    x, indent=indent, ensure_ascii=ensure_ascii)
                self._template = env.from_string(self.chat_template)
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as exc:  # includes the template's own raise_exception("roles must alternate")
            raise InvalidParameterError(f"the chat template rejected these messages: {exc}") from None
        except RecursionError:  # a template macro that calls itself: the bundle's fault, not the messages'
            raise BundleError("the bundle's chat template recurses without end; fix or re-export the bundle") from None


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, holding back what is not final.

    Held back: a trailing partial UTF-8 character (decodes to U+FFFD), and any tail that
    could still grow into a stop string, so that nothing past a stop is ever emitted.

    Decoding is incremental (the prefix/read offset scheme of streaming servers): each
    push decodes only the tokens since the last stable point plus a few before it, so a
    long reply costs O(block) per block, not O(reply).
    """

    # Tokens decoded before the new ones: SentencePiece-style decoders drop a leading
    # space at the start of a decode, so the diff is taken against a short prefix.
    _CONTEXT_TOKENS = 4

    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded text so far (up to a stop, once one is found)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped_at: int | None = None  # index in self.ids of the token that completed a stop string
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of self.text that is final
        self._read = 0

    def _decode_new(self) -> None:
        """Extend self.text with the newly decodable text of ids[_read:]."""
        prefix_text = self.codec.decode(self.ids[self._prefix:self._read])
        new_text = self.codec.decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix = max(self._prefix, len(self.ids) - self._CONTEXT_TOKENS)
            self._read = len(self.ids)

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        """Add committed tokens; return the text that is now safe to emit."""
        if self.stopped_at is not None:
            return ""
        start_chars = len(self.text)
        self.ids.extend(int(t) for t in tokens)
        self._decode_new()
        if final and self._read < len(self.ids):  # flush a trailing partial character as-is
            prefix_text = self.codec.decode(self.ids[self._prefix:self._read])
            self.text += self.codec.decode(self.ids[self._prefix:])[len(prefix_text):]
            self._read = len(self.ids)
        if self.stop:
            search_from = max(0, min(self.emitted, start_chars) - self._hold)
            hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                cut = min(hits)
                self.text = self.text[:cut]
                self.stopped_at = self._token_index_for_chars(cut)
                final = True
        safe = len(self.text) if final else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return delta

    def _token_index_for_chars(self, n_chars: int) -> int:
        """Index of the first token whose text reaches past ``n_chars`` (it completed the stop string).

        Decoded length grows with the number of tokens, so a binary search finds it in
        O(log n) decodes; this runs once, when a stop string is found.
        """
        lo, hi = 0, len(self.ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.codec.decode(self.ids[: mid + 1])) > n_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo
