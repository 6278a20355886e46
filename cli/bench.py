"""``specedge bench``: baseline vs speculation vs peer runtimes on the shipped prompt suite, and
the tuning tools ``specedge bench variants`` and ``specedge bench threads``.

Only parses options and calls specedge.bench; the library does the work.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import fields, replace
from pathlib import Path

import click

from ..bench.suite import CATEGORIES
from ..bench.threads import DEFAULT_SPINNING, SPINNING
from ..runtime.drafters import DRAFTERS
from .options import Local, load_from, load_options, shared_option

QUICK = {"per_category": 1, "max_new_tokens": 16, "repeats": 1, "warmup_tokens": 4, "micro_reps": 3}
QUICK_K = (4,)


def _csv(value: str | None) -> tuple[str, ...] | None:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else None


class _BenchGroup(click.Group):
    """``specedge bench BUNDLE ...`` is ``specedge bench run BUNDLE ...``: a first argument that
    names no subcommand (a bundle path, or an option such as --quick) goes to ``run``. A bundle
    folder called ``variants`` or ``threads`` is written ``./variants``."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


@click.group(cls=_BenchGroup)
def bench() -> None:
    """Benchmark a bundle, or sweep graph variants and thread splits.

    \b
    specedge bench BUNDLE [OPTIONS]        the benchmark (same as `specedge bench run`)
    specedge bench bound BUNDLE            the most any policy over the same drafts could give
    specedge bench prefill BUNDLE          prompt tokens per second, ours vs peers
    specedge bench conversation BUNDLE     a voice-agent call turn by turn (cold vs reused cache)
    specedge bench profile --graph ...     per-op profiles of graphs, ours vs GenAI's
    specedge bench variants --target ...   which quantization variant to ship
    specedge bench threads BUNDLE          which thread split wins for pipelined speculation
    """


@bench.command("run")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--workloads", default=None, help=f"Categories, comma separated: {','.join(CATEGORIES)} "
              "(default: all).")
@click.option("--prompts", "per_category", type=int, default=None, help="Prompts per category (default: all; "
              "--quick: 1).")
@shared_option("max_new_tokens", Local(note="Per generation (default 64; --quick: 16)."))
@click.option("--repeats", type=int, default=None, help="Rounds per prompt (default 3; --quick: 1).")
@click.option("--configs", default=None, help=f"Comma list: baseline, {'|'.join(DRAFTERS)} (its k sweep + "
              "adaptive), <drafter>-k<k>, <drafter>-adaptive, or all (default). baseline (1-row plain steps, the "
              "fastest plain decoding) always runs and every speedup divides by it; baseline-exact (exact 2-row "
              "plain steps) measures what exactness costs; a configuration ending in -exact runs in exact mode "
              "and must equal baseline-exact token for token.")
@click.option("--k-sweep", default=None, help="Fixed k values for a bare drafter name (default 2,4,6,8; "
              "--quick: 4).")
@load_options("threads", "verify_checksums", threads=Local(note="The peers run this many too."))
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
@click.option("--out", type=click.Path(), default=None,  # a str: Path() would drop a folder's trailing "/"
              help="Results files: a folder (gets <date>-<bundle>.md/.json) or a path stem.")
@click.option("--quick", is_flag=True, help="A smoke run: 1 prompt per category, 16 tokens, 1 round, k=4 and "
              "adaptive per drafter.")
