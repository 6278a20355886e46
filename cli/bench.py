"""``specedge bench``: baseline vs speculation vs peer runtimes on the shipped prompt suite.

Only parses options and calls specedge.bench; the library does the work.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from ..runtime.drafters import DRAFTERS

QUICK = {"per_category": 1, "max_new_tokens": 16, "repeats": 1, "warmup_tokens": 4, "micro_reps": 3}
QUICK_K = (4,)


def _csv(value: str | None) -> tuple[str, ...] | None:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else None


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--workloads", default=None, help="Categories, comma separated: code,chat,grounded,voice,hostile "
              "(default: all).")
@click.option("--prompts", "per_category", type=int, default=None, help="Prompts per category (default: all; "
              "--quick: 1).")
@click.option("--max-new-tokens", type=int, default=None, help="Tokens per generation (default 64; --quick: 16).")
@click.option("--repeats", type=int, default=None, help="Rounds per prompt (default 3; --quick: 1).")
@click.option("--configs", default=None, help=f"Comma list: baseline, {'|'.join(DRAFTERS)} (its k sweep + "
              "adaptive), <drafter>-k<k>, <drafter>-adaptive, or all (default).")
@click.option("--k-sweep", default=None, help="Fixed k values for a bare drafter name (default 2,4,6,8; "
              "--quick: 4).")
@click.option("--threads", type=int, default=0, show_default=True,
              help="Intra-op threads per session, and for the peers (0 = ORT default).")
@click.option("--peers", default=None, help="Comma list of peer runtimes: hf,genai,llamacpp (skipped with a "
              "message when absent).")
@click.option("--peer-repeats", type=int, default=1, show_default=True,
              help="Rounds per prompt for the peers (each round also reruns our baseline and best configuration).")
@click.option("--hf-target", default=None, help="HF folder of the target for the peers (default: the "
              "exporter's converted folder for the bundle's source).")
@click.option("--hf-draft", default=None, help="HF folder of the draft, for HF assisted generation.")
@click.option("--gguf", default=None, help="GGUF file for llama.cpp (default: the catalog file the target "
              "came from).")
@click.option("--genai-precision", default="int4", show_default=True,
              help="onnxruntime-genai builder precision(s), comma separated (int4, int8, fp32).")
@click.option("--lookup-tokens", type=int, default=None,
              help="Draft length for the peers' n-gram modes (default: the bundle's max_draft_tokens).")
@click.option("--json", "json_out", default=None, is_flag=False, flag_value="-",
              help="Write the JSON result to PATH (bare --json: to stdout, instead of the table).")
@click.option("--plot", "plot_out", type=click.Path(path_type=Path), default=None,
              help="Write a PNG: speedup vs k per workload, acceptance per position (needs matplotlib).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Results files: a folder (gets <date>-<bundle>.md/.json) or a path stem.")
@click.option("--quick", is_flag=True, help="A smoke run: 1 prompt per category, 16 tokens, 1 round, k=4 and "
              "adaptive per drafter.")
@click.option("--suite", type=click.Path(path_type=Path), default=None, help="Another prompt suite JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
@click.option("--no-verify-checksums", is_flag=True, help="Skip sha256 checks of bundle files at load.")
def bench(bundle: Path, workloads, per_category, max_new_tokens, repeats, configs, k_sweep, threads, peers,
          peer_repeats, hf_target, hf_draft, gguf, genai_precision, lookup_tokens, json_out, plot_out, out, quick,
          suite, no_progress, no_verify_checksums) -> None:
    """Benchmark BUNDLE: plain decoding vs every drafter, k sweep and adaptive k, and peer runtimes.

    Runs are interleaved after a warm-up; speedups are medians of paired ratios. Every
    speculative output is checked against the baseline token for token: any difference
    fails the bench (exit 1), except near-tie divergences on a quantized target, which are
    reported as such.
    """
    from ..bench.report import plot, render_markdown, to_json, write_results
    from ..bench.runner import BenchSettings, run_bench
    from ..errors import InvalidParameterError

    defaults = dict(QUICK) if quick else {"per_category": None, "max_new_tokens": 64, "repeats": 3,
                                          "warmup_tokens": 16, "micro_reps": 10}
    given = {"per_category": per_category, "max_new_tokens": max_new_tokens, "repeats": repeats}
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    if values["repeats"] < 1 or values["max_new_tokens"] < 1:
        raise InvalidParameterError("--repeats and --max-new-tokens must be >= 1")
    try:
        sweep = tuple(int(k) for k in _csv(k_sweep)) if k_sweep else (QUICK_K if quick else (2, 4, 6, 8))
    except ValueError:
        raise InvalidParameterError(f"--k-sweep must be integers, comma separated; got {k_sweep!r}") from None
    if quick and configs is None:
        configs = "all"
    settings = BenchSettings(
        bundle=bundle, categories=_csv(workloads), per_category=values["per_category"],
        max_new_tokens=values["max_new_tokens"], repeats=values["repeats"], configs=configs, k_sweep=sweep,
        threads=threads, warmup_tokens=values["warmup_tokens"], micro_reps=values["micro_reps"],
        peers=_csv(peers) or (), peer_repeats=peer_repeats, quick=quick, suite_path=suite, progress=not no_progress,
        verify_checksums=not no_verify_checksums, command=shlex.join(["specedge", "bench", *sys.argv[2:]])
        if len(sys.argv) > 1 and sys.argv[1] == "bench" else shlex.join(sys.argv),
        peer_options={"hf_target": hf_target, "hf_draft": hf_draft, "gguf": gguf, "lookup_tokens": lookup_tokens,
                      "genai_precision": _csv(genai_precision) or ("int4",)})
    doc = run_bench(settings)
    if out is not None:
        md, js = write_results(doc, out)
        click.echo(f"results: {md} and {js}", err=True)
    if plot_out is not None:
        click.echo(f"plot: {plot(doc, plot_out)}", err=True)
    if json_out == "-":
        click.echo(to_json(doc))
    else:
        if json_out:
            Path(json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(json_out).write_text(to_json(doc) + "\n", encoding="utf-8")
        click.echo(render_markdown(doc))
    summary = doc["summary"]
    if summary["failures"]:
        click.secho(f"FAILED: {summary['failures']} speculative run(s) differ from the baseline", fg="red", err=True)
    elif summary["near_tie_divergences"]:
        click.echo(f"note: {summary['near_tie_divergences']} near-tie divergence(s) on a quantized target", err=True)
    sys.exit(summary["exit_code"])
