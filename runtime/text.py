"""Tokenizer, chat template and incremental detokenisation (no transformers).

Chat templates come from model files, so they are rendered in Jinja's immutable
sandbox under time and size budgets (runtime/chat_template.py).

Special tokens: control tokens (``<|im_start|>``, ``<|im_end|>``, ``</s>``...) in a chat
prompt come only from the template's own markup. Text inside a message that spells a
control token is encoded as ordinary text, as the OpenAI API does, so a user cannot close
their turn and open a system one by typing its markup. ``allow_special_tokens=True`` opts
out, for callers who build control sequences on purpose.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from ..errors import BundleError, InvalidParameterError
from .chat_template import ChatTemplate


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
        self._template: ChatTemplate | None = None
        # Control tokens (added tokens marked special), longest first so that a regex
        # alternation prefers "<|im_start|>" over a special that is a prefix of it.
        specials = sorted({t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                           if t.special and t.content}, key=len, reverse=True)
        self._specials = specials
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain_tokenizer = None  # a copy that reads control-token text as text (built when first needed)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _bos(self, ids: list[int]) -> list[int]:
        """Prepend BOS when the bundle records that the model wants one and it is not there."""
        if self.add_bos_token and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of text written as markup: control-token text becomes control tokens.

        For raw prompts (the caller writes the whole prompt, markup included) and the
        rendered chat template. User content goes through :meth:`encode_chat`.
        """
        _check_text(text, "prompt")
        return self._bos(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _plain(self):
        """A second tokenizer that encodes control-token text as ordinary text (split_special_tokens).

        A copy, not a toggle on the shared one: another thread may be encoding with it.
        """
        if self._plain_tokenizer is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain_tokenizer = plain
        return self._plain_tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Apply the bundle's chat template to OpenAI-style ``[{"role", "content"}]`` messages."""
        return self._render(_checked_messages(messages), add_generation_prompt)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not self.chat_template:
            raise InvalidParameterError("this bundle has no chat template; pass a plain prompt with chat=False")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        chars = sum(len(m["role"]) + len(m["content"]) for m in messages)
        return self._template.render(input_chars=chars, messages=messages,
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], *, allow_special_tokens: bool = False,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; control tokens only from the template's markup.

        How: every control-token string inside a message is swapped for a placeholder
        before rendering. The rendered text is then cut at the control tokens the template
        wrote (encoded as those tokens); the text between them, with the user's
        control-token text put back, is encoded with special-token matching off. Without
        such text in any message this is exactly ``encode(render_chat(messages))``.
        """
        messages = _checked_messages(messages)
        if allow_special_tokens or self._special_re is None or \
                not any(self._special_re.search(m["content"]) for m in messages):
            return self.encode(self._render(messages, add_generation_prompt))
        # A placeholder delimiter that occurs in no message and not in the template.
        taken = set(self.chat_template or "").union(*(m["content"] for m in messages))
        mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in taken)
        found: list[str] = []

        def hide(match: re.Match) -> str:
            found.append(match.group(0))
            return f"{mark}{len(found) - 1}{mark}"

        hidden = [{**m, "content": self._special_re.sub(hide, m["content"])} for m in messages]
        rendered = self._render(hidden, add_generation_prompt)
        ids: list[int] = []
        text: list[str] = []  # plain text since the last control token the template wrote

        def flush() -> None:
            if text:
                ids.extend(self._plain().encode("".join(text), add_special_tokens=False).ids)
                text.clear()

        for i, part in enumerate(re.split(f"{mark}(\\d+){mark}", rendered)):
            if i % 2:  # a placeholder: the user's control-token text, as text
                text.append(found[int(part)] if int(part) < len(found) else part)
                continue
            pos = 0
            for match in self._special_re.finditer(part):  # the template's own control tokens
                text.append(part[pos:match.start()])
                flush()
                ids.append(self.tokenizer.token_to_id(match.group(0)))
                pos = match.end()
            text.append(part[pos:])
        flush()
        return self._bos(ids)


def _check_text(text: str, what: str) -> None:
    """Refuse text no tokenizer can take: lone surrogates (from JSON "\\ud800" or bad decoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameterError(f"{what} is not valid Unicode text: {exc.reason} at character {exc.start}") \
            from None


def _checked_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidParameterError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidParameterError(f"messages[{i}] must be an object with string 'role' and 'content'")
        _check_text(m["role"], f"messages[{i}].role")
        _check_text(m["content"], f"messages[{i}].content")
    return list(messages)


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
