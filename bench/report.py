"""Rendering a bench result: the markdown tables, the JSON file, the plot, the results files."""

from __future__ import annotations

import json
import re
import math
from pathlib import Path

from ..errors import InvalidParameterError
from .configs import BASELINE, BASELINE_EXACT, BASELINES, SPEC_DRAFTERS
from .runner import SCHEMA, SCHEMA_VERSION

DEFINITIONS = """\
- **tok/s**: decode throughput of one run, tokens after the first over the time after the first
  (`GenerationStats.tokens_per_s`); median over prompts x rounds, IQR = p75 - p25.
- **speedup**: median over (prompt, round) of tok/s(config) / tok/s(baseline) in the same round.
  Rounds run every configuration once, in reversed order on odd rounds, so drift cancels in the ratios.
- **acc**: accepted / drafted draft tokens. **a**: the i.i.d. per-token acceptance fitted to the
  per-position counts (sum_i drafted[i] a^(i+1) = accepted). **acc/pos**: fraction of steps that drafted
  position i whose tokens up to i were all accepted. **mal**: mean accepted length, tokens per target step.
- **steps l/g/m/p**: the default policy's steps by source, in % of its steps: a lookup, a guess (one
  token after a 1-token match), the draft model, plain (empty for other configurations).
- **ms/tok l/m/p**: what a committed token cost, by the source of its step (any configuration): the
  steps' time (draft, its catch-up, verify) over the tokens they committed, in ms; "-" where no step
  had that source. Compare them with each other in one row: a source above the plain cost lost time.
- **split**: draft / verify / overhead share of the decode time (after the first token).
- **ITL tok**: per-token gaps a streaming client sees, t_i - t_(i-1); tokens of one block arrive together
  (gap 0). **ITL blk**: gaps between consecutive blocks (distinct arrival times). p50/p95 in ms.
- **RSS**: peak resident memory of the process during the run (VmHWM, reset before each run), in MB.
- **pred**: Leviathan's bound (1 - a^(k+1)) / ((1 - a)(k c + v(k))) from a, c = draft token time / target
  1-token step and v(k) = target (k+1)-token step / 1-token step, mixed over the k the run chose.
  **eff** = measured speedup / predicted.
- **best config**: the speculative configuration with the highest median speedup on that workload. It is
  picked from noisy estimates, so expect it to be optimistic by about its IQR.
- **baseline**: plain decoding with 1-row steps, as ONNX Runtime GenAI and llama.cpp decode and as the
  runtime does by default; every speedup divides by it. **baseline-exact**: plain decoding with exact
  2-row steps (engines/invariant.py); its speedup below 1x is what exactness costs.
- **failures**: runs whose greedy tokens differ from their reference's first round, with the first
  differing index. Fast-mode runs (the default) are compared with `baseline`: a difference where the
  target's top-2 logit gap at the first differing position is below the bundle's near-tie gap (measured
  there, runtime/divergence.py) is a near-tie divergence, counted and not a failure; any other difference
  fails. Exact-mode runs (`-exact` configurations) are compared with `baseline-exact` and must equal it
  token for token.
"""
PEER_DEFINITIONS = """\
- **peers**: each gets our prompt token ids and is asked for as many tokens as our baseline produced; tok/s
  has our definition. **ours / peer** ratios use our runs (plain, and the workload's best configuration)
  interleaved with the peer's, per prompt, median over prompts. **same text**: share of prompts whose peer
  tokens equal our baseline's. Each peer runs in its own process in its default configuration: the bench
  sets no environment variable for it (no OpenMP wait policy); only the thread count is the bench's
  (`--threads`, or every core), passed as the peer's own thread option. Where that differs from the peer's
  own default, its plain decoding also runs at its default (`…@own-threads(n)`), so each ratio is given
  both ways: at the shared thread count and against the peer out of the box. A peer that crashes is
  reported with its signal and last stderr lines; the specedge results are written regardless.
"""


