"""``specedge export-fixture`` and ``specedge export-measure``: measure an export at a real model's
size without downloading one. Only parses options and calls specedge.export.fixture / .measure."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import click

from ..export.fixture import SHAPES


@click.command("export-fixture")
@click.option("--shape", required=True, type=click.Choice(sorted(SHAPES)), help="The released model whose shape "
              "(config.json numbers) the random-weight checkpoint has.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The HF folder to write (must not exist).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**31 - 1),
              help="Seed of the random weights (the same seed writes the same checkpoint).")
@click.option("--vocab-size", type=click.IntRange(258, 1 << 20), default=None,
              help="Override the shape's vocabulary size (a smaller embedding for a quick run).")
def export_fixture(shape: str, out: Path, seed: int, vocab_size: int | None) -> None:
    """Write a random-weight fp16 safetensors checkpoint with SHAPE's config and a byte-level tokenizer,
    tensor by tensor (never the whole model in memory)."""
    from ..export.fixture import write_fixture

    s = SHAPES[shape] if vocab_size is None else replace(SHAPES[shape], vocab_size=vocab_size)
    click.echo(f"writing {shape} ({s.parameters / 1e9:.2f}B parameters, {s.parameters * 2 / 1e9:.1f} GB fp16) "
               f"to {out}", err=True)
    click.echo(str(write_fixture(s, out, seed=seed)))


@click.command("export-measure", context_settings={"ignore_unknown_options": True})
@click.option("--max-rss-gb", type=click.FloatRange(0.5, 1024), default=16.0, show_default=True,
              help="Kill the export if its resident set passes this (a guard on shared machines).")
@click.option("--min-available-gb", type=click.FloatRange(0, 1024), default=1.5, show_default=True,
              help="Kill the export if the machine's available memory falls below this.")
@click.option("--json", "as_json", is_flag=True, help="Print the measurement as JSON.")
@click.argument("export_args", nargs=-1, type=click.UNPROCESSED, required=True)
def export_measure(max_rss_gb: float, min_available_gb: float, as_json: bool, export_args: tuple[str, ...]) -> None:
    """Run `specedge export EXPORT_ARGS...` in a child process; report peak RSS, disk and time per phase.

    Example: specedge export-measure -- --target fx/llama-3.2-1b --out b/1b --precision int4 --max-context 1024
    """
    from ..export.fetch import cache_dir
    from ..export.measure import measure_export

    args = list(export_args)
    if "--out" not in args or args.index("--out") + 1 >= len(args):
        raise click.UsageError("the export arguments must include --out DIR")
    out = Path(args[args.index("--out") + 1])
    m = measure_export(args, out, cache=cache_dir(), max_rss_bytes=int(max_rss_gb * 1e9),
                       min_available_bytes=int(min_available_gb * 1e9), echo=not as_json)
    if as_json:
        click.echo(json.dumps(m.to_dict(), indent=2))
    else:
        click.echo("specedge export " + shlex.join(args))
        click.echo(m.report())
    if m.returncode != 0:
        if not as_json:
            click.echo(m.stderr_tail, err=True)
        sys.exit(1)
