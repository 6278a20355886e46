"""Tokenizer parity, checked at export: the bundle encodes text as the source's own tokenizer does.

Graph validation compares ONNX Runtime with PyTorch on given token ids, so it cannot see a prompt
encoded wrongly. And the rules that decide a prompt's first token live in metadata that a
conversion can drop: a Gemma 3 GGUF says ``tokenizer.ggml.add_bos_token = True``, its dequantized
copy's ``tokenizer_config.json`` leaves the flag unset, and Gemma prompted without ``<bos>``
answers garbage. So export encodes a fixed set of texts and conversations twice and requires
equal ids:

- with the bundle's tokenizer, through the runtime's own TextCodec (runtime/loading.load_codec,
  the object ``specedge generate`` encodes with): ``encode(text)`` for a raw prompt,
  ``encode_chat(messages)`` for a chat;
- with the source's tokenizer as transformers builds it from the checkpoint folder or the GGUF
  file itself (``gguf_file=``): ``encode(text)`` (special tokens added, the reference for a raw
  prompt) and ``apply_chat_template(..., tokenize=True, add_generation_prompt=True)``.

The bundle's special-token rule (``add_bos_token``) is not read from any flag: it is what the
source tokenizer does, probed by encoding a text with and without special tokens. That covers
flags, GGUF metadata and tokenizer.json post-processors alike, and an unset flag cannot turn
into "no BOS" on the way.

Two differences are deliberate and kept out of the texts: TextCodec does not prepend a BOS to a
raw prompt that already starts with one (transformers doubles it), and ``encode_chat`` encodes
control-token text inside a message as plain text (runtime/text.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import ExportError, TokenizerParityError

# Raw prompts: plain prose and code, leading/trailing/multiple spaces, tabs and newlines, accented
# letters, CJK, an emoji (byte fallback in sentencepiece vocabularies), and digits.
TEXTS = (
    "The three primary colors of light are",
    "def add(a, b):\n    return a + b\n",
    "Hello, world!",
    " leading space",
    "  two leading spaces and  two inside",
    "trailing space ",
    "\tTabbed\n\nparagraph\r\nline",
    "naïve café — Größe, 日本語のテキスト, 🙂 Ωmega",
    "3.14159 x 2 = 6.28318; 2025-12-06",
)
# Chat conversations (no control-token text: encode_chat reads it as plain text on purpose).
CONVERSATIONS = (
    ({"role": "user", "content": "Hello!"},),
    ({"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": " And times three? Answer in 日本語."}),
    ({"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}),
)
_CONTROL_TOKENS = 4  # control tokens spelled inside raw texts (the ones with the lowest ids)
_VOCAB_WORDS = 24  # ordinary tokens spread over the vocabulary, decoded into one more text
_SHOWN_CHARS = 80  # of a text, in an error message


@dataclass(frozen=True)
class ParityReport:
    """What the check compared: raw texts and chat conversations, all with equal ids."""

    texts: int
    conversations: int
    add_bos_token: bool


def source_tokenizer(loaded) -> Any:
    """transformers' tokenizer for the checkpoint ``loaded`` (export/loader.LoadedModel) came from.

    An HF folder's tokenizer is the one the loader built from it. A GGUF file's is built again
    from the file (``gguf_file=``), not from its dequantized copy: that copy is what the bundle
    ships, and the file's ``tokenizer.ggml.*`` metadata is the source of truth it is checked by.
    """
    origin = loaded.origin
    if origin is None or not Path(origin).is_file():
        return loaded.tokenizer
    from transformers import AutoTokenizer

    origin = Path(origin)
    try:
        return AutoTokenizer.from_pretrained(str(origin.parent), gguf_file=origin.name, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"transformers could not build the tokenizer of {origin.name}: {exc}") from None


def added_bos(tokenizer: Any) -> bool:
    """Whether transformers' ``encode(text)`` puts the BOS token before a text's own ids.

    Probed, not read from ``add_bos_token``: an unset flag, a GGUF flag and a tokenizer.json
    post-processor all show here as what they do. The runtime can prepend the BOS token and
    nothing else, so any other added token is refused by name.
    """
    probes = []  # (prefix, suffix) around a probe text's own ids
    for probe in ("x", "Hello world"):
        full = list(tokenizer(probe).input_ids)
        bare = list(tokenizer(probe, add_special_tokens=False).input_ids)
        if not bare:  # a vocabulary without this text (a word-level one, a BPE without merges)
            continue
        start = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if start is None:
            raise TokenizerParityError(
                f"the source tokenizer's special tokens change the text's own tokens ({probe!r}: {full} with "
                f"special tokens, {bare} without); specedge's runtime only prepends a BOS token")
        probes.append((full[:start], full[start + len(bare):]))
    if not probes:  # nothing encodes: what the empty text gets is all added, taken as a prefix
        probes.append((list(tokenizer("").input_ids), []))
    for prefix, suffix in probes:
        if suffix:
            raise TokenizerParityError(
                f"the source tokenizer appends {_pieces(tokenizer, suffix)} to every text (add_eos_token or a "
                "post-processor); specedge's runtime only prepends a BOS token")
        if prefix not in ([], [tokenizer.bos_token_id]):
            raise TokenizerParityError(
                f"the source tokenizer prepends {_pieces(tokenizer, prefix)} to every text, not its BOS token "
                f"{tokenizer.bos_token!r}; specedge's runtime only prepends the BOS token")
    added = {bool(prefix) for prefix, _ in probes}
    if len(added) > 1:
        raise TokenizerParityError("the source tokenizer prepends its BOS token to some texts and not others")
    return added.pop()


def check_parity(codec, reference: Any, add_bos_token: bool) -> ParityReport:
    """Encode every text and conversation with ``codec`` (runtime.text.TextCodec, the bundle's) and
    with ``reference`` (the source's transformers tokenizer); raise TokenizerParityError at the
    first one whose ids differ, naming it and the first differing token."""
    texts = list(TEXTS) + _control_texts(reference) + _vocab_text(reference)
    for text in texts:
        _compare(codec, reference, f"text {_show(text)}", codec.encode(text), list(reference.encode(text)))
    if bool(codec.chat_template) != bool(reference.chat_template):
        where = "the bundle" if codec.chat_template else "the source tokenizer"
        raise TokenizerParityError(f"only {where} has a chat template")
    compared = 0
    if reference.chat_template:
        for conversation in CONVERSATIONS:
            messages = [dict(m) for m in conversation]
            try:
                theirs = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                       return_dict=False)
            except Exception:  # noqa: BLE001 - a template may refuse a conversation (e.g. a system role): skip it
                continue
            what = f"chat {[m['role'] for m in messages]} (last message {_show(messages[-1]['content'])})"
            _compare(codec, reference, what, codec.encode_chat(messages), list(theirs))
            compared += 1
    return ParityReport(texts=len(texts), conversations=compared, add_bos_token=add_bos_token)


def _control_texts(reference: Any) -> list[str]:
    """Raw texts that spell control tokens (not first: a leading BOS is deliberately not doubled)."""
    specials = {t.content: i for i, t in reference.added_tokens_decoder.items() if t.special and t.content}
    chosen = sorted(specials, key=specials.get)[:_CONTROL_TOKENS]
    return [f"Question {token} answer" for token in chosen] + [f"x{''.join(chosen)}y"] * bool(chosen)


def _vocab_text(reference: Any) -> list[str]:
    """One text decoded from ordinary tokens spread over the vocabulary (exercises the vocabulary
    itself, e.g. a word-level one that maps every text above to its unknown token)."""
    special = set(reference.all_special_ids) | set(reference.added_tokens_decoder)
    size = len(reference)
    step = max(1, size // _VOCAB_WORDS)
    ids = [i for i in range(0, size, step) if i not in special][:_VOCAB_WORDS]
    text = reference.decode(ids) if ids else ""
    return [text] if text.strip() else []


def _compare(codec, reference: Any, what: str, ours: Sequence[int], theirs: Sequence[int]) -> None:
    ours, theirs = [int(i) for i in ours], [int(i) for i in theirs]
    if ours == theirs:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

    def token(ids: list[int], tok) -> str:
        if i >= len(ids):
            return "(end)"
        return f"{ids[i]} {tok(ids[i])!r}"

    raise TokenizerParityError(
        f"tokenizer parity: the bundle encodes {what} differently from the source's own tokenizer: first "
        f"difference at token {i}: ours {token(ours, codec.tokenizer.id_to_token)} vs source "
        f"{token(theirs, reference.convert_ids_to_tokens)} ({len(ours)} vs {len(theirs)} tokens)")


def _pieces(tokenizer: Any, ids: list[int]) -> str:
    return ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in ids)


def _show(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")