# ----------------------------------------------------------------------------- JSON
def clean(obj):
    """JSON-safe copy: NaN/inf become null, tuple keys and values plain types."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def to_json(doc: dict) -> str:
    return json.dumps(clean(doc), indent=2, allow_nan=False, ensure_ascii=False)


_CELL_KEYS = ("runs", "tokens_per_s", "speedup", "acceptance", "acceptance_fit", "mean_accepted_length",
              "acceptance_per_position", "k_chosen", "time_split", "ttft_ms", "itl_token_ms", "itl_block_ms",
              "rss_peak_mb", "near_ties", "bound", "failures")
_TOP_KEYS = {"schema": str, "schema_version": int, "date": str, "command": str, "machine": dict, "bundle": dict,
             "settings": dict, "step_costs": dict, "workloads": dict, "failures": list, "notes": list,
             "peers": dict, "runs": list, "summary": dict, "memory": dict}


def check_schema(doc: dict) -> None:
    """Raise InvalidParameterError naming the first field that does not match the bench schema."""
    for key, kind in _TOP_KEYS.items():
        if not isinstance(doc.get(key), kind):
            raise InvalidParameterError(f"bench result field {key!r} must be {kind.__name__}")
    if doc["schema"] != SCHEMA or doc["schema_version"] != SCHEMA_VERSION:
        raise InvalidParameterError(f"not a {SCHEMA} v{SCHEMA_VERSION} document")
    for key in ("cpu", "cores", "ram_gb", "onnxruntime"):
        if key not in doc["machine"]:
            raise InvalidParameterError(f"bench result field 'machine.{key}' is missing")
    for category, entry in doc["workloads"].items():
        if BASELINE not in entry.get("configs", {}):
            raise InvalidParameterError(f"workload {category!r} has no baseline")
        for name, cell in entry["configs"].items():
            missing = [k for k in _CELL_KEYS if k not in cell]
            if missing:
                raise InvalidParameterError(f"workloads.{category}.configs.{name} lacks {missing}")
        for p in entry.get("prompts", []):
            if not p.get("source"):
                raise InvalidParameterError(f"prompt {p.get('id')!r} has no source")
    for f in doc["failures"]:
        for key in ("workload", "config", "round", "first_divergence", "kind"):
            if key not in f:
                raise InvalidParameterError(f"failure entry lacks {key!r}")
    for key in ("failures", "near_tie_divergences", "exit_code", "best"):
        if key not in doc["summary"]:
            raise InvalidParameterError(f"bench result field 'summary.{key}' is missing")


# ----------------------------------------------------------------------------- markdown
def _f(x, digits: int = 1, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}{suffix}"


def _k_hist(k_chosen: dict) -> str:
    items = sorted(k_chosen.items(), key=lambda kv: -kv[1])
    total = sum(n for _, n in items) or 1
    return " ".join(f"{k}:{round(100 * n / total)}%" for k, n in items[:3])


def _sources(sources: dict) -> str:
    """The default policy's steps by source, as shares: lookup/guess/model/plain (empty for others)."""
    total = sum(sources.values())
    if not total:
        return ""
    return "/".join(_f(100 * sources.get(key, 0) / total, 0) for key in ("lookup", "guess", "model", "plain"))