@click.option("--suite", type=click.Path(path_type=Path), default=None, help="Another prompt suite JSON.")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
def run(bundle: Path, workloads, per_category, max_new_tokens, repeats, configs, k_sweep, threads, peers,
          peer_repeats, hf_target, hf_draft, gguf, genai_precision, lookup_tokens, json_out, plot_out, out, quick,
          suite, no_progress, verify_checksums) -> None:
    """Benchmark BUNDLE: plain decoding vs every drafter, k sweep and adaptive k, and peer runtimes.

    Runs are interleaved after a warm-up; speedups are medians of paired ratios. Every
    greedy output is checked: fast-mode runs (the default) may differ from the 1-row
    baseline only where the target's top-2 logits nearly tie (counted as near-tie
    divergences), exact-mode runs (-exact) must equal baseline-exact token for token;
    anything else fails the bench (exit 1). Peers run in
    their own processes in their default configuration; a crashing peer is reported and
    our results are still written. With --out, runs are also appended to a
    .partial.jsonl file as they finish.
    """
    from ..bench.report import partial_results_path, plot, render_markdown, to_json, write_results
    from ..bench.configs import DEFAULT_K_SWEEP
    from ..bench.runner import BenchSettings, run_bench
    from ..errors import InvalidParameterError

    # Without --quick, BenchSettings' own defaults (its one definition).
    defaults = dict(QUICK) if quick else {f.name: f.default for f in fields(BenchSettings) if f.name in QUICK}
    given = {"per_category": per_category, "max_new_tokens": max_new_tokens, "repeats": repeats}
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    if values["repeats"] < 1 or values["max_new_tokens"] < 1:
        raise InvalidParameterError("--repeats and --max-new-tokens must be >= 1")
    load = load_from({"threads": threads, "verify_checksums": verify_checksums})
    try:
        sweep = tuple(int(k) for k in _csv(k_sweep)) if k_sweep else (QUICK_K if quick else DEFAULT_K_SWEEP)
    except ValueError:
        raise InvalidParameterError(f"--k-sweep must be integers, comma separated; got {k_sweep!r}") from None
    if quick and configs is None:
        configs = "all"
    settings = BenchSettings(
        bundle=bundle, categories=_csv(workloads), per_category=values["per_category"],
        max_new_tokens=values["max_new_tokens"], repeats=values["repeats"], configs=configs, k_sweep=sweep,
        threads=load.threads, warmup_tokens=values["warmup_tokens"], micro_reps=values["micro_reps"],
        peers=_csv(peers) or (), peer_repeats=peer_repeats, quick=quick, suite_path=suite, progress=not no_progress,
        verify_checksums=load.verify_checksums, command=shlex.join(["specedge", "bench", *sys.argv[2:]])
        if len(sys.argv) > 1 and sys.argv[1] == "bench" else shlex.join(sys.argv),
        peer_options={"hf_target": hf_target, "hf_draft": hf_draft, "gguf": gguf, "lookup_tokens": lookup_tokens,
                      "genai_precision": _csv(genai_precision) or ("int4",)})
    if out is not None:
        partial = partial_results_path(out, bundle)
        settings = replace(settings, partial_path=partial)
        click.echo(f"partial results (kept if the bench dies): {partial}", err=True)
    doc = run_bench(settings)
    if out is not None:
        md, js = write_results(doc, out)
        click.echo(f"results: {md} and {js}", err=True)
        partial.unlink(missing_ok=True)  # the full results supersede it
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
        click.secho(f"FAILED: {summary['failures']} run(s) differ from their baseline outside a near tie", fg="red",
                    err=True)
    elif summary["near_tie_divergences"]:
        click.echo(f"note: {summary['near_tie_divergences']} near-tie divergence(s) from 1-row plain decoding "
                   "(fast mode; exact mode has none)", err=True)
    sys.exit(summary["exit_code"])


@bench.command()
@click.option("--target", required=True, help="The target model: a catalog name, an HF folder or a GGUF file "
              "(what `specedge export --target` takes).")
@click.option("--draft", required=True, help="The draft model, in the same forms as --target.")
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Scratch folder for the variant graphs. DELETED first, then each variant's subfolder is "
              "deleted once timed.")
@load_options("threads", threads=Local(default=2, low=1, note="Here every timed session runs this many."))
@click.option("--context", type=click.IntRange(min=1), default=128, show_default=True,
              help="Positions already in the cache when the steps are timed.")
@click.option("--max-context", type=click.IntRange(min=16), default=1024, show_default=True,
              help="Max context of the graphs built for the sweep.")
@shared_option("max_new_tokens", Local(default=48, low=1, note="Greedy, per prompt, from the first target variant: "
                                      "the sequences the drafts must predict."))
