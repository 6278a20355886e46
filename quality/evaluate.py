"""The bundle side of ``specedge eval``: texts, their chunks, and the target graph scored on them.

Every text is encoded with the bundle's tokenizer (its BOS rule included) and cut into
non-overlapping chunks of ``chunk`` tokens; each chunk is one teacher-forced forward from an
empty cache. With a BOS rule every chunk starts with BOS (then chunk - 1 text tokens, all of
them predicted); without, a chunk's first text token is context only. The source, when scored,
sees exactly the same chunks (``export/quality.py`` runs it in transformers).

numpy and the engines only: runs in the edge install.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..bundle.extra import QualityRecord
from ..errors import InvalidParameterError
from .metrics import Tally, kl_divergence, token_scores

# Built-in held-out texts (quality/texts/<kind>.txt, written for this purpose): a few hundred
# words each, the kinds of text specedge's users decode.
BUILTIN_KINDS = ("prose", "code", "dialogue", "tool_call")
TEXTS_DIR = Path(__file__).with_name("texts")
DEFAULT_CHUNK = 512  # tokens per teacher-forced chunk; capped by the bundle's max_context
# Export's short run: this many tokens of each built-in kind (a few hundred in all), scored while
# the source is in memory for validation anyway.
EXPORT_MAX_TOKENS = 96

# ids int64 [n] -> logits float32 [>= n - 1, vocab]; row i predicts ids[i + 1]
Scorer = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class EvalText:
    kind: str  # "prose", ..., or a file's name: what the report groups by
    text: str


def builtin_texts(kinds: Sequence[str] = BUILTIN_KINDS) -> list[EvalText]:
    """The held-out texts shipped with specedge (package data)."""
    unknown = [k for k in kinds if k not in BUILTIN_KINDS]
    if unknown:
        raise InvalidParameterError(f"unknown text kind {unknown[0]!r}; built in: {', '.join(BUILTIN_KINDS)}")
    return [EvalText(kind, (TEXTS_DIR / f"{kind}.txt").read_text(encoding="utf-8")) for kind in kinds]


def read_texts(paths: Sequence[str | Path]) -> list[EvalText]:
    """Text files, each its own kind (its file name; its path when two names collide)."""
    paths = [Path(p) for p in paths]
    names = [p.name for p in paths]
    texts = []
    for path in paths:
        if not path.is_file():
            raise InvalidParameterError(f"text file {str(path)!r} does not exist or is not a file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidParameterError(f"text file {str(path)!r} is not UTF-8: {exc.reason} at byte {exc.start}") \
                from None
        except OSError as exc:
            raise InvalidParameterError(f"cannot read text file {str(path)!r}: {exc.strerror}") from None
        if not text.strip():
            raise InvalidParameterError(f"text file {str(path)!r} is empty")
        texts.append(EvalText(path.name if names.count(path.name) == 1 else str(path), text))
    return texts


def chunk_ids(ids: Sequence[int], chunk: int, bos: int | None) -> list[np.ndarray]:
    """``ids`` (text tokens, no BOS) as non-overlapping int64 chunks of at most ``chunk`` tokens.

    With ``bos`` each chunk is BOS + up to chunk - 1 text tokens; a last chunk with nothing to
    predict (a single token) is dropped.
    """
    if chunk < 2:
        raise InvalidParameterError(f"chunk must be >= 2 tokens (one of context, one predicted); got {chunk}")
    step = chunk - 1 if bos is not None else chunk
    out = []
    for lo in range(0, len(ids), step):
        piece = list(ids[lo:lo + step])
        if bos is not None:
            piece = [bos] + piece
        if len(piece) >= 2:
            out.append(np.asarray(piece, np.int64))
    return out


def _bos_id(codec) -> int | None:
    """The BOS id the bundle prepends (its recorded rule), or None."""
    if not codec.add_bos_token or codec.bos_token is None:
        return None
    return codec.tokenizer.token_to_id(codec.bos_token)


@dataclass(frozen=True)
class EvalPlan:
    """The chunks to score, per text kind, in order."""

    chunk: int
    max_tokens: int | None
    kinds: dict[str, list[np.ndarray]]

    @property
    def positions(self) -> int:
        """Predicted positions over every chunk (the progress bar's total)."""
        return sum(len(c) - 1 for chunks in self.kinds.values() for c in chunks)


def plan_eval(texts: Sequence[EvalText], codec, *, max_context: int, chunk: int | None = None,
              max_tokens: int | None = None) -> EvalPlan:
    """Encode ``texts`` with the bundle's ``codec`` (a runtime TextCodec) and cut them into chunks.

    ``chunk``: tokens per chunk in [2, max_context] (None: DEFAULT_CHUNK capped by max_context);
    ``max_tokens``: at most this many text tokens of each text (None: all). Texts of one kind
    are scored together.
    """
    if chunk is None:
        chunk = min(DEFAULT_CHUNK, max_context)
    if not 2 <= chunk <= max_context:
        raise InvalidParameterError(f"--chunk must be in [2, {max_context}] (the bundle's max_context); got {chunk}")
    if max_tokens is not None and max_tokens < 2:
        raise InvalidParameterError(f"--max-tokens must be >= 2; got {max_tokens}")
    if not texts:
        raise InvalidParameterError("no texts to score")
    bos = _bos_id(codec)
    kinds: dict[str, list[np.ndarray]] = {}
    for item in texts:
        if not item.text.strip():
            raise InvalidParameterError(f"text {item.kind!r} is empty")
        ids = codec.encode(item.text)
        if bos is not None and ids[:1] == [bos]:
            ids = ids[1:]  # chunk_ids puts BOS at the start of every chunk
        if max_tokens is not None:
            ids = ids[:max_tokens]
        chunks = chunk_ids(ids, chunk, bos)
        if not chunks:
            raise InvalidParameterError(f"text {item.kind!r} encodes to {len(ids)} token(s): nothing to predict")
        kinds.setdefault(item.kind, []).extend(chunks)
    return EvalPlan(chunk, max_tokens, kinds)


def engine_scorer(engine) -> Scorer:
    """Teacher-forced logits of a chunk through an Engine: one forward from an empty cache."""
    cache = engine.new_cache()

    def score(ids: np.ndarray) -> np.ndarray:
        cache.reset()
        return engine.forward(ids, cache, num_logits=len(ids))

    return score


def run_eval(plan: EvalPlan, target: Scorer, source: Scorer | None = None, *, source_name: str = "",
             on_chunk: Callable[[str, int], None] | None = None) -> QualityRecord:
    """Score every chunk of ``plan`` with ``target`` (and ``source`` on the same chunks).

    ``on_chunk(kind, positions)`` after each chunk (a progress bar). Returns the record
    ``specedge eval`` prints and export stores.
    """
    tallies: dict[str, Tally] = {}
    for kind, chunks in plan.kinds.items():
        tally = tallies.setdefault(kind, Tally())
        for ids in chunks:
            targets = ids[1:]
            target_logits = target(ids)
            vocab = target_logits.shape[-1]
            nll, top1 = token_scores(target_logits[:len(targets)], targets)
            if source is not None:
                source_logits = source(ids)
                if source_logits.shape[-1] != vocab:
                    raise InvalidParameterError(f"the source scores {source_logits.shape[-1]} tokens, the bundle "
                                                f"{vocab}: not the checkpoint the bundle was exported from")
                tally.add(nll, top1, *token_scores(source_logits[:len(targets)], targets),
                          kl=kl_divergence(source_logits[:len(targets)], target_logits[:len(targets)]))
            else:
                tally.add(nll, top1)
            if on_chunk is not None:
                on_chunk(kind, len(targets))
    overall = Tally()
    for tally in tallies.values():
        overall = overall.merged(tally)
    return QualityRecord(chunk=plan.chunk, max_tokens=plan.max_tokens,
                         kinds={kind: t.score() for kind, t in tallies.items()}, overall=overall.score(),
                         source=source_name if source is not None else "")


@dataclass(frozen=True)
class EvalReport:
    """What ``specedge eval`` prints: the record, the bundle, and notes (e.g. why no source)."""

    bundle: str
    record: QualityRecord
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        def score(s) -> dict[str, Any]:
            out = s.to_dict()
            if s.perplexity_ratio is not None:
                out["perplexity_ratio"] = s.perplexity_ratio
            return out

        r = self.record
        return {"bundle": self.bundle, "source": r.source or None, "chunk": r.chunk, "max_tokens": r.max_tokens,
                "kinds": {k: score(s) for k, s in r.kinds.items()}, "overall": score(r.overall),
                "notes": list(self.notes)}


def evaluate_bundle(bundle: str | Path, *, texts: Sequence[EvalText] | None = None, chunk: int | None = None,
                    max_tokens: int | None = None, source: str | None = None, use_source: bool = True,
                    threads: int = 0, verify_checksums: bool = True,
                    progress: Callable[[int], Any] | None = None, quiet: bool = False) -> EvalReport:
    """Score a bundle's target graph, and its source where one is found and the export extra installed.

    ``texts``: None for the built-in set. ``source``: overrides the manifest's record (a catalog
    name, an HF folder or a GGUF file). ``use_source=False`` scores the bundle alone.
    ``progress(total_positions)`` returns an object with ``advance(label, n)`` and ``close()``
    (bench/progress.Progress). Notes say why the source was not scored.
    """
    from ..runtime.loading import load_bundle

    loaded = load_bundle(bundle, threads=threads, verify_checksums=verify_checksums, load_draft=False)
    entry = loaded.manifest.target
    plan = plan_eval(builtin_texts() if texts is None else texts, loaded.codec, max_context=entry.max_context,
                     chunk=chunk, max_tokens=max_tokens)
    notes: list[str] = []
    source_scorer, source_name = None, ""
    if use_source:
        source_scorer, source_name, note = _source(entry.source, source, quiet)
        if note:
            notes.append(note)
    bar = progress(plan.positions * (2 if source_scorer else 1)) if progress else None

    def advance(kind: str, n: int) -> None:
        if bar is not None:
            bar.advance(kind, n * (2 if source_scorer else 1))

    try:
        record = run_eval(plan, engine_scorer(loaded.target), source_scorer, source_name=source_name,
                          on_chunk=advance)
    finally:
        if bar is not None:
            bar.close()
    return EvalReport(str(bundle), record, tuple(notes))


def _source(recorded: str, override: str | None, quiet: bool) -> tuple[Scorer | None, str, str]:
    """(scorer, what it is, note): the source model in transformers, or None and the reason."""
    try:
        from ..export import quality as source_side

        source_side.require_export_extra()
    except ImportError as exc:
        if override is not None:
            raise InvalidParameterError(f"--source needs the export extra (torch, transformers): {exc}; "
                                        "pip install 'specedge[export]'") from None
        return None, "", (f"the export extra is not installed ({exc}), so the source was not scored; "
                          "pip install 'specedge[export]' to compare with it")
    return source_side.load_scorer(recorded, override, quiet=quiet)
