"""The most speculation could give on a workload, on this machine: an oracle over the real drafts.

    specedge bench bound BUNDLE --workloads agent --prompts 6

``specedge bench run`` measures what the default achieves; this says how far that is from the
best any schedule of the same drafts could do, so a gap can be blamed on the policy (choose
better) or on the drafts and the step costs (nothing to choose). For each prompt, in the suite's
order (a category's earlier replies are in the cross-reply memory, as ``bench run`` scores a
workload), the target's greedy reply is decoded once, and at every reply position ``i``:

* **lookup**: the default drafter's suffix lookup (runtime/auto_drafter.py: the prompt, the
  reply so far, the earlier replies; guesses included) drafts its chain of up to ``max_k``
  tokens; ``lookup_right[i]`` of them are right (the reply's next tokens);
* **model**: the draft model's greedy draft from ``i`` is right for exactly as long as its
  argmax agrees with the reply position by position, which one teacher-forced forward over
  what it reads of the prompt (the ``draft_window`` option's bridge, :func:`draft_context`) and
  the reply gives for every ``i`` at once (``model_right[i]``).

An oracle that knows these counts picks each step's source and k (a plain step, a lookup of j
tokens, a model draft of j tokens) to spend the least on the reply: a shortest path over
positions (:func:`best_schedule`). Step prices are the bench's measured ones in 1-row plain
steps (:class:`StepPrices`: v(j) for a verify of j drafts, c per draft-model token; the loop's
own work per step is added to each); a schedule that runs the model also pays, once, the
draft's prefill of what it reads of the prompt, and the oracle runs the model only where that
pays. The model's later catch-ups (reading what lookups committed) are free for the oracle,
so the bounds with the model are upper bounds. The **bound** is decode tokens over that cost: a
speedup over plain decoding no policy over these drafts can beat on this machine, up to the noise of
the measured prices (a `bench run` speedup measured on another occasion may exceed it by a few %). A fourth bound
prices every verify like a plain step (v = 1: what free extra verify rows, as on a GPU, would allow).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..runtime.model_drafter import bridge
from ..runtime.options import DEFAULT_DRAFT_WINDOW

SOURCES = ("plain", "lookup", "model")
# The oracle's source sets, reported as columns: lookups alone (the default without a draft model),
# the draft model alone, both, and both with every verify priced as a plain step.
BOUNDS = ("lookup", "model", "both", "both_free_verify")


@dataclass(frozen=True)
class StepPrices:
    """Step costs in 1-row plain target steps: ``v[j]`` for a verify of j drafted tokens (``v[0]``
    = 1, a plain step; ``len(v) - 1`` is the most a step drafts), ``c`` per draft-model token (None:
    no draft model)."""

    v: tuple[float, ...]
    c: float | None = None

    def __post_init__(self) -> None:
        if len(self.v) < 2 or self.v[0] != 1.0 or min(self.v) <= 0 or (self.c is not None and self.c < 0):
            raise InvalidParameterError(f"step prices need v[0] = 1, v > 0 for at least k = 1, c >= 0; "
                                        f"got v={self.v}, c={self.c}")

    @property
    def max_k(self) -> int:
        return len(self.v) - 1

    def free_verify(self) -> "StepPrices":
        """The same draft cost with every verify priced as a plain step."""
        return StepPrices((1.0,) * len(self.v), self.c)


@dataclass(frozen=True)
class Schedule:
    """The oracle's cheapest way through one reply's decode positions."""

    cost: float  # in plain steps
    tokens: int  # decode tokens (after the prefill's first)
    steps: dict[str, int] = field(default_factory=dict)  # source -> steps
    committed: dict[str, int] = field(default_factory=dict)  # source -> tokens its steps committed

    @property
    def bound(self) -> float:
        return self.tokens / self.cost if self.cost > 0 else 1.0


def right_runs(correct: Sequence[bool]) -> list[int]:
    """``runs[i]``: how many consecutive positions from i on are correct (a greedy draft from i is
    right for exactly that many tokens)."""
    runs = [0] * (len(correct) + 1)
    for i in range(len(correct) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if correct[i] else 0
    return runs[:-1]


def best_schedule(lookup_right: Sequence[int], lookup_offered: Sequence[int], model_right: Sequence[int] | None,
                  prices: StepPrices, *, sources: Sequence[str] = SOURCES) -> Schedule:
    """The cheapest schedule of a reply of ``T = len(lookup_right)`` tokens, whose first token came
    from the prefill: steps start at position 1 and end past position T - 1.

    At position i a plain step commits 1 token for 1; a lookup of j <= ``lookup_offered[i]`` tokens
    commits ``min(j, lookup_right[i]) + 1`` for ``v[j]``; a model draft of j tokens commits
    ``min(j, model_right[i]) + 1`` for ``j c + v[j]``. Shortest path, O(T max_k).
    """
    length = len(lookup_right)
    if len(lookup_offered) != length or (model_right is not None and len(model_right) != length):
        raise InvalidParameterError("lookup_right, lookup_offered and model_right need one entry per reply token")
    use_model = "model" in sources and model_right is not None and prices.c is not None
    cost = [0.0] * (length + 1)
    choice: list[tuple[str, int]] = [("plain", 0)] * (length + 1)
    for i in range(length - 1, 0, -1):
        best = (1.0 + cost[i + 1], ("plain", 0))
        options = []
        if "lookup" in sources:
            options += [("lookup", j, lookup_right[i], prices.v[j]) for j in range(1, min(lookup_offered[i], prices.max_k) + 1)]
        if use_model:
            options += [("model", j, model_right[i], j * prices.c + prices.v[j]) for j in range(1, prices.max_k + 1)]
        for source, j, right, price in options:
            after = min(i + min(j, right) + 1, length)
            if price + cost[after] < best[0]:
                best = (price + cost[after], (source, j))
        cost[i], choice[i] = best
    steps = {s: 0 for s in SOURCES}
    committed = {s: 0 for s in SOURCES}
    i = 1
    while i < length:
        source, j = choice[i]
        right = {"plain": 0, "lookup": lookup_right[i], "model": model_right[i] if use_model else 0}[source]
        after = min(i + min(j, right) + 1, length)
        steps[source] += 1
        committed[source] += after - i
        i = after
    return Schedule(cost[1] if length > 1 else 0.0, max(length - 1, 0), steps, committed)


def bounds_of(lookup_right, lookup_offered, model_right, prices: StepPrices, *,
              model_prefill: float = 0.0) -> dict[str, Schedule]:
    """Every :data:`BOUNDS` schedule of one reply. ``model_prefill``: what the draft model's first
    step pays to read its prompt (plain steps), charged once to a schedule that runs the model;
    the oracle runs it only where that still pays."""
    plain_only = best_schedule(lookup_right, lookup_offered, None, prices, sources=("plain",))
    lookup = best_schedule(lookup_right, lookup_offered, None, prices, sources=("plain", "lookup"))
    free = prices.free_verify()

    def with_model(schedule: Schedule, without: Schedule) -> Schedule:
        if not schedule.steps.get("model"):
            return schedule
        paid = Schedule(schedule.cost + model_prefill, schedule.tokens, schedule.steps, schedule.committed)
        return paid if paid.cost < without.cost else without

    return {"lookup": lookup,
            "model": with_model(best_schedule(lookup_right, lookup_offered, model_right, prices,
                                              sources=("plain", "model")), plain_only),
            "both": with_model(best_schedule(lookup_right, lookup_offered, model_right, prices), lookup),
            "both_free_verify": with_model(best_schedule(lookup_right, lookup_offered, model_right, free),
                                           best_schedule(lookup_right, lookup_offered, None, free,
                                                         sources=("plain", "lookup")))}


# ----------------------------------------------------------------------------- measuring


def lookup_counts(lookup, history: Sequence[int], reply: Sequence[int], max_k: int) -> tuple[list[int], list[int]]:
    """(right, offered) per reply position: what ``lookup`` (a :class:`~..runtime.suffix_drafter.SuffixDrafter`)
    would draft there, given the committed ``history`` (the prompt) and the reply before it."""
    committed = list(history)
    lookup.begin(np.asarray(committed, np.int64))
    right, offered = [], []
    for i in range(len(reply)):
        limit = min(max_k, len(reply) - i)
        offer = lookup.lookup_offer(committed, limit)  # takes in the committed tokens, as the loop's offer does
        tokens = lookup.propose(np.asarray(committed, np.int64), limit).tokens.tolist() if offer.tokens else []
        n = 0
        while n < len(tokens) and tokens[n] == reply[i + n]:
            n += 1
        right.append(n)
        offered.append(len(tokens))
        committed.append(int(reply[i]))
    return right, offered


def draft_context(prompt: Sequence[int], window: int | None) -> list[int]:
    """What the draft model reads of ``prompt`` at its first step under a draft window (None: all
    of it): the first ``SINK_TOKENS`` and the most recent, as the drafter bridges it from an empty
    cache (a first model step later in the reply bridges the reply so far too; the oracle reads at its start)."""
    prompt = list(prompt)
    if window is None or len(prompt) <= window:
        return prompt
    sink_fill, tail = bridge(len(prompt), 0, window)
    return prompt[:sink_fill] + prompt[tail:]


def model_correct(engine, head_ids: np.ndarray | None, prompt: Sequence[int], reply: Sequence[int]) -> list[bool]:
    """Whether the draft model's greedy next token equals ``reply[i]`` after prompt + reply[:i], for
    every i: one teacher-forced forward (its logits rows for the reply's positions). ``prompt``:
    what the draft reads of it (:func:`draft_context`)."""
    if not len(reply):
        return []
    cache = engine.new_cache()
    ids = np.asarray([*prompt, *reply[:-1]], np.int64)
    logits = np.asarray(engine.forward(ids, cache, len(reply)))
    logits = logits.reshape(-1, logits.shape[-1])[-len(reply):]
    index = logits.argmax(axis=-1)
    predicted = index if head_ids is None else np.asarray(head_ids)[index]
    return [bool(p == t) for p, t in zip(predicted.tolist(), reply)]


def measure_prices(gen, probe: Sequence[int], max_k: int, reps: int, plain_step_s: float) -> tuple[StepPrices, dict]:
    """The bench's step costs (``StepCosts``: paired medians at ``probe``'s length) as prices, with
    the loop's own per-step time added to every step.

    Why: a step costs its forward plus the loop's work around it (the verifier, the commit, the
    stop checks), which ``StepCosts`` leaves out. ``plain_step_s``, the seconds per token of the
    plain replies, minus the 1-token forward is that work (0-2 ms of a 24-26 ms SmolLM2-135M step
    and of a 51-62 ms Qwen int4 step on the 2-core AVX-512 EPYC): where the forward is short it is
    a larger share of every step, and v(k) alone would price verifies too high.
    """
    from .runner import StepCosts

    costs = StepCosts(gen, list(probe), [k + 1 for k in range(1, max_k + 1)])
    costs.sample(reps)
    measured = costs.result()
    if gen.draft is not None:  # the draft's prompt prefill, per token (its deferred first catch-up)
        ids, cache, times = np.asarray(list(probe), np.int64), gen.draft.new_cache(), []
        for _ in range(reps + 1):  # the first is a warm-up
            cache.reset()
            start = time.perf_counter()
            gen.draft.forward(ids, cache, 1)
            times.append(time.perf_counter() - start)
        measured["draft_prefill_token_s"] = float(np.median(times[1:])) / len(ids)
    step_s = float(measured["target_s"][1])
    loop_s = max(plain_step_s - step_s, 0.0)
    plain = step_s + loop_s
    v = [1.0 if k == 0 else (float(measured["v"][k]) * step_s + loop_s) / plain for k in range(max_k + 1)]
    # A verify of more rows never costs less: a noisy dip would hand the oracle longer drafts for free.
    v = tuple(np.maximum.accumulate(v).tolist())
    c = None if measured["draft_token_s"] is None else float(measured["draft_token_s"]) / plain
    return StepPrices(v, c), {"target_step_s": step_s, "loop_s": loop_s, "unit_s": plain, "v_forward": measured["v"],
                              "draft_token_s": measured["draft_token_s"],
                              "draft_prefill_token_s": measured.get("draft_prefill_token_s")}


def run_bound(gen, workloads: list, *, max_new_tokens: int, reps: int, progress,
              draft_window: int | None = DEFAULT_DRAFT_WINDOW) -> dict:
    """Decode each workload's prompts plainly, count what each source would have drafted right, and
    bound every category (the median over its prompts, and pooled: its decode tokens over the
    oracle's summed cost).

    ``workloads``: suite :class:`~.suite.Workload` items, a category's prompts in order (each one's
    reply joins that category's memory after it is counted). ``progress``: a :class:`~.progress.Progress`.
    ``draft_window``: what the draft model reads of each prompt (:func:`draft_context`; None: all of
    it), as the ``draft_window`` option; its prefill is charged once to a schedule that runs the model.
    """
    from ..runtime import auto_drafter
    from ..runtime.memory import SpeculationMemory
    from ..runtime.options import GenerationConfig
    from .runner import machine_info

    if max_new_tokens < 2 or reps < 1:
        raise InvalidParameterError("bench bound needs max_new_tokens >= 2 and reps >= 1")
    max_k = gen.manifest.speculation.max_draft_tokens
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    machine = machine_info()  # load average at the start
    encoded = [(w, *w.encode(gen)) for w in workloads]
    probe = sorted(encoded, key=lambda e: len(e[1]))[len(encoded) // 2][1]  # the median prompt's length
    gen.warmup()
    replies = []
    for w, ids, used_chat in encoded:
        result = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens, speculation=False, chat=used_chat)
        replies.append((list(result.token_ids), result.stats.tokens_per_s))
        progress.advance(f"{w.id} (plain)")
    plain_step_s = float(np.median([1.0 / tps for _, tps in replies if tps > 0]))
    prices, measured = measure_prices(gen, probe, max_k, reps, plain_step_s)
    prompts, memory, category = [], SpeculationMemory(), None
    for (w, ids, _), (reply, plain_tps) in zip(encoded, replies):
        if w.category != category:
            memory, category = SpeculationMemory(), w.category  # each workload its own deployment, as bench run
        lookup = auto_drafter.build(GenerationConfig(), None, memory.replies).lookup
        right, offered = lookup_counts(lookup, ids, reply, max_k)
        context = draft_context(ids, draft_window)
        model = (right_runs(model_correct(gen.draft, gen.draft_head_ids, context, reply))
                 if gen.draft is not None else None)
        memory.remember_reply(reply, ids)
        prefill = len(context) * (measured["draft_prefill_token_s"] or 0.0) / measured["unit_s"]  # in plain steps
        schedules = bounds_of(right, offered, model, prices, model_prefill=prefill)
        prompts.append({"id": w.id, "category": w.category, "tokens": len(reply),
                        "plain_tokens_per_s": plain_tps,
                        "lookup_right_share": _share(right[1:]), "model_right_share": _share(model and model[1:]),
                        "bounds": {name: _schedule_doc(s) for name, s in schedules.items()},
                        "lookup_right": right, "lookup_offered": offered, "model_right": model})
        progress.advance(w.id)
    categories: dict[str, dict] = {}
    for p in prompts:
        cell = categories.setdefault(p["category"], {"prompts": 0, "tokens": 0, "cost": {b: 0.0 for b in BOUNDS},
                                                     "lookup_right": 0.0, "model_right": None})
        cell["prompts"] += 1
        cell["tokens"] += p["tokens"] - 1
        for b in BOUNDS:
            cell["cost"][b] += p["bounds"][b]["cost"]
    for name, cell in categories.items():
        mine = [p for p in prompts if p["category"] == name]
        # The median over prompts, as `bench run` takes its speedups (comparable with them), and the
        # pooled bound (the category's decode tokens over the oracle's summed cost).
        cell["bound"] = {b: float(np.median([p["bounds"][b]["bound"] for p in mine])) for b in BOUNDS}
        cell["pooled"] = {b: cell["tokens"] / cell["cost"][b] if cell["cost"][b] else 1.0 for b in BOUNDS}
        cell["lookup_right"] = _share([x for p in mine for x in p["lookup_right"][1:]])
        if gen.draft is not None:
            cell["model_right"] = _share([x for p in mine for x in p["model_right"][1:]])
    return {"date": started, "machine": machine, "max_new_tokens": max_new_tokens, "max_k": max_k,
            "draft_window": draft_window,
            "prices": {"v": list(prices.v), "c": prices.c},
            "plain_step_s": plain_step_s, "measured": measured,
            "has_draft_model": gen.draft is not None, "categories": categories, "prompts": prompts}


def _share(right: Sequence[int] | None) -> float | None:
    """Share of decode positions (after the prefill's token) where the source's first drafted token is right."""
    if right is None:
        return None
    return sum(1 for r in right if r > 0) / len(right) if len(right) else 0.0


def _schedule_doc(schedule: Schedule) -> dict:
    return {"bound": schedule.bound, "cost": schedule.cost, "tokens": schedule.tokens,
            "steps": schedule.steps, "committed": schedule.committed}


def render(doc: dict) -> str:
    """Markdown: per category, where each source's first token is right and the oracle's bounds (the
    median over its prompts, as `bench run` reports speedups)."""
    prices = doc["prices"]
    v = ", ".join(f"{k}:{x:.2f}" for k, x in enumerate(prices["v"]) if k)
    c = "no draft model" if prices["c"] is None else f"c = {prices['c']:.2f}"
    loop_ms = 1e3 * doc["measured"]["loop_s"]
    window = doc["draft_window"]
    reads = "whole prompts" if window is None else f"at most {window} prompt tokens (draft window)"
    m = doc["machine"]
    lines = [f"{doc['date']} UTC; {m['cpu']}, {m['usable_cores']} usable cores, load average at start "
             f"{m['load_average']}; onnxruntime {m['onnxruntime']}", "",
             f"plain step {1e3 * doc['plain_step_s']:.1f} ms ({loop_ms:.1f} ms of it the loop's own work); step prices "
             f"in plain steps: verify v(k) {v}; draft token {c}; the draft reads {reads}", "",
             "| workload | prompts | decode tokens | lookup right at | model right at | bound: lookup | model | both "
             "| both, free verify |", "|---|---|---|---|---|---|---|---|---|"]
    for name, cell in doc["categories"].items():
        model = "-" if cell["model_right"] is None else f"{cell['model_right']:.0%}"
        bounds = [cell["bound"][b] for b in BOUNDS]
        if not doc["has_draft_model"]:
            bounds = [bounds[0], None, bounds[0], bounds[3]]
        cells = " | ".join("-" if b is None else f"{b:.2f}x" for b in bounds)
        lines.append(f"| {name} | {cell['prompts']} | {cell['tokens']} | {cell['lookup_right']:.0%} | {model} | {cells} |")
    return "\n".join(lines)
