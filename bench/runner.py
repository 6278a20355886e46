"""The benchmark itself: baseline vs every speculative configuration, interleaved.

Order of work, and why:

1. Load the bundle once; encode the selected prompts (prompts that cannot fit
   prompt + max_new_tokens + a verify block in max_context are skipped, with a note).
2. Warm-up: every session shape once (``Generator.warmup``), then every configuration
   once on the first prompt. The adaptive controller's cost profile is learned here
   too, as it would be in a long-running server.
3. Step costs, measured directly on the engines at the median prompt length: a
   target step on 1 token, on k+1 tokens, and a draft token; ``micro_reps`` in all,
   spread before each prompt's rounds so they share the runs' machine state
   (StepCosts). They feed Leviathan's bound.
4. For each prompt, ``repeats`` rounds; each round runs the baseline and every
   configuration once, the order reversed on odd rounds (A B C, C B A, ...), so a
   linear drift of the machine is seen equally by all. Speedup is the median of
   each round's paired ratio to that round's baseline. At each new workload the
   Generator forgets what earlier replies taught it (draft acceptance, reply lengths;
   ``Generator.forget_replies``), so each workload is scored as its own deployment. Each
   configuration keeps its own cross-reply memory per round, so a reply is drafted only from
   that configuration's replies to the workload's earlier prompts in the same round.
5. Every speculative output is compared with the prompt's first baseline output,
   token by token; baseline repeats are compared too (they must be deterministic).
"""

from __future__ import annotations

import math
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from .. import __version__
from ..engines.hugepages import describe as describe_huge_pages
from ..engines.hugepages import hugepages
from ..runtime.costs import time_forward
from ..runtime.divergence import Divergence, first_divergence
from ..runtime.divergence import explain as explain_divergence
from . import metrics
from .configs import BASELINE, BASELINE_EXACT, BASELINES, DEFAULT_K_SWEEP, BenchConfig, expand_configs
from .progress import Progress
from .suite import Workload, load_suite

SCHEMA = "specedge-bench"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BenchSettings:
    bundle: Path
    categories: tuple[str, ...] | None = None  # None = every category
    per_category: int | None = None  # None = every prompt of a category
    max_new_tokens: int = 64
    repeats: int = 3
    configs: str | None = None  # comma list, see configs.expand_configs; None = all
    k_sweep: tuple[int, ...] = DEFAULT_K_SWEEP
    threads: int = 0  # ORT intra-op threads per session (0 = ORT default); peers get the same
    warmup_tokens: int = 16  # tokens per warm-up run of each configuration
    micro_reps: int = 10  # repetitions per step-cost measurement (medians)
    peers: tuple[str, ...] = ()
    peer_repeats: int = 1  # rounds per prompt for the peers (HF on torch CPU is slow)
    peer_options: dict = field(default_factory=dict)  # hf_target, hf_draft, gguf, genai_precision, ...
    quick: bool = False
    suite_path: Path | None = None
    command: str = ""  # the exact command line, for the results file
    progress: bool = True
    verify_checksums: bool = True
    # JSON lines appended as the bench goes (every run, every peer run and outcome), so a bench
    # that is killed or whose peer takes the process down keeps what it measured. None = off.
    partial_path: Path | None = None


@dataclass
class RunRecord:
    """One generation: the numbers we keep from its GenerationResult."""

    workload: str
    category: str
    config: str
    round: int
    tokens: list[int]
    token_times_s: list[float]
    tokens_per_s: float
    new_tokens: int
    finish_reason: str
    ttft_s: float
    prefill_s: float
    draft_s: float
    verify_s: float
    overhead_s: float
    total_s: float
    steps: int
    drafted: int
    accepted: int
    drafted_per_position: list[int]
    accepted_per_position: list[int]
    k_chosen: dict[int, int]
    near_ties: int
    mode_s: dict[str, float]
    rss_peak_mb: float
    # The default policy's steps by source (GenerationStats.policy; 0 for other configurations).
    lookup_steps: int = 0  # guesses included
    guess_steps: int = 0
    model_steps: int = 0
    # Seconds and committed tokens by step source, any configuration (GenerationStats.source_*).
    source_s: dict[str, float] = field(default_factory=dict)
    source_tokens: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        """What the JSON keeps per run (no token ids or times)."""
        return {"workload": self.workload, "config": self.config, "round": self.round,
                "tokens_per_s": self.tokens_per_s, "new_tokens": self.new_tokens,
                "finish_reason": self.finish_reason, "ttft_s": self.ttft_s, "total_s": self.total_s,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "near_ties": self.near_ties, "rss_peak_mb": self.rss_peak_mb}


