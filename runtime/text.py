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

import itertools
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

        How: every control-token string inside a message (content or role) is swapped for a
        placeholder ``D<i>D`` before rendering, where ``D`` is a delimiter that occurs nowhere in
        the input (:func:`_delimiter`). The rendered text is then cut at the control tokens the
        template wrote (encoded as those tokens); the text between them, with the user's
        control-token text put back, is encoded with special-token matching off. The cut is
        checked: the hidden rendering with every placeholder put back must equal the rendering
        of the original messages (a template that rewrites message text is refused with
        InvalidParameterError). Without such text in any message this is exactly
        ``encode(render_chat(messages))``.
        """
        messages = _checked_messages(messages)
        if allow_special_tokens or self._special_re is None or \
                not any(self._special_re.search(m["content"]) or self._special_re.search(m["role"])
                        for m in messages):
            return self.encode(self._render(messages, add_generation_prompt))
        original = self._render(messages, add_generation_prompt)
        mark = _delimiter([self.chat_template or "", original, *(m["content"] for m in messages),
                           *(m["role"] for m in messages)])
        found: list[str] = []

        def hide(match: re.Match) -> str:
            found.append(match.group(0))
            return f"{mark}{len(found) - 1}{mark}"

        hidden = [{**m, "role": self._special_re.sub(hide, m["role"]),
                   "content": self._special_re.sub(hide, m["content"])} for m in messages]
        parts = re.split(f"{re.escape(mark)}([0-9]+){re.escape(mark)}", self._render(hidden, add_generation_prompt))
        # The check that makes the cut trustworthy: every placeholder came back whole (no stray
        # delimiter, no index the messages did not produce) and putting the user's text back
        # gives exactly what the template renders from the original messages.
        if any(mark in part for part in parts[::2]) or any(int(i) >= len(found) for i in parts[1::2]) or \
                "".join(found[int(p)] if i % 2 else p for i, p in enumerate(parts)) != original:
            raise InvalidParameterError(
                "messages hold control-token text (such as " + repr(found[0]) + ") and this bundle's chat template "
                "does not copy message text verbatim, so it cannot be encoded as plain text; remove it from the "
                "messages, or pass allow_special_tokens to read it as markup")
        ids: list[int] = []
        text: list[str] = []  # plain text since the last control token the template wrote

        def flush() -> None:
            if text:
                ids.extend(self._plain().encode("".join(text), add_special_tokens=False).ids)
                text.clear()

        for i, part in enumerate(parts):
            if i % 2:  # a placeholder: the user's control-token text, as text
                text.append(found[int(part)])
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


# The delimiter's alphabet: Unicode's private use area (U+E000..U+F8FF), which no tokenizer's
# markup uses. U+E000 opens it and U+E001 closes it; the n characters between come from the rest.
_OPEN, _CLOSE, _INNER = "\ue000", "\ue001", range(0xE002, 0xF900)


def _delimiter(texts: Sequence[str]) -> str:
    """A string that occurs in none of ``texts``: U+E000, n characters of U+E002..U+F8FF, U+E001.

    It cannot run out: n is the smallest with more candidates (6398**n) than ``texts`` hold
    characters, so more candidates exist than the texts hold U+E000s, and each U+E000 rules out at
    most one candidate (the n characters after it). The first candidate not ruled out is taken
    (deterministic; O(total length)). The delimiter is border-free (no proper prefix equals a
    suffix: only its first character is U+E000), so two occurrences never overlap: text next to a
    placed delimiter cannot complete another one that shares characters with it.
    """
    total = sum(len(t) for t in texts)
    n = 1
    while len(_INNER) ** n <= total:
        n += 1
    taken = set()
    for text in texts:
        start = text.find(_OPEN)
        while start >= 0:
            taken.add(text[start + 1:start + 1 + n])
            start = text.find(_OPEN, start + 1)
    for inner in itertools.product(map(chr, _INNER), repeat=n):  # at most len(taken) + 1 steps
        candidate = "".join(inner)
        if candidate not in taken:
            return _OPEN + candidate + _CLOSE
    raise AssertionError("unreachable: there are more candidates than texts' characters")


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
