"""``specedge eval BUNDLE``: perplexity of the bundle's target, and its agreement with the source."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .options import load_from, load_options


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(report) -> list[str]:
    r = report.record
    lines = [f"{'text':14s} {'tokens':>7s} {'ppl bundle':>11s} {'ppl source':>11s} {'ratio':>7s} {'top-1 agree':>12s} "
             f"{'KL (nats)':>10s}"]
    rows = list(r.kinds.items()) + [("overall", r.overall)]
    for name, s in rows:
        lines.append(f"{name[:14]:14s} {s.positions:7d} {s.perplexity:11.3f} "
                     f"{_number(s.source_perplexity, '11.3f'):>11s} "
                     f"{_number(s.perplexity_ratio, '7.4f'):>7s} {_number(s.top1_agreement, '12.3f'):>12s} "
                     f"{_number(s.kl_divergence, '10.4f'):>10s}")
    return lines


@click.command(name="eval")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--text", "texts", multiple=True, type=click.Path(path_type=Path),
              help="A UTF-8 text file to score (repeatable; each is its own kind). Default: the built-in set "
              "(prose, code, dialogue, tool-call JSON).")
@click.option("--chunk", type=int, default=None,
              help="Tokens per teacher-forced chunk, in [2, max_context]. Default 512, capped by max_context.")
@click.option("--max-tokens", type=int, default=None, help="Score at most N tokens of each text (bounds the work).")
@click.option("--source", default=None, help="The source checkpoint (catalog name, HF folder or GGUF file); "
              "default: the one the manifest records, when found on this machine.")
@click.option("--no-source", is_flag=True, help="Score the bundle alone (no transformers run).")
@load_options("threads", "verify_checksums")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def eval_command(bundle: Path, texts: tuple[Path, ...], chunk: int | None, max_tokens: int | None, source: str | None,
                 no_source: bool, as_json: bool, quiet: bool, **kw) -> None:
    """Perplexity of the bundle's target graph and of its source checkpoint on the same tokens,
    their ratio, top-1 agreement (share of positions where both argmaxes agree) and the mean KL
    divergence of the bundle's next-token distributions from the source's (nats per token).

    Speed is worth nothing if the model got worse on the way in. The source runs in
    transformers (the export extra); without it, the bundle is scored alone with a note.
    """
    from ..bench.progress import Progress
    from ..errors import InvalidParameterError
    from ..quality.evaluate import evaluate_bundle, read_texts

    if no_source and source is not None:
        raise InvalidParameterError("--source and --no-source contradict each other")
    load = load_from(kw)
    report = evaluate_bundle(bundle, texts=read_texts(texts) if texts else None, chunk=chunk, max_tokens=max_tokens,
                             source=source, use_source=not no_source, threads=load.threads,
                             verify_checksums=load.verify_checksums, quiet=quiet or as_json,
                             progress=None if quiet else (lambda total: Progress(total, title="eval", every=1)))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        r = report.record
        click.echo(f"bundle {bundle}: target {'vs ' + r.source if r.source else 'alone'}, chunks of {r.chunk} tokens"
                   + (f", at most {r.max_tokens} tokens per text" if r.max_tokens else ""))
        for line in _table(report):
            click.echo(line)
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