# ----------------------------------------------------------------------------- memory
def _read_status(key: str) -> float | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) / 1024 if m else None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0), so the next reading is this run's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident memory in MB: VmHWM (since the last reset) where Linux has it, else getrusage."""
    hwm = _read_status("VmHWM")
    return hwm if hwm is not None else process_peak_rss_mb()


def process_peak_rss_mb() -> float:
    """The process's lifetime peak (getrusage), unaffected by resets; NaN where getrusage is missing."""
    try:
        import resource
    except ImportError:  # Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB on Linux


# ----------------------------------------------------------------------------- machine
def machine_info() -> dict:
    """CPU model, cores, RAM, library versions: what a reader needs to compare numbers."""
    import onnxruntime

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gb = None
    try:
        m = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
        ram_gb = round(int(m.group(1)) / 1024 / 1024, 1) if m else None
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable, "ram_gb": ram_gb, "load_average": load,
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "numpy": np.__version__, "specedge": __version__,
            "huge_pages": describe_huge_pages(hugepages())}


# ----------------------------------------------------------------------------- step costs
class StepCosts:
    """Step costs measured directly on the engines, spread over the bench.

    ``sample(reps)`` prefills ``prompt_ids`` into the generator's own caches (the loop
    resets them at every call), then per repetition times one target forward on n
    tokens for every n in ``lengths`` and one draft forward on 1 token, rewinding after
    each so every measurement sees the same cache length. The bench calls it before
    each prompt's rounds, so the costs are measured in the same periods as the runs.

    ``v(k)`` and ``c`` are medians of ratios paired within one repetition (target
    (k+1)-token step / 1-token step, draft token / target 1-token step): like the
    speedups, they cancel the machine's drift. The 1-token step is the bare engine's 1-row step
    (fast mode's plain step, the baseline's); ``exact_step`` is exact mode's 2-row plain step over it.
    """

    def __init__(self, gen, prompt_ids: list[int], lengths: list[int]) -> None:
        self.gen = gen
        self.prompt = np.asarray(prompt_ids, np.int64)
        self.lengths = sorted(set([1] + list(lengths)))
        # Step inputs: the prompt's last n tokens (the ids hardly matter, the shapes do).
        tiled = (list(prompt_ids) * (max(self.lengths) // max(len(prompt_ids), 1) + 1))
        self.step_ids = {n: np.asarray(tiled[-n:], np.int64) for n in self.lengths}
        self.target: dict[int, list[float]] = {n: [] for n in self.lengths}
        self.draft: list[float] = []
        self.v: dict[int, list[float]] = {n - 1: [] for n in self.lengths}
        self.c: list[float] = []
        self.exact_step: list[float] = []  # exact 2-row plain step / 1-row step

    def sample(self, reps: int) -> None:
        gen = self.gen
        engines = [(gen.target, gen.target_kv)] + ([(gen.draft, gen.draft_kv)] if gen.draft is not None else [])
        for engine, cache in engines:
            cache.reset()
            engine.forward(self.prompt, cache, num_logits=1)
        bare = gen.target.inner  # n >= 2 rows run the same kernels through either engine
        time_forward(bare, gen.target_kv, self.step_ids[1])  # the first step after a prefill is slower
        for _ in range(reps):
            row = {n: time_forward(bare, gen.target_kv, self.step_ids[n]) for n in self.lengths}
            self.exact_step.append(time_forward(gen.target, gen.target_kv, self.step_ids[1]) / row[1])
            for n, dt in row.items():
                self.target[n].append(dt)
                self.v[n - 1].append(dt / row[1])
            if gen.draft is not None:
                dt = time_forward(gen.draft, gen.draft_kv, self.step_ids[1])
                self.draft.append(dt)
                self.c.append(dt / row[1])
        for _, cache in engines:
            cache.reset()

    def result(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "reps": len(self.target[1]),
                "target_s": {n: metrics.median(s) for n, s in self.target.items()},
                "draft_token_s": metrics.median(self.draft) if self.draft else None,
                "v": {k: metrics.median(r) for k, r in self.v.items()},
                "c_model": metrics.median(self.c) if self.c else None,
                "exact_step": metrics.median(self.exact_step)}


# ----------------------------------------------------------------------------- aggregation
def _ms_per_token(runs: list[RunRecord]) -> dict[str, float]:
    """Per step source, the cell's seconds over its committed tokens, in ms (sources without tokens left out)."""
    out = {}
    for source in ("lookup", "model", "plain"):
        tokens = sum(r.source_tokens.get(source, 0) for r in runs)
        if tokens:
            out[source] = 1e3 * sum(r.source_s.get(source, 0.0) for r in runs) / tokens
    return out


def aggregate(runs: list[RunRecord], baseline: dict[tuple[str, int], RunRecord]) -> dict:
    """Metrics of one (workload category, configuration) cell; see bench/metrics.py for definitions."""
    tps = [r.tokens_per_s for r in runs if r.tokens_per_s > 0]
    ratios = [r.tokens_per_s / b.tokens_per_s for r in runs
              if (b := baseline.get((r.workload, r.round))) is not None and b.tokens_per_s > 0 and r.tokens_per_s > 0]
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    steps = sum(r.steps for r in runs)
    width = max([len(r.drafted_per_position) for r in runs] + [0])
    dpp = [sum(r.drafted_per_position[i] for r in runs if i < len(r.drafted_per_position)) for i in range(width)]
    app = [sum(r.accepted_per_position[i] for r in runs if i < len(r.accepted_per_position)) for i in range(width)]
    k_chosen: dict[int, int] = {}
    for r in runs:
        for k, n in r.k_chosen.items():
            k_chosen[k] = k_chosen.get(k, 0) + n
    split_total = sum(r.draft_s + r.verify_s + r.overhead_s for r in runs)
    token_gaps = [g for r in runs for g in metrics.token_gaps(r.token_times_s)]
    block_gaps = [g for r in runs for g in metrics.block_gaps(r.token_times_s)]
    mode_s: dict[str, float] = {}
    for r in runs:
        for mode, s in r.mode_s.items():
            mode_s[mode] = mode_s.get(mode, 0.0) + s
    ms = 1e3
    return {
        "runs": len(runs),
        "tokens": sum(r.new_tokens for r in runs),
        "tokens_per_s": {"median": metrics.median(tps), "iqr": metrics.iqr(tps),
                         "p25": metrics.percentile(tps, 25) if tps else math.nan,
                         "p75": metrics.percentile(tps, 75) if tps else math.nan},
        "speedup": metrics.median(ratios),
        "speedup_iqr": metrics.iqr(ratios),
        "speedup_ratios": ratios,
        "acceptance": accepted / drafted if drafted else 0.0,
        "acceptance_fit": metrics.fit_acceptance(dpp, app) if drafted else math.nan,
        "mean_accepted_length": 1.0 + accepted / steps if steps else 0.0,
        "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(app, dpp)],
        "drafted_per_position": dpp,
        "accepted_per_position": app,
        "drafted": drafted,
        "accepted": accepted,
        "steps": steps,
        "k_chosen": {str(k): n for k, n in sorted(k_chosen.items())},
        "time_split": {"draft": sum(r.draft_s for r in runs) / split_total if split_total else 0.0,
                       "verify": sum(r.verify_s for r in runs) / split_total if split_total else 0.0,
                       "overhead": sum(r.overhead_s for r in runs) / split_total if split_total else 0.0},
        "seconds": {"prefill": sum(r.prefill_s for r in runs), "draft": sum(r.draft_s for r in runs),
                    "verify": sum(r.verify_s for r in runs), "overhead": sum(r.overhead_s for r in runs),
                    "total": sum(r.total_s for r in runs)},
        "ttft_ms": metrics.median(r.ttft_s for r in runs) * ms,
        "itl_token_ms": {"p50": metrics.percentile(token_gaps, 50) * ms if token_gaps else math.nan,
                         "p95": metrics.percentile(token_gaps, 95) * ms if token_gaps else math.nan},
        "itl_block_ms": {"p50": metrics.percentile(block_gaps, 50) * ms if block_gaps else math.nan,
                         "p95": metrics.percentile(block_gaps, 95) * ms if block_gaps else math.nan},
        "near_ties": sum(r.near_ties for r in runs),
        "mode_s": mode_s,
        # The default policy's steps by source: strong lookups, guesses, draft model, plain.
        "sources": ({"lookup": sum(r.lookup_steps - r.guess_steps for r in runs),
                     "guess": sum(r.guess_steps for r in runs), "model": sum(r.model_steps for r in runs),
                     "plain": steps - sum(r.lookup_steps + r.model_steps for r in runs)}
                    if any(r.lookup_steps or r.model_steps for r in runs) else {}),
        # What a token cost by step source ("lookup", "model", "plain"), catch-ups included, in ms.
        "ms_per_token": _ms_per_token(runs),
        "rss_peak_mb": max((r.rss_peak_mb for r in runs), default=math.nan),
    }


def bound(cell: dict, config: BenchConfig, costs: dict) -> dict:
    """Leviathan's predicted speedup for a cell, next to the measured one.

    ``a``: the i.i.d. acceptance fitted to the per-position counts; ``c``: a draft
    token over a target 1-token step (the micro-benchmark's draft forward for the model
    drafter; for ngram and composite the run's own draft seconds per drafted token,
    which for composite includes the draft model's prompt prefill); ``v(k)``: target
    (k+1)-token step over its 1-token step.
    """
    step1 = costs["target_s"].get(1)
    if not config.speculative or not step1 or not cell["drafted"]:
        return {"a": None, "c": None, "v": {}, "predicted": None, "efficiency": None}
    a = cell["acceptance_fit"]
    if config.drafter == "model" and costs.get("c_model"):
        c = costs["c_model"]
    else:
        c = (cell["seconds"]["draft"] / cell["drafted"]) / step1
    k_steps = {int(k): n for k, n in cell["k_chosen"].items()}
    v = {k: costs["v"][k] for k in k_steps if k and k in costs["v"]}
    if any(k and k not in v for k in k_steps):
        return {"a": a, "c": c, "v": v, "predicted": None, "efficiency": None}
    predicted = metrics.predicted_speedup(a, k_steps, c, v)
    measured = cell["speedup"]
    return {"a": a, "c": c, "v": {str(k): x for k, x in sorted(v.items())}, "predicted": predicted,
            "efficiency": measured / predicted if predicted and not math.isnan(measured) else None}


# ----------------------------------------------------------------------------- the run
def _record(result, workload: Workload, config: str, round_: int, rss: float) -> RunRecord:
    s = result.stats
    return RunRecord(workload=workload.id, category=workload.category, config=config, round=round_,
                     tokens=list(result.token_ids), token_times_s=list(s.token_times_s),
                     tokens_per_s=s.tokens_per_s, new_tokens=s.new_tokens, finish_reason=result.finish_reason,
                     ttft_s=s.time_to_first_token_s, prefill_s=s.prefill_s, draft_s=s.draft_s,
                     verify_s=s.verify_s, overhead_s=s.overhead_s, total_s=s.total_s, steps=s.steps,
                     drafted=s.drafted, accepted=s.accepted, drafted_per_position=list(s.drafted_per_position),
                     accepted_per_position=list(s.accepted_per_position), k_chosen=dict(s.k_chosen),
                     near_ties=s.near_ties, mode_s=dict(s.mode_s), rss_peak_mb=rss,
                     lookup_steps=int(s.policy.get("lookup_steps", 0)), guess_steps=int(s.policy.get("guess_steps", 0)),
                     model_steps=int(s.policy.get("model_steps", 0)),
                     source_s=dict(s.source_s), source_tokens=dict(s.source_tokens))


def check_outputs(runs: list[RunRecord], exact_configs: set[str],
                  explain: Callable[[str, list[int], list[int]], Divergence | None]) -> list[dict]:
    """Compare every run's greedy tokens with its reference; one entry per difference.

    A run in exact mode (``exact_configs``) must equal ``baseline-exact``'s first round token for token:
    any difference is a "divergence", a failure. Every other run (fast mode, and ``baseline-exact`` itself)
    is compared with ``baseline``'s first round; there a difference is allowed only at a near tie.
    ``explain(workload, reference, other)`` measures the target's top-2 gap at the first divergence
    (runtime/divergence.py): below the bundle's near-tie gap it is a "near-tie divergence" (counted,
    not a failure), otherwise a "divergence".
    """
    first = {(r.config, r.workload): r for r in runs if r.config in BASELINES and r.round == 0}
    failures = []
    for r in runs:
        exact = r.config in exact_configs and r.config != BASELINE_EXACT
        ref = first.get((BASELINE_EXACT if exact else BASELINE, r.workload))
        if ref is None or r is ref:
            continue
        index = first_divergence(ref.tokens, r.tokens)
        if index is None:
            continue
        found = None if exact else explain(r.workload, ref.tokens, r.tokens)
        kind = "near-tie divergence" if found is not None and found.near_tie else "divergence"
        failures.append({
            "workload": r.workload, "category": r.category, "config": r.config, "round": r.round,
            "reference": ref.config, "first_divergence": index,
            "baseline_token": ref.tokens[index] if index < len(ref.tokens) else None,
            "config_token": r.tokens[index] if index < len(r.tokens) else None,
            "baseline_tokens": len(ref.tokens), "config_tokens": len(r.tokens), "near_ties": r.near_ties,
            "top2_gap": None if found is None else found.top2_gap,
            "near_tie_gap": None if found is None else found.threshold, "kind": kind})
    return failures


class PartialLog:
    """Appends one JSON object per line to ``path`` and flushes it at once (no-op when path is None)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("", encoding="utf-8")

    def __call__(self, event: dict) -> None:
        if self.path is None:
            return
        import json

        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event, default=str) + "\n")
            f.flush()


def _bundle_name(bundle: Path) -> str:
    return bundle.resolve().name or "bundle"


def run_bench(settings: BenchSettings) -> dict:
    """Run the whole bench; returns the result document (see report.check_schema)."""
    from ..runtime.generator import Generator
    from ..runtime.suffix import ReplyMemory
    from ..runtime.suffix_drafter import DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS

    started = datetime.now(timezone.utc)
    suite = load_suite(settings.suite_path) if settings.suite_path else load_suite()
    selected = suite.select(list(settings.categories) if settings.categories else None, settings.per_category)
    log = Progress(0, enabled=settings.progress)
    partial = PartialLog(settings.partial_path)
    partial({"event": "start", "started_utc": started.isoformat(timespec="seconds"),
             "command": settings.command or shlex.join(sys.argv), "bundle": str(settings.bundle),
             "machine": machine_info()})
    load_start = machine_info()["load_average"]
    reset_peak_rss()
    t_load = time.perf_counter()
    gen = Generator.from_bundle(settings.bundle, threads=settings.threads,
                                verify_checksums=settings.verify_checksums)
    load_s = time.perf_counter() - t_load
    rss_after_load = peak_rss_mb()
    manifest = gen.manifest
    spec = manifest.speculation
    quantized = manifest.target.precision != "fp32"
    configs, notes = expand_configs(settings.configs, has_draft=gen.draft is not None,
                                    max_draft_tokens=spec.max_draft_tokens, k_sweep=settings.k_sweep)

    # Encode; skip what cannot fit (prompt + generation + one verify block of max k + 1).
    room = settings.max_new_tokens + spec.max_draft_tokens + 1
    workloads: list[tuple[Workload, list[int], bool]] = []
    for w in selected:
        ids, used_chat = w.encode(gen)
        if len(ids) + room > gen.max_context:
            notes.append(f"{w.id}: skipped, {len(ids)} prompt tokens + {room} do not fit max_context "
                         f"{gen.max_context}")
            continue
        workloads.append((w, ids, used_chat))
    if not workloads:
        raise_no_work(notes)

    # Warm-up: every session shape, then every configuration once.
    gen.warmup()
    w0, ids0, chat0 = workloads[0]
    for config in configs:
        gen.generate(input_ids=ids0, config=config.generation_config(min(settings.warmup_tokens,
                                                                         settings.max_new_tokens), chat0))

    # Step costs at the median prompt length.
    lengths = sorted({k + 1 for k in range(1, max([spec.max_draft_tokens, *settings.k_sweep]) + 1)})
    median_len = int(np.median([len(ids) for _, ids, _ in workloads]))
    probe = next((ids for _, ids, _ in workloads if len(ids) >= median_len), ids0)[:median_len]
    step_costs = StepCosts(gen, probe, lengths)
    reps_per_prompt = max(1, -(-settings.micro_reps // len(workloads)))  # ceil: micro_reps in all, at least

    # Interleaved rounds.
    total = len(workloads) * settings.repeats * len(configs)
    bar = Progress(total, title="specedge bench", enabled=settings.progress)
    runs: list[RunRecord] = []
    category = None
    replies: dict[tuple[str, int], ReplyMemory] = {}
    for w, ids, used_chat in workloads:
        if w.category != category:
            # Each workload is scored as its own deployment: what the Generator learned from
            # another kind of traffic (draft acceptance, reply lengths) would mislead it here.
            gen.forget_replies()
            replies.clear()
            category = w.category
        step_costs.sample(reps_per_prompt)
        for r in range(settings.repeats):
            order = configs if r % 2 == 0 else list(reversed(configs))
            for config in order:
                # Cross-reply memory per (configuration, round): a reply is drafted only from the
                # replies this configuration gave to the workload's earlier prompts in this round,
                # never from another configuration's identical reply to this prompt, nor from
                # this prompt's earlier rounds (either would be a replay no caller makes).
                gen.memory.replies = replies.setdefault((config.name, r), ReplyMemory(DEFAULT_DEPTH,
                                                                                      DEFAULT_MEMORY_TOKENS))
                reset_peak_rss()
                result = gen.generate(input_ids=ids, config=config.generation_config(settings.max_new_tokens,
                                                                                      used_chat))
                runs.append(_record(result, w, config.name, r, peak_rss_mb()))
                partial({"event": "run", **runs[-1].summary()})
                bar.advance(f"{w.id} {config.name}")
    bar.close()
    rss_specedge = process_peak_rss_mb()
    costs = step_costs.result()

    prompt_ids = {w.id: ids for w, ids, _ in workloads}
    failures = check_outputs(runs, {c.name for c in configs if c.exact},
                             lambda workload, ref, other: explain_divergence(
                                 gen.target.inner, prompt_ids[workload], ref, other, near_tie=gen.near_tie_gap))
    baseline = {(r.workload, r.round): r for r in runs if r.config == BASELINE}
    categories = []
    for w, _, _ in workloads:
        if w.category not in categories:
            categories.append(w.category)
    by_category: dict[str, dict] = {}
    for category in categories:
        cells = {}
        for config in configs:
            cell_runs = [r for r in runs if r.category == category and r.config == config.name]
            cell = aggregate(cell_runs, baseline)
            cell["bound"] = bound(cell, config, costs)
            cell["failures"] = sum(1 for f in failures if f["category"] == category and f["config"] == config.name)
            cells[config.name] = cell
        by_category[category] = {
            "prompts": [{"id": w.id, "kind": w.kind, "source": w.source, "prompt_tokens": len(ids),
                         "chat_template": used_chat,
                         "baseline_text": gen.codec.decode(next(r.tokens for r in runs if r.workload == w.id
                                                                and r.config == BASELINE))[:400]}
                        for w, ids, used_chat in workloads if w.category == category],
            "configs": cells,
        }

    peers: dict = {}
    if settings.peers:
        from .peers import run_peers

        partial({"event": "specedge_done", "best": best_configs(by_category)})
        peers = run_peers(settings, gen, workloads, runs, best_configs(by_category), log,
                          on_event=lambda e: partial({"event": "peer", **e}))
    hard = [f for f in failures if f["kind"] == "divergence"]
    machine = machine_info()
    machine["load_average_end"] = machine.pop("load_average")
    machine["load_average_start"] = load_start
    doc = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "date": started.strftime("%Y-%m-%d"),
        "started_utc": started.isoformat(timespec="seconds"),
        "command": settings.command or shlex.join(sys.argv),
        "machine": machine,
        "bundle": {"path": str(settings.bundle), "name": _bundle_name(settings.bundle),
                   "target": {"source": manifest.target.source, "precision": manifest.target.precision,
                              "architecture": manifest.target.architecture, "n_layers": manifest.target.n_layers,
                              "hidden_size": manifest.target.hidden_size},
                   "draft": None if manifest.draft is None else {
                       "source": manifest.draft.source, "precision": manifest.draft.precision,
                       "n_layers": manifest.draft.n_layers, "hidden_size": manifest.draft.hidden_size},
                   "quantized": quantized, "max_context": gen.max_context,
                   "speculation_defaults": {"drafter": spec.drafter, "draft_tokens": spec.draft_tokens,
                                            "max_draft_tokens": spec.max_draft_tokens, "adaptive": spec.adaptive}},
        "settings": {"categories": categories, "per_category": settings.per_category,
                     "max_new_tokens": settings.max_new_tokens, "repeats": settings.repeats,
                     "configs": [c.name for c in configs], "k_sweep": list(settings.k_sweep),
                     "threads": settings.threads, "warmup_tokens": settings.warmup_tokens,
                     "micro_reps": settings.micro_reps, "quick": settings.quick, "peers": list(settings.peers),
                     "peer_repeats": settings.peer_repeats,
                     "suite": suite.name, "prompts": [w.id for w, _, _ in workloads]},
        "load_s": load_s,
        "memory": {"rss_after_load_mb": rss_after_load, "rss_peak_specedge_mb": rss_specedge,
                   "rss_peak_process_mb": process_peak_rss_mb()},
        "step_costs": {"prompt_tokens": costs["prompt_tokens"], "reps": costs["reps"], "method": "spread",
                       "target_s": {str(n): s for n, s in sorted(costs["target_s"].items())},
                       "draft_token_s": costs["draft_token_s"],
                       "v": {str(k): x for k, x in sorted(costs["v"].items())},
                       "c_model": costs["c_model"], "exact_step": costs["exact_step"]},
        "workloads": by_category,
        "failures": failures,
        "notes": notes,
        "peers": peers,
        "runs": [r.summary() for r in runs],
        "summary": {"failures": len(hard),
                    "near_tie_divergences": sum(1 for f in failures if f["kind"] == "near-tie divergence"),
                    "near_tie_gap": gen.near_tie_gap,
                    "exit_code": 1 if hard else 0, "best": best_configs(by_category)},
    }
    return doc


def best_configs(by_category: dict) -> dict:
    """Per category: the speculative configuration with the highest median speedup."""
    out = {}
    for category, entry in by_category.items():
        cells = {n: c for n, c in entry["configs"].items()
                 if n not in BASELINES and not math.isnan(c["speedup"])}
        base = entry["configs"][BASELINE]["tokens_per_s"]["median"]
        if not cells:
            out[category] = {"config": None, "speedup": None, "baseline_tokens_per_s": base}
            continue
        name = max(cells, key=lambda n: cells[n]["speedup"])
        out[category] = {"config": name, "speedup": cells[name]["speedup"],
                         "tokens_per_s": cells[name]["tokens_per_s"]["median"], "baseline_tokens_per_s": base}
    return out


def raise_no_work(notes: list[str]) -> None:
    from ..errors import InvalidParameterError

    raise InvalidParameterError("no prompt to run: " + "; ".join(notes[-3:] or ["the selection is empty"]))
