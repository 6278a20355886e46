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

``callers`` > 1: that many calls at once on each Generator (one cache slot each), round robin turn
by turn, every call with the same system prompt and caller c speaking the user's turns rotated by c.
A new call's first turn then finds the system prompt in another call's slot and copies it
(runtime/slots.py) where ``cold`` prefills it; the summary's ``ttft_first_other_p50_s`` is that turn.

The peer (``peer``, a :class:`PeerProcess` of ``llamacpp-conversation``, bench/peers.py): llama.cpp
on the bundle's GGUF, given each turn's prompt token ids (the ``reuse`` history, so the same
turns), cold and with its server's prompt cache (the longest common prefix kept); its rows sit
next to ours, turn by turn. Its replies are its own: they are not appended to the history.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidParameterError
from ..runtime.divergence import first_divergence

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
    catchup_tokens: int = 0  # history the draft model read before its first draft (0: none or no draft)
    drafted: int = 0  # draft tokens verified this turn (0: speculation stayed off)
    peer: bool = False  # a peer's row: reused_tokens unknown (0), not part of the identity check
    same_reply: bool | None = None  # a peer's row: its reply equals ours token for token
    caller: int = 0  # which of the concurrent calls (run_conversation's ``callers``)


@dataclass
class ConversationReport:
    records: list[TurnRecord] = field(default_factory=list)
    identical: bool = True  # every configuration gave the same greedy replies

    def summary(self) -> dict:
        out = {}
        for config in dict.fromkeys(r.config for r in self.records):
            rows = [r for r in self.records if r.config == config]
            later = [r.ttft_s for r in rows if r.turn > 0]
            others = [r.ttft_s for r in rows if r.turn == 0 and r.caller > 0]
            out[config] = {
                "ttft_first_s": rows[0].ttft_s,
                "ttft_first_other_p50_s": statistics.median(others) if others else None,
                "ttft_later_p50_s": statistics.median(later) if later else None,
                "ttft_later_p95_s": _p95(later),
                "turn_p50_s": statistics.median(r.turn_s for r in rows),
                "decode_tok_s_p50": statistics.median(r.tokens_per_s for r in rows),
                "reused_tokens": None if rows[0].peer else sum(r.reused_tokens for r in rows),
                "prompt_tokens": sum(r.prompt_tokens for r in rows),
            }
        cold = out.get("cold", {}).get("ttft_later_p50_s")
        for config, row in out.items():
            later = row["ttft_later_p50_s"]
            row["ttft_later_vs_cold"] = later / cold if cold and later is not None else None
        return out

    def to_json(self) -> dict:
        return {"identical": self.identical, "summary": self.summary(), "ttft_by_turn": self.ttft_by_turn(),
                "turns": [r.__dict__ for r in self.records]}

    def ttft_by_turn(self) -> list[dict]:
        """Per turn: prompt tokens and each configuration's (and peer's) time to first token, seconds."""
        out: dict[int, dict] = {}
        for r in self.records:
            if r.caller:
                continue  # the first call's turns (the others' are in ``turns``)
            row = out.setdefault(r.turn, {"turn": r.turn, "prompt_tokens": r.prompt_tokens, "ttft_s": {}})
            row["ttft_s"][r.config] = r.ttft_s
        return [out[t] for t in sorted(out)]


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def run_conversation(generators: dict, conversation: Conversation, *, max_new_tokens: int = 48,
                     speculation: bool = True, progress=None, peer=None, callers: int = 1) -> ConversationReport:
    """Replay ``conversation`` on each configuration's Generator (``{config: Generator}``, each with at
    least ``callers`` cache slots), as ``callers`` concurrent calls (see the module docstring), and on
    ``peer`` (``peer.configs``, ``peer.generate(job, config, n) -> PeerRun``; the first call's turns)."""
    unknown = set(generators) - set(CONFIGS)
    if unknown:
        raise InvalidParameterError(f"unknown conversation configuration(s) {sorted(unknown)}; known: "
                                    f"{', '.join(CONFIGS)}")
    if isinstance(callers, bool) or not isinstance(callers, int) or callers < 1:
        raise InvalidParameterError(f"callers must be an integer >= 1; got {callers!r}")
    report = ConversationReport()
    histories = {(config, caller): [{"role": "system", "content": conversation.system}]
                 for config in generators for caller in range(callers)}
    n_turns = len(conversation.turns)
    for turn in range(n_turns):
        for caller in range(callers):
            text = conversation.turns[(turn + caller) % n_turns]
            replies = {}
            for config, gen in generators.items():
                messages = histories[config, caller] + [{"role": "user", "content": text}]
                options = dict(max_new_tokens=max_new_tokens, temperature=0.0, speculation=speculation,
                               reuse_prefix=config != "cold")
                if config == "reuse+prefill":
                    gen.prefill(messages=messages)  # the framework did this while the user spoke
                out = gen.generate(messages=messages, **options)
                s = out.stats
                report.records.append(TurnRecord(config, turn, s.prompt_tokens, s.reused_tokens,
                                                 s.time_to_first_token_s, s.total_s, s.new_tokens, s.tokens_per_s,
                                                 s.acceptance, s.catchup_tokens, s.drafted, caller=caller))
                replies[config] = out.token_ids
                histories[config, caller] = messages + [{"role": "assistant", "content": out.text}]
                if progress is not None:
                    progress(config, turn)
            report.identical &= len({tuple(r) for r in replies.values()}) == 1
            if caller == 0:
                first_replies = replies
        if peer is not None:
            _peer_turn(peer, generators, {c: histories[c, 0] for c in generators}, turn, max_new_tokens,
                       first_replies, report, progress)
    return report