@click.option("--targets", "target_variants", default=None,
              help="Target variants to time, comma separated (default: all of them, listed in specedge.bench.variants).")
@click.option("--drafts", "draft_variants", default=None,
              help="Draft variants to time, comma separated (default: all of them, listed in specedge.bench.variants).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the measurements and the table as JSON to this path.")
def variants(target, draft, work, threads, context, max_context, max_new_tokens, target_variants, draft_variants,
             json_out) -> None:
    """Sweep verify-graph and draft variants: step ms, v(k), c, acceptance, predicted speedup.

    For each target variant (bits, block size, accuracy level) it builds the graph, times
    1..9-token steps; for each draft variant (precision, truncated head) the 1-token step and
    the greedy acceptance on prompts of the bench suite. Prints one table with Leviathan's
    predicted speedup at the best k. Needs specedge[export]; run on an otherwise idle machine.
    """
    from ..bench import variants as sweep

    chosen = {}
    for option, given, known in (("--targets", target_variants, sweep.TARGETS),
                                 ("--drafts", draft_variants, sweep.DRAFTS)):
        names = tuple(v.name for v in known)
        picked = _csv(given) or names
        unknown = [n for n in picked if n not in names]
        if unknown:
            from ..errors import InvalidParameterError

            raise InvalidParameterError(f"{option}: unknown variant(s) {', '.join(unknown)}; known: {', '.join(names)}")
        chosen[option] = picked
    sys.exit(sweep.run(target=target, draft=draft, work=work, threads=threads, context=context,
                       max_context=max_context, max_new_tokens=max_new_tokens, target_variants=chosen["--targets"],
                       draft_variants=chosen["--drafts"], json_out=json_out))


@bench.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompts", type=click.IntRange(min=1, max=3), default=3, show_default=True,
              help="Prompts per round: the first of the code, chat and grounded categories.")
@shared_option("max_new_tokens", Local(default=64, low=1, note="Per generation."))
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds over the prompts; every setup runs once per prompt per round, interleaved.")
@click.option("--draft-tokens", type=click.IntRange(min=1), default=4, show_default=True,
              help="Fixed k for every speculative setup.")
@click.option("--spinning", default=",".join(DEFAULT_SPINNING), show_default=True,
              help=f"Comma list of spinning policies to compare, from {', '.join(SPINNING)}; the first is the "
              "reference. 'on' leaves the cores busy after each run, which skews the setups run after it.")
def threads(bundle, prompts, max_new_tokens, repeats, draft_tokens, spinning) -> None:
    """Which thread split and spinning policy win for speculation on this machine?

    Runs the same greedy prompts, interleaved in rotating order, through plain decoding and
    sequential speculation under each intra-op spinning policy (stop: spin inside a run, stop
    when it returns, the default with a draft; off; on: ORT's default), and pipelined
    speculation with the cores split between draft and target or shared with spinning off.
    Prints tok/s medians and the median ratio to plain decoding with the default policy;
    exits 1 if any output differs from it.
    """
    from ..bench import threads as split

    policies = tuple(p.strip() for p in spinning.split(",") if p.strip())
    unknown = sorted(set(policies) - set(SPINNING))
    if unknown or not policies:
        raise click.BadParameter(f"use a comma list of {', '.join(SPINNING)}; got {spinning!r}",
                                 param_hint="--spinning")
    sys.exit(split.run(bundle, prompts=prompts, max_new_tokens=max_new_tokens, repeats=repeats,
                       draft_tokens=draft_tokens, spinning=policies))


@bench.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--configs", default=",".join(("cold", "reuse", "reuse+prefill")), show_default=True,
              help="Comma list of cold (every turn prefills the whole history), reuse (the conversation's cache "
              "is kept) and reuse+prefill (the history is also pushed before each turn, as on interim "
              "transcripts).")
@click.option("--conversation", "conversation_file", type=click.Path(path_type=Path), default=None,
              help="A conversation JSON ({'system': ..., 'turns': [...]}); default: the shipped voice-agent call.")
