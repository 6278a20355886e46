"""The conversation benchmark: a voice-agent call, turn by turn, with and without cache reuse.

``bench/prompts/conversation.json`` holds a long system prompt and the user's turns. Each
configuration replays the whole call on one Generator: every turn sends the full history
(system, earlier turns, the replies the model gave), as a voice framework does. Reported per
turn: time to first token, end-to-end turn latency and decode tokens/s.

Configurations:
- ``cold``: ``reuse_prefix=False``, every turn prefills the whole history (the old behaviour);
- ``reuse``: the conversation slot keeps the history, each turn prefills only what is new;
- ``reuse+prefill``: as ``reuse``, and before each turn the history plus the user's turn is
  pushed with ``Generator.prefill`` (what a framework does on interim transcripts), outside
  the timed turn.

Configurations run interleaved turn by turn on separate Generators (one per configuration,
same bundle), so machine noise hits each alike; greedy replies must be identical across them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidParameterError

CONVERSATION_PATH = Path(__file__).with_name("prompts") / "conversation.json"
CONFIGS = ("cold", "reuse", "reuse+prefill")


@dataclass(frozen=True)
class Conversation:
    system: str
    turns: tuple[str, ...]


def load_conversation(path: str | Path = CONVERSATION_PATH) -> Conversation:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        system, turns = doc["system"], doc["turns"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidParameterError(f"cannot read conversation {path}: {exc}") from None
    if not isinstance(system, str) or not isinstance(turns, list) or not all(isinstance(t, str) for t in turns) \
            or not turns:
        raise InvalidParameterError(f"conversation {path}: 'system' must be a string and 'turns' a non-empty "
                                    "list of strings")
    return Conversation(system, tuple(turns))


@dataclass
class TurnRecord:
    config: str
    turn: int
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float
    turn_s: float
    new_tokens: int
    tokens_per_s: float
    acceptance: float


@dataclass
class ConversationReport:
    records: list[TurnRecord] = field(default_factory=list)
    identical: bool = True  # every configuration gave the same greedy replies

    def summary(self) -> dict:
        out = {}
        for config in dict.fromkeys(r.config for r in self.records):
            rows = [r for r in self.records if r.config == config]
            later = [r.ttft_s for r in rows if r.turn > 0]
            out[config] = {
                "ttft_first_s": rows[0].ttft_s,
                "ttft_later_p50_s": statistics.median(later) if later else None,
                "ttft_later_p95_s": _p95(later),
                "turn_p50_s": statistics.median(r.turn_s for r in rows),
                "decode_tok_s_p50": statistics.median(r.tokens_per_s for r in rows),
                "reused_tokens": sum(r.reused_tokens for r in rows),
                "prompt_tokens": sum(r.prompt_tokens for r in rows),
            }
        cold = out.get("cold", {}).get("ttft_later_p50_s")
        for config, row in out.items():
            later = row["ttft_later_p50_s"]
            row["ttft_later_vs_cold"] = later / cold if cold and later is not None else None
        return out

    def to_json(self) -> dict:
        return {"identical": self.identical, "summary": self.summary(),
                "turns": [r.__dict__ for r in self.records]}


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def run_conversation(generators: dict, conversation: Conversation, *, max_new_tokens: int = 48,
                     speculation: bool = True, progress=None) -> ConversationReport:
    """Replay ``conversation`` on each configuration's Generator (``{config: Generator}``)."""
    unknown = set(generators) - set(CONFIGS)
    if unknown:
        raise InvalidParameterError(f"unknown conversation configuration(s) {sorted(unknown)}; known: "
                                    f"{', '.join(CONFIGS)}")
    report = ConversationReport()
    histories = {c: [{"role": "system", "content": conversation.system}] for c in generators}
    for turn, text in enumerate(conversation.turns):
        replies = {}
        for config, gen in generators.items():
            messages = histories[config] + [{"role": "user", "content": text}]
            options = dict(max_new_tokens=max_new_tokens, temperature=0.0, speculation=speculation,
                           reuse_prefix=config != "cold")
            if config == "reuse+prefill":
                gen.prefill(messages=messages)  # the framework did this while the user spoke
            out = gen.generate(messages=messages, **options)
            s = out.stats
            report.records.append(TurnRecord(config, turn, s.prompt_tokens, s.reused_tokens,
                                             s.time_to_first_token_s, s.total_s, s.new_tokens, s.tokens_per_s,
                                             s.acceptance))
            replies[config] = out.token_ids
            histories[config] = messages + [{"role": "assistant", "content": out.text}]
            if progress is not None:
                progress(config, turn)
        report.identical &= len({tuple(r) for r in replies.values()}) == 1
    return report


def format_report(report: ConversationReport) -> str:
    lines = ["| config | TTFT turn 1 | TTFT later p50 / p95 | later vs cold | turn p50 | decode tok/s | "
             "reused / prompt tokens |", "|---|---|---|---|---|---|---|"]
    for config, row in report.summary().items():
        ratio = row["ttft_later_vs_cold"]
        lines.append(f"| {config} | {row['ttft_first_s'] * 1e3:.0f} ms | "
                     f"{(row['ttft_later_p50_s'] or 0) * 1e3:.0f} / {(row['ttft_later_p95_s'] or 0) * 1e3:.0f} ms | "
                     f"{'' if ratio is None else f'{ratio:.2f}x'} | {row['turn_p50_s'] * 1e3:.0f} ms | "
                     f"{row['decode_tok_s_p50']:.1f} | {row['reused_tokens']} / {row['prompt_tokens']} |")
    lines.append("")
    lines.append("greedy replies identical across configurations: " + ("yes" if report.identical else "NO"))
    return "\n".join(lines)