def _peer_turn(peer, generators: dict, histories: dict, turn: int, max_new_tokens: int, replies: dict,
               report: ConversationReport, progress) -> None:
    """Run this turn's prompt (the first call's ``reuse`` history, as token ids) on each of the peer's
    configurations."""
    from .peers import Job

    config = "reuse" if "reuse" in generators else next(iter(generators))
    messages = histories[config][:-1]  # the history up to and including this turn's user message
    ids = generators[config].encode_prompt(messages=messages)
    ours = replies[config]
    job = Job(f"turn{turn}", "conversation", ids, max_new_tokens, ours)
    for name in peer.configs:
        run = peer.generate(job, name, max_new_tokens)
        report.records.append(TurnRecord(name, turn, len(ids), 0, run.ttft_s,
                                         run.token_times_s[-1] if run.token_times_s else 0.0, len(run.tokens),
                                         run.tokens_per_s, 0.0, peer=True,
                                         same_reply=first_divergence(ours, run.tokens) is None))
        if progress is not None:
            progress(name, turn)


def format_report(report: ConversationReport) -> str:
    summary = report.summary()
    callers = any(row["ttft_first_other_p50_s"] is not None for row in summary.values())
    lines = ["| config | TTFT turn 1 | " + ("other calls' turn 1 p50 | " if callers else "") +
             "TTFT later p50 / p95 | later vs cold | turn p50 | decode tok/s | reused / prompt tokens |",
             "|---" * (8 if callers else 7) + "|"]
    for config, row in summary.items():
        ratio = row["ttft_later_vs_cold"]
        other = row["ttft_first_other_p50_s"]
        others = (f"{other * 1e3:.0f} ms | " if other is not None else " | ") if callers else ""
        lines.append(f"| {config} | {row['ttft_first_s'] * 1e3:.0f} ms | {others}"
                     f"{(row['ttft_later_p50_s'] or 0) * 1e3:.0f} / {(row['ttft_later_p95_s'] or 0) * 1e3:.0f} ms | "
                     f"{'' if ratio is None else f'{ratio:.2f}x'} | {row['turn_p50_s'] * 1e3:.0f} ms | "
                     f"{row['decode_tok_s_p50']:.1f} | "
                     f"{'?' if row['reused_tokens'] is None else row['reused_tokens']} / {row['prompt_tokens']} |")
    by_turn = report.ttft_by_turn()
    if by_turn:
        configs = list(by_turn[0]["ttft_s"])
        lines += ["", "TTFT per turn (ms)" + (", the first call" if callers else "") + ":", "",
                  "| turn | prompt tokens | " + " | ".join(configs) + " |", "|---" * (len(configs) + 2) + "|"]
        for row in by_turn:
            cells = [f"{row['ttft_s'][c] * 1e3:.0f}" if c in row["ttft_s"] else "" for c in configs]
            lines.append(f"| {row['turn'] + 1} | {row['prompt_tokens']} | " + " | ".join(cells) + " |")
    peers = [r for r in report.records if r.peer]
    if peers:
        same = sum(bool(r.same_reply) for r in peers)
        lines += ["", f"peer replies equal to ours: {same} of {len(peers)} (a peer's text may differ: its own "
                  "weights and kernels)"]
    lines.append("")
    lines.append("greedy replies identical across configurations: " + ("yes" if report.identical else "NO"))
    return "\n".join(lines)