@click.option("--turns", type=click.IntRange(1, 64), default=None, help="Replay only the first N user turns.")
@shared_option("max_new_tokens", Local(default=48, low=1, high=512, note="Per turn (a voice reply is 20-60)."))
@load_options("threads")
@click.option("--no-speculation", is_flag=True, help="Plain decoding in every configuration.")
@click.option("--llamacpp/--no-llamacpp", default=True, show_default=True,
              help="Also run llama.cpp (llama-cpp-python, in its own process) on the bundle's GGUF, cold and with "
              "its server's prompt cache, on the same turns; skipped with a note when it is not installed.")
@click.option("--gguf", type=click.Path(path_type=Path), default=None,
              help="The GGUF file for the llama.cpp peer (default: the one the bundle was exported from).")
@click.option("--callers", type=click.IntRange(1, 8), default=1, show_default=True,
              help="Calls at once on each configuration (one cache slot each), round robin turn by turn, with "
                   "the same system prompt; caller c speaks the turns rotated by c. Shows what a new call's "
                   "first turn costs while others hold the system prompt (copied, not prefilled, with reuse).")
@click.option("--json", "as_json", is_flag=True, help="Print the per-turn records and summary as JSON.")
@click.option("--preemptive", is_flag=True,
              help="Preemptive generation through the server (configs cold, single, preemptive): each turn sends "
              "--attempts requests on growing prefixes of the user's words, each cancelled (the client closes "
              "the stream), then the final one. Reports the final TTFT against its bound (1 target step + the "
              "prefill of its uncached tokens, both timed right after each turn) and cancel-to-free p50/p90/max; a "
              "final reply that differs from the cold one is measured against the bundle's near-tie bound (exit "
              "status 1 outside it).")
@click.option("--attempts", type=click.IntRange(0, 3), default=3, show_default=True,
              help="With --preemptive: cancelled requests per turn (LiveKit retries up to 3).")
@click.option("--cancel-after-ms", default="150-400", show_default=True,
              help="With --preemptive: cancel each attempt this long after sending it (LOW-HIGH, uniform, seeded).")
@click.option("--cancel-after-blocks", type=click.IntRange(0, 4096), default=None,
              help="With --preemptive: cancel each attempt after this many streamed deltas instead (deterministic).")
def conversation(bundle, configs, conversation_file, turns, max_new_tokens, threads, no_speculation,
                 llamacpp, gguf, callers, as_json, preemptive, attempts, cancel_after_ms, cancel_after_blocks) -> None:
    """A voice-agent call turn by turn: time to first token with and without conversation cache reuse.

    Replays bench/prompts/conversation.json (a long system prompt, ten user turns; each reply is
    appended to the history) on one Generator per configuration, turn by turn interleaved.
    With --preemptive, each configuration runs behind its own server and is measured over HTTP.
    """
    import json

    if preemptive and callers > 1:
        raise click.BadParameter("--preemptive replays one call; leave --callers at 1", param_hint="--callers")
    if preemptive:
        sys.exit(_preemptive(bundle, conversation_file, turns, max_new_tokens, threads, attempts,
                             cancel_after_ms, cancel_after_blocks, as_json))

    from ..bench.conversation import format_report, load_conversation, run_conversation
    from ..runtime.generator import Generator

    names = _csv(configs) or ()
    from ..bench.conversation import CONFIGS

    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise click.BadParameter(f"unknown conversation configuration(s) {unknown}; known: {', '.join(CONFIGS)}",
                                 param_hint="--configs")
    talk = load_conversation(conversation_file) if conversation_file else load_conversation()
    if turns:
        talk = replace(talk, turns=talk.turns[:turns])
    generators = {}
    for name in names:
        generators[name] = Generator.from_bundle(bundle, threads=threads, cache_slots=callers)
        generators[name].warmup(tune=False)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specedge-conversation-peer-") as tmp:
        peer = _conversation_peer(generators, talk, bundle, threads, gguf, Path(tmp)) if llamacpp else None
        try:
            columns = len(names) + (len(peer.configs) if peer is not None else 0)
            length = (len(names) * callers + columns - len(names)) * len(talk.turns)
            with click.progressbar(length=length, label="conversation", file=sys.stderr) as bar:
                report = run_conversation(generators, talk, max_new_tokens=max_new_tokens,
                                          speculation=not no_speculation, progress=lambda *_: bar.update(1),
                                          peer=peer, callers=callers)
        finally:
            if peer is not None:
                peer.close()
    if as_json:
        doc = report.to_json()
        doc["peer"] = None if peer is None else {"info": peer.ready["info"], "notes": peer.ready["notes"]}
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(format_report(report))
        for note in peer.ready["notes"] if peer is not None else ():
            click.echo(f"note: {note}")


