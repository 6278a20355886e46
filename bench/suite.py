"""The prompt suite shipped in ``bench/prompts/suite.json``: loading, checking, selecting.

Each prompt has an ``id``, a ``category`` (one of CATEGORIES), a ``source`` and
either ``prompt`` (a string; ``chat: false`` means a raw completion, no chat
template) or ``messages`` (OpenAI-style role/content list). A prompt that comes back
later in the same deployment (the ``repeat`` workload) names its first occurrence in
``repeat_of``; selecting a subset keeps both, since a repeated question without its
first occurrence measures nothing that category is for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidParameterError

SUITE_PATH = Path(__file__).with_name("prompts") / "suite.json"
CATEGORIES = ("code", "chat", "grounded", "voice", "hostile", "agent", "repeat")


@dataclass(frozen=True)
class Workload:
    id: str
    category: str
    source: str
    kind: str = ""
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    chat: bool = True
    repeat_of: str | None = None  # id of an earlier prompt of the suite that this one repeats

    def encode(self, generator) -> tuple[list[int], bool]:
        """Prompt token ids through the bundle's tokenizer, and whether the chat template was used.

        A bundle without a chat template gets a plain ``role: content`` rendering, so the
        suite still runs (on tiny test bundles, for one).
        """
        has_template = bool(generator.codec.chat_template)
        if self.messages is not None:
            if has_template:
                return generator.encode_prompt(messages=list(self.messages)), True
            text = "\n".join(f"{m['role']}: {m['content']}" for m in self.messages) + "\nassistant:"
            return generator.encode_prompt(text, chat=False), False
        use_chat = self.chat and has_template
        return generator.encode_prompt(self.prompt, chat=use_chat), use_chat


@dataclass
class Suite:
    name: str
    workloads: list[Workload] = field(default_factory=list)
    categories: dict[str, str] = field(default_factory=dict)

    def select(self, categories: list[str] | None = None, per_category: int | None = None) -> list[Workload]:
        """The first ``per_category`` prompts of each requested category, in suite order.

        A prompt that repeats an earlier one (``repeat_of``) does not count towards
        ``per_category``: it comes along, in suite order, when the prompt it repeats is
        chosen, and is left out otherwise.
        """
        wanted = list(categories) if categories else list(CATEGORIES)
        unknown = [c for c in wanted if c not in CATEGORIES]
        if unknown:
            raise InvalidParameterError(f"unknown workload categor{'y' if len(unknown) == 1 else 'ies'} "
                                        f"{', '.join(unknown)}; known: {', '.join(CATEGORIES)}")
        if per_category is not None and per_category < 1:
            raise InvalidParameterError(f"--prompts must be >= 1; got {per_category}")
        out = []
        for category in wanted:
            in_category = [w for w in self.workloads if w.category == category]
            firsts = [w for w in in_category if w.repeat_of is None]
            kept = {w.id for w in (firsts[:per_category] if per_category else firsts)}
            out += [w for w in in_category if (w.repeat_of or w.id) in kept]
        return out


def load_suite(path: str | Path = SUITE_PATH) -> Suite:
    """Read and check a suite file; errors name the offending prompt."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidParameterError(f"cannot read prompt suite {path}: {exc}") from None
    workloads = []
    seen = set()
    for i, p in enumerate(doc.get("prompts", [])):
        where = f"{path.name} prompts[{i}] ({p.get('id', '?')})"
        for key in ("id", "category", "source"):
            if not isinstance(p.get(key), str) or not p[key]:
                raise InvalidParameterError(f"{where}: '{key}' must be a non-empty string")
        if p["id"] in seen:
            raise InvalidParameterError(f"{where}: duplicate id")
        seen.add(p["id"])
        if p["category"] not in CATEGORIES:
            raise InvalidParameterError(f"{where}: category must be one of {', '.join(CATEGORIES)}")
        has_prompt, has_messages = isinstance(p.get("prompt"), str), isinstance(p.get("messages"), list)
        if has_prompt == has_messages:
            raise InvalidParameterError(f"{where}: give exactly one of 'prompt' (string) or 'messages' (list)")
        if has_messages and not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                    and isinstance(m.get("content"), str) for m in p["messages"]):
            raise InvalidParameterError(f"{where}: every message needs string 'role' and 'content'")
        repeat_of = p.get("repeat_of")
        if repeat_of is not None:
            original = next((w for w in workloads if w.id == repeat_of), None)
            if original is None or original.category != p["category"]:
                raise InvalidParameterError(f"{where}: 'repeat_of' must name an earlier prompt of the same category")
            if original.repeat_of is not None:
                raise InvalidParameterError(f"{where}: 'repeat_of' must name a first occurrence, "
                                            f"not another repeat ({repeat_of})")
        workloads.append(Workload(id=p["id"], category=p["category"], source=p["source"], kind=p.get("kind", ""),
                                  prompt=p.get("prompt"),
                                  messages=tuple(p["messages"]) if has_messages else None,
                                  chat=bool(p.get("chat", True)), repeat_of=repeat_of))
    return Suite(doc.get("name", path.stem), workloads, dict(doc.get("categories", {})))