def _by_source_ms(ms_per_token: dict) -> str:
    """What a token cost per step source, lookup/model/plain in ms ("-": no such steps)."""
    if not ms_per_token:
        return ""
    return "/".join(_f(ms_per_token[key], 0) if key in ms_per_token else "-" for key in ("lookup", "model", "plain"))


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(doc: dict) -> str:
    """The human report: summary, per-workload tables, correctness, peers, definitions."""
    doc = clean(doc)
    m, b, s, costs = doc["machine"], doc["bundle"], doc["settings"], doc["step_costs"]
    out = [f"# specedge bench: {b['name']}", ""]
    out.append(f"- date: {doc['date']} ({doc.get('started_utc', '')} UTC)")
    out.append(f"- command: `{doc['command']}`")
    out.append(f"- machine: {m['cpu']}, {m['cores']} cores ({m.get('usable_cores')} usable), {m['ram_gb']} GB RAM, "
               f"{m.get('os', '')}; python {m.get('python')}, onnxruntime {m['onnxruntime']}, "
               f"numpy {m.get('numpy')}, specedge {m.get('specedge')}; load average (1/5/15 min) at start "
               f"{m.get('load_average_start')}, at end {m.get('load_average_end')}"
               + (f"; huge pages: {m['huge_pages']}" if m.get("huge_pages") else ""))
    draft = b.get("draft")
    out.append(f"- bundle: `{b['path']}`: target {b['target']['source']} ({b['target']['precision']}), draft "
               + (f"{draft['source']} ({draft['precision']})" if draft else "none")
               + f"; quantized target: {'yes' if b['quantized'] else 'no'}")
    out.append(f"- settings: {len(s['prompts'])} prompts ({s['per_category'] or 'all'} per category), "
               f"max_new_tokens {s['max_new_tokens']}, repeats {s['repeats']}, threads {s['threads'] or 'ORT default'}"
               f", {len(s['configs'])} configurations" + (", --quick" if s.get("quick") else ""))
    step1 = costs["target_s"].get("1")
    v = costs.get("v", {})
    how = ("reps spread over the bench; v and c are medians of ratios paired within a rep"
           if costs.get("method") == "spread" else "reps in one batch after the warm-up")
    out.append(f"- step costs at {costs['prompt_tokens']} cached tokens ({costs['reps']} {how}): target 1-token "
               f"step {_f(step1 and step1 * 1e3, 2)} ms; v(k) " + ", ".join(f"{k}:{_f(x, 2)}" for k, x in v.items()
                                                                             if k != "0")
               + (f"; draft token {_f(costs['draft_token_s'] * 1e3, 2)} ms (c = {_f(costs['c_model'], 2)})"
                  if costs.get("draft_token_s") else ""))
    mem = doc["memory"]
    out.append(f"- memory: {_f(mem['rss_after_load_mb'], 0)} MB after load, peak {_f(mem['rss_peak_specedge_mb'], 0)} "
               f"MB during the specedge runs, {_f(mem['rss_peak_process_mb'], 0)} MB with peers")
    out.append("")

    # Summary
    peer_cols = []
    for peer, res in doc["peers"].items():
        for cfg in (res.get("configs") or {}):
            peer_cols.append((peer, cfg))
    default = f"{b['speculation_defaults']['drafter']}-adaptive"
    header = ["workload", "baseline tok/s", "best config", "tok/s", "speedup", f"default ({default}) speedup"]
    header += [f"{cfg} tok/s (ours/them)" for _, cfg in peer_cols]
    rows = []
    for category, best in doc["summary"]["best"].items():
        default_cell = doc["workloads"][category]["configs"].get(default)
        row = [category, _f(best.get("baseline_tokens_per_s")), best.get("config") or "–",
               _f(best.get("tokens_per_s")), _f(best.get("speedup"), 2, "x"),
               _f(default_cell["speedup"], 2, "x") if default_cell else "–"]
        for peer, cfg in peer_cols:
            cell = doc["peers"][peer]["configs"][cfg].get(category, {})
            row.append(f"{_f(cell.get('tokens_per_s', {}).get('median'))} ({_f(cell.get('ratio_best'), 2, 'x')})")
        rows.append(row)
    out += ["## Summary", "", _table(header, rows), ""]
    summary = doc["summary"]
    if summary["failures"]:
        out.append(f"**FAILED: {summary['failures']} run(s) differ from their baseline outside a near tie** "
                   "(see Correctness).")
    elif summary["near_tie_divergences"]:
        out.append(f"{summary['near_tie_divergences']} near-tie divergence(s) from 1-row plain decoding (top-2 gap "
                   f"below the bundle's {_f(summary.get('near_tie_gap'), 4)}), no other difference.")
    else:
        out.append("Every run's greedy output equals its baseline's, token for token.")
    out.append("")
    exact_plain = {c: e["configs"][BASELINE_EXACT]["speedup"] for c, e in doc["workloads"].items()
                   if BASELINE_EXACT in e["configs"]}
    if exact_plain:
        out += ["**What exactness costs** (exact 2-row plain decoding, `baseline-exact`, over 1-row `baseline`, "
                "median of paired ratios): " + ", ".join(f"{c} {_f(x, 2, 'x')}" for c, x in exact_plain.items()), ""]

    # Per workload
    header = ["config", "tok/s (IQR)", "speedup", "acc", "a", "mal", "acc/pos", "k chosen", "steps l/g/m/p %",
              "ms/tok l/m/p", "split d/v/o %", "TTFT ms", "ITL tok p50/p95", "ITL blk p50/p95", "RSS MB", "pred", "eff"]
    for category, entry in doc["workloads"].items():
        out += [f"## {category} ({len(entry['prompts'])} prompt{'s' if len(entry['prompts']) != 1 else ''}: "
                + ", ".join(p["id"] for p in entry["prompts"]) + ")", ""]
        rows = []
        for name, c in entry["configs"].items():
            split = c["time_split"]
            bnd = c.get("bound") or {}
            spec = name not in BASELINES
            tps = c["tokens_per_s"]
            rows.append([
                name + (" ✗" if c.get("failures") else ""),
                f"{_f(tps['median'])} ({_f(tps['iqr'])})",
                _f(c["speedup"], 2, "x"),
                _f(c["acceptance"], 2) if spec else "",
                _f(c["acceptance_fit"], 2) if spec else "",
                _f(c["mean_accepted_length"], 2) if spec else "",
                " ".join(_f(x, 2) for x in c["acceptance_per_position"]) if spec else "",
                _k_hist(c["k_chosen"]) if spec else "",
                _sources(c.get("sources") or {}),
                _by_source_ms(c.get("ms_per_token") or {}),
                f"{_f(100 * split['draft'], 0)}/{_f(100 * split['verify'], 0)}/{_f(100 * split['overhead'], 0)}",
                _f(c["ttft_ms"], 0),
                f"{_f(c['itl_token_ms']['p50'])}/{_f(c['itl_token_ms']['p95'])}",
                f"{_f(c['itl_block_ms']['p50'])}/{_f(c['itl_block_ms']['p95'])}",
                _f(c["rss_peak_mb"], 0),
                _f(bnd.get("predicted"), 2, "x") if spec else "",
                _f(bnd.get("efficiency"), 2) if spec else "",
            ])
        out += [_table(header, rows), ""]

    # Correctness
    out += ["## Correctness", ""]
    if doc["failures"]:
        rows = [[f["workload"], f["config"], str(f["round"]), f.get("reference", BASELINE), str(f["first_divergence"]),
                 f"{f.get('baseline_token')} vs {f.get('config_token')}", _f(f.get("top2_gap"), 4),
                 _f(f.get("near_tie_gap"), 4), f["kind"]]
                for f in doc["failures"]]
        out += [_table(["prompt", "config", "round", "reference", "first divergence", "tokens (reference vs config)",
                        "top-2 gap there", "near-tie gap", "kind"], rows), ""]
    else:
        n = sum(1 for r in doc["runs"] if r["config"] != BASELINE)
        out += [f"All {n} runs other than the baseline (and every baseline repeat) produced their baseline's "
                "tokens.", ""]

    # Peers
    if doc["peers"]:
        out += ["## Peers", ""]
        for peer, res in doc["peers"].items():
            if "skipped" in res:
                out += [f"- **{peer}**: skipped: {res['skipped']}", ""]
                continue
            if "crashed" in res:
                crash = res["crashed"]
                how = crash["signal"] or f"exit status {crash['returncode']}"
                out += [f"- **{peer}**: CRASHED ({how}) after {len(res.get('runs', []))} run(s); the specedge "
                        "results above are complete. Last lines of its stderr:", "", "```",
                        *crash["stderr_tail"], "```"]
            info = res.get("info", {})
            if info:
                out.append(f"**{peer}**: " + ", ".join(f"{k} {v}" for k, v in info.items()
                                                       if k not in ("configs", "build")))
            if info.get("build"):
                build = info["build"] if isinstance(info["build"], str) else " | ".join(info["build"])
                out.append(f"- build: `{build[:600]}`")
            for note in res.get("notes", []):
                out.append(f"- {note}")
            out.append("")
            if not res.get("configs"):
                continue
            rows = []
            for cfg, cells in res["configs"].items():
                for category, c in cells.items():
                    rows.append([category, cfg, f"{_f(c['tokens_per_s']['median'])} ({_f(c['tokens_per_s']['iqr'])})",
                                 _f(c["ttft_ms"], 0), _f(c["tokens"], 0),
                                 _f(c["same_text"] and 100 * c["same_text"], 0, "%"),
                                 f"{c.get('best_config') or '–'} {_f(c['ours_best_tokens_per_s'])} tok/s: "
                                 f"{_f(c['ratio_best'], 2, 'x')}",
                                 f"{_f(c['ours_baseline_tokens_per_s'])} tok/s: {_f(c['ratio_baseline'], 2, 'x')}"])
            out += [_table(["workload", "peer config", "tok/s (IQR)", "TTFT ms", "tokens", "same text as ours",
                            "ours best / peer", "our baseline / peer"], rows), ""]
    if doc["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    out += ["## Definitions", "", DEFINITIONS]
    if doc["peers"]:
        out.append(PEER_DEFINITIONS)
    return "\n".join(out)


# ----------------------------------------------------------------------------- files
def _names_a_folder(out: str | Path) -> bool:
    """An existing folder, or a path written with a trailing separator (kept only in a str: Path drops it)."""
    return Path(out).is_dir() or str(out).endswith(("/", "\\"))


def results_stem(out: str | Path, doc: dict) -> Path:
    """``out`` as a folder (existing, or ending in /) -> ``out/<date>-<bundle>``; else ``out`` without suffix."""
    folder, out = _names_a_folder(out), Path(out)
    if folder:
        out.mkdir(parents=True, exist_ok=True)
        return out / f"{doc['date']}-{doc['bundle']['name']}"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_suffix("") if out.suffix in (".md", ".json") else out


def partial_results_path(out: str | Path, bundle: Path) -> Path:
    """Where a bench run writing to ``out`` appends its JSON-lines partial results."""
    name = f"{bundle.resolve().name or 'bundle'}.partial.jsonl"
    folder, out = _names_a_folder(out), Path(out)
    if folder:
        out.mkdir(parents=True, exist_ok=True)
        return out / name
    return (out.with_suffix("") if out.suffix in (".md", ".json") else out).with_suffix(".partial.jsonl")


def write_results(doc: dict, out: str | Path) -> tuple[Path, Path]:
    """Write ``<stem>.md`` and ``<stem>.json``; returns both paths."""
    stem = results_stem(out, doc)
    md, js = stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")
    md.write_text(render_markdown(doc) + "\n", encoding="utf-8")
    js.write_text(to_json(doc) + "\n", encoding="utf-8")
    return md, js


# ----------------------------------------------------------------------------- plot
def plot(doc: dict, path: Path) -> Path:
    """Top: speedup of every configuration per workload (bars). Per drafter: speedup vs k
    (fixed-k sweep, dashed: adaptive) and acceptance per draft position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise InvalidParameterError("--plot needs matplotlib: pip install 'specedge[plot]'") from None
    doc = clean(doc)
    drafters = [d for d in SPEC_DRAFTERS
                if any(n.startswith(d + "-") for n in doc["settings"]["configs"])]
    if not drafters:
        raise InvalidParameterError("--plot needs at least one speculative configuration")
    fig = plt.figure(figsize=(max(5 * len(drafters), 10), 12))
    grid = fig.add_gridspec(3, len(drafters), height_ratios=[1.1, 1, 1])
    _plot_speedup_bars(fig.add_subplot(grid[0, :]), doc)
    for col, drafter in enumerate(drafters):
        ax_s, ax_a = fig.add_subplot(grid[1, col]), fig.add_subplot(grid[2, col])
        ks_seen = sorted({int(n.split("-k")[1]) for e in doc["workloads"].values() for n in e["configs"]
                          if re.fullmatch(rf"{drafter}-k\d+", n)})
        for i, (category, entry) in enumerate(doc["workloads"].items()):
            color = f"C{i}"
            fixed = sorted((int(n.split("-k")[1]), c) for n, c in entry["configs"].items()
                           if re.fullmatch(rf"{drafter}-k\d+", n))  # sequential fixed-k runs only
            ax_s.plot([k for k, _ in fixed], [c["speedup"] for _, c in fixed], "o-", color=color, label=category)
            adaptive = entry["configs"].get(f"{drafter}-adaptive")
            if adaptive and adaptive["speedup"] is not None:
                ax_s.axhline(adaptive["speedup"], color=color, ls="--", lw=1)
            # Acceptance per position from the longest fixed k, else from the adaptive run.
            source, label = (fixed[-1][1], f"k={fixed[-1][0]}") if fixed else (adaptive, "adaptive")
            app = (source or {}).get("acceptance_per_position") or []
            if app:
                ax_a.plot(range(1, len(app) + 1), app, "o-", color=color, label=f"{category} ({label})")
        if ks_seen:
            ax_s.set_xticks(ks_seen)
        else:
            ax_s.set_xticks([])
            ax_s.text(0.5, 0.06, "no fixed-k runs: dashed lines are adaptive k", transform=ax_s.transAxes,
                      ha="center", fontsize=8, color="grey")
        ax_a.xaxis.set_major_locator(MaxNLocator(integer=True))
        deepest = max((len(line.get_xdata()) for line in ax_a.lines), default=1)
        ax_a.set_xlim(0.5, deepest + 0.5)  # a single position would otherwise get a fractional axis
        ax_s.axhline(1.0, color="grey", lw=0.8)
        ax_s.set(title=f"{drafter}: speedup vs k (dashed: adaptive)", xlabel="k (draft tokens)",
                 ylabel="speedup vs baseline")
        ax_a.set(title=f"{drafter}: acceptance per draft position", xlabel="draft position",
                 ylabel="P(accepted up to here)", ylim=(0, 1.05))
        ax_s.legend(fontsize=8)
        if ax_a.lines:
            ax_a.legend(fontsize=8)
    fig.suptitle(f"specedge bench: {doc['bundle']['name']} ({doc['date']})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_speedup_bars(ax, doc: dict) -> None:
    """Grouped bars: median paired speedup of each configuration, per workload."""
    categories = list(doc["workloads"])
    configs = [n for n in doc["settings"]["configs"] if n != BASELINE]
    width = 0.8 / max(len(configs), 1)
    for j, name in enumerate(configs):
        values = [doc["workloads"][c]["configs"].get(name, {}).get("speedup") for c in categories]
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(categories))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=name, color=f"C{j}")
        for bar, v in zip(bars, values):
            if v is not None:
                ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set(title="speedup over plain decoding (median of paired rounds; 1.0 = the baseline)", ylabel="speedup")
    ax.legend(fontsize=7, ncol=min(len(configs), 6))