def _preemptive(bundle, conversation_file, turns, max_new_tokens, threads, attempts, cancel_after_ms,
                cancel_after_blocks, as_json) -> int:
    import json

    from ..bench.conversation import load_conversation
    from ..bench.preemptive import CONFIGS, CancelPlan, LocalServer, format_report, run_preemptive
    from ..runtime.generator import Generator
    from ..runtime.options import DEFAULT_CACHE_SLOTS

    try:
        low, high = (float(x) / 1e3 for x in cancel_after_ms.split("-"))
    except ValueError:
        raise click.BadParameter(f"use LOW-HIGH in milliseconds; got {cancel_after_ms!r}",
                                 param_hint="--cancel-after-ms") from None
    plan = CancelPlan(attempts=attempts, after_s=(low, high), after_blocks=cancel_after_blocks)
    talk = load_conversation(conversation_file) if conversation_file else load_conversation()
    if turns:
        talk = replace(talk, turns=talk.turns[:turns])
    servers = {}
    try:
        for name in CONFIGS:  # the server's defaults: its slot count, a warm start
            gen = Generator.from_bundle(bundle, threads=threads, cache_slots=DEFAULT_CACHE_SLOTS)
            gen.warmup(tune=False)
            servers[name] = LocalServer(gen)
        with click.progressbar(length=len(CONFIGS) * len(talk.turns), label="preemptive", file=sys.stderr) as bar:
            report = run_preemptive(servers, talk, plan=plan, max_new_tokens=max_new_tokens,
                                    progress=lambda *_: bar.update(1))
    finally:
        for server in servers.values():
            server.close()
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else format_report(report, plan))
    if not report.near_ties_only:  # a reply that left the cold one where the target did not nearly tie
        click.echo("error: a final reply differs from the cold one outside a near tie (see the report); "
                   "please report it", err=True)
        return 1
    return 0


def _conversation_peer(generators: dict, talk, bundle: Path, threads: int, gguf: Path | None, tmp: Path):
    """The llama.cpp conversation peer in its worker process, or None (the reason on stderr)."""
    from ..bench.peers import Job, PeerProcess

    gen = next(iter(generators.values()))
    first = gen.encode_prompt(messages=[{"role": "system", "content": talk.system},
                                        {"role": "user", "content": talk.turns[0]}])
    # A warm-up prompt that shares no prefix with the call, so the prompt cache starts empty-handed.
    warmup = Job("warmup", "conversation", first[::-1][:16], 8, [])
    ctx = {"bundle": str(bundle), "threads": threads, "peer_options": {"gguf": str(gguf) if gguf else None}}
    peer = PeerProcess("llamacpp-conversation", ctx, warmup, tmp / "stderr.txt")
    if not peer.configs:
        click.echo(f"llama.cpp peer: {peer.ready.get('skipped') or peer.ready.get('error')}; running without it",
                   err=True)
        peer.close()
        return None
    return peer


def _graph_options(values: tuple[str, ...]) -> dict[str, Path]:
    """``LABEL=PATH`` pairs (or bare paths, labelled by folder name) -> {label: path}, in order."""
    from ..errors import InvalidParameterError

    graphs: dict[str, Path] = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep:
            label, path = Path(value).name, value
        if not label or label in graphs:
            raise InvalidParameterError(f"--graph {value!r}: labels must be non-empty and distinct")
        graphs[label] = Path(path).expanduser()
    return graphs


@bench.command("profile")
@click.option("--graph", "graph_specs", multiple=True, required=True,
              help="LABEL=PATH of a specedge bundle (its target) or a GenAI model folder; repeat to compare.")
@click.option("--threads", default="2,1", show_default=True, help="Intra-op thread counts, comma separated.")
@click.option("--context", type=click.IntRange(min=1), default=256, show_default=True,
              help="Cached positions for the step and verify scenarios.")
@click.option("--prefill", default="512", show_default=True, help="Prefill lengths, comma separated.")
@click.option("--reps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Profiled runs per step/verify scenario per round (after 3 warm-up runs).")
@click.option("--prefill-reps", type=click.IntRange(min=1), default=4, show_default=True,
              help="Profiled runs per prefill per round.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Fresh sessions per graph and thread count, in alternating graph order.")
@click.option("--no-spinning", is_flag=True, help="Turn off intra-op spinning in every session.")
@click.option("--paired-reps", type=click.IntRange(min=0), default=30, show_default=True,
              help="Then time step/verify with all sessions open, runs alternated (robust to load drift); 0: skip.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Write <out>.md (the tables and the command) and <out>.json.")
def profile_command(graph_specs, threads, context, prefill, reps, prefill_reps, rounds, no_spinning, paired_reps,
                    out) -> None:
    """Per-op-type ONNX Runtime profiles: 1- and 2-token steps, a 5-token verify and prefills, side by side.

    Every graph runs the same shapes at the same thread counts with the node profiler on;
    the tables give ms and share per op type, the session's time per run, and each graph's
    memory floor (streamed weight bytes over the measured copy bandwidth).
    """
    from ..bench.opprofile import profile, render
    from ..errors import InvalidParameterError

    try:
        thread_counts = tuple(int(t) for t in _csv(threads) or ())
        prefills = tuple(int(n) for n in _csv(prefill) or ())
    except ValueError:
        raise InvalidParameterError("--threads and --prefill take integers, comma separated") from None
    doc = profile(_graph_options(graph_specs), threads=thread_counts, context=context, prefill=prefills, reps=reps,
                  prefill_reps=prefill_reps, rounds=rounds, allow_spinning=not no_spinning,
                  progress=lambda msg: click.echo(msg, err=True))
    command = shlex.join(["specedge", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 else "specedge bench profile"
    doc["command"] = command
    text = render(doc)
    if paired_reps:
        from ..bench.opprofile import paired, render_paired

        doc["paired"] = {}
        for t in thread_counts:
            click.echo(f"paired timing, threads {t}", err=True)
            doc["paired"][str(t)] = paired(_graph_options(graph_specs), threads=t, context=context, reps=paired_reps)
            text += "\n\n" + render_paired(doc["paired"][str(t)], t, paired_reps)
    if out is not None:
        import json

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        Path(f"{out}.md").write_text(f"```\n{command}\n```\n\n{text}\n", encoding="utf-8")
        click.echo(f"results: {out}.md and {out}.json", err=True)
    click.echo(text)


@bench.command("prefill")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--lengths", default="128,512,2048", show_default=True, help="Prompt lengths, comma separated.")
@load_options("threads", threads=Local(default=2, low=1, note="Here every runtime (ours and the peers) runs "
                                                             "this many."))
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds, runtimes interleaved; cells are medians.")
@click.option("--peers", default="genai,llamacpp", show_default=True,
              help="Comma list of genai, llamacpp (skipped with a note when not installed); empty: ours only.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Write <out>.md (the table and the command) and <out>.json.")
def prefill_command(bundle, lengths, threads, repeats, peers, out) -> None:
    """Prefill tokens/s at several prompt lengths: specedge vs onnxruntime-genai and llama.cpp, side by side.

    For voice agents, time to first token is prefill. Every runtime reads the same prompt
    into an empty cache and computes its last position's logits.
    """
    import json

    from ..bench.opprofile import machine
    from ..bench.prefill import render, run_prefill
    from ..bench.progress import Progress
    from ..errors import InvalidParameterError

    try:
        sizes = tuple(int(n) for n in _csv(lengths) or ())
    except ValueError:
        raise InvalidParameterError("--lengths takes integers, comma separated") from None
    log = Progress(repeats, title="prefill")
    doc = run_prefill(bundle, sizes, threads, repeats, _csv(peers) or (), log)
    doc["machine"] = machine()
    command = shlex.join(["specedge", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 else "specedge bench prefill"
    doc["command"] = command
    text = render(doc)
    m = doc["machine"]
    header = (f"CPU: {m['cpu']} ({m['cores']} cores, {', '.join(m['isa'])}), {threads} thread(s), onnxruntime "
              f"{m['onnxruntime']}, load average {', '.join(f'{x:.2f}' for x in m['load_avg'])} at the end")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        Path(f"{out}.md").write_text(f"```\n{command}\n```\n\n{header}\n\n{text}\n", encoding="utf-8")
        click.echo(f"results: {out}.md and {out}.json", err=True)
    click.echo(f"{header}\n\n{text}")


@bench.command("bound")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--workloads", default=None, help=f"Categories, comma separated: {','.join(CATEGORIES)} "
              "(default: all).")
@click.option("--prompts", "per_category", type=click.IntRange(min=1), default=2, show_default=True,
              help="Prompts per category, in the suite's order (later ones draft from earlier replies).")
@shared_option("max_new_tokens", Local(default=64, low=2, note="Per reply."))
@click.option("--reps", type=click.IntRange(min=1), default=16, show_default=True,
              help="Repetitions of the step-cost measurement (paired medians of v(k) and c).")
@load_options("threads")
@click.option("--draft-window", type=click.IntRange(min=0), default=None,
              help="Prompt tokens the draft model reads, as the draft_window option (default: the runtime's "
              "default; 0: the whole prompt).")
@click.option("--suite", type=click.Path(path_type=Path), default=None, help="Another prompt suite JSON.")
@click.option("--json", "as_json", is_flag=True, help="Print the result document (per-position counts included) "
              "as JSON instead of the table.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Write <out>.md (the table and the command) and <out>.json.")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
def bound_command(bundle, workloads, per_category, max_new_tokens, reps, threads, draft_window, suite, as_json, out,
                  no_progress) -> None:
    """The most any speculation policy could give on each workload, on this machine.

    Decodes each prompt plainly once and counts, at every reply position, how many tokens the
    default drafter's suffix lookup and the draft model (greedy) would have drafted right. An
    oracle that knows those counts picks every step's source and k at the measured step costs
    (v(k), c); its speedup over plain decoding bounds what any policy over the same drafts can
    reach (the draft's prompt prefill is charged once, its later catch-ups are free). Columns:
    lookups alone, the draft model alone, both, and both with every verify priced as a plain step
    (free extra verify rows).
    Compare a workload's `specedge bench run` speedups with its bound: a default near the
    bound cannot gain by choosing better.
    """
    import json

    from ..bench.bound import render, run_bound
    from ..bench.progress import Progress
    from ..bench.suite import load_suite
    from ..runtime.generator import Generator
    from ..runtime.options import check

    # Every option is checked before a session loads.
    window = {} if draft_window is None else {"draft_window": check("draft_window", draft_window or None,
                                                                        where="--draft-window")}
    selected = (load_suite(suite) if suite else load_suite()).select(list(_csv(workloads) or ()) or None,
                                                                     per_category)
    gen = Generator.from_bundle(bundle, threads=threads)
    bar = Progress(2 * len(selected), title="specedge bench bound", enabled=not no_progress)
    doc = run_bound(gen, selected, max_new_tokens=max_new_tokens, reps=reps, progress=bar, **window)
    bar.close()
    doc["bundle"] = str(bundle)
    doc["command"] = shlex.join(["specedge", "bench", *sys.argv[2:]]) if len(sys.argv) > 1 else "specedge bench bound"
    text = render(doc)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        Path(f"{out}.md").write_text(f"```\n{doc['command']}\n```\n\n{text}\n", encoding="utf-8")
    click.echo(json.dumps(doc) if as_json else text)
