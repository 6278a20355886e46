"""The source side of ``specedge eval``: the checkpoint a bundle was exported from, in transformers.

The manifest records each model's ``source`` as export's loader described it: a catalog name
or an HF folder as given, or ``gguf:<file name>`` for a GGUF (a catalog model's cached file is
found by that name). GGUF files are dequantized by transformers, the weights llama.cpp runs.
torch and transformers are imported only when a source is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np


Scorer = Callable[[np.ndarray], np.ndarray]


def require_export_extra() -> None:
    """ImportError (naming the package) when torch or transformers is missing."""
    import torch  # noqa: F401
    import transformers  # noqa: F401


def locate_source(recorded: str) -> tuple[str | None, str]:
    """``(source, "")`` that export's loader can load for a manifest's ``source`` record, or
    ``(None, reason)`` when it cannot be found on this machine (nothing is downloaded)."""
    from .catalog import CATALOG
    from .fetch import is_cached

    hint = "pass --source (a catalog name, an HF folder or a GGUF file)"
    if recorded.startswith("gguf:"):
        name = recorded.removeprefix("gguf:")
        known = [m for m in CATALOG.values() if m.filename == name]
        for model in known:
            if is_cached(model):
                return model.name, ""
        if known:
            return None, (f"the source {recorded!r} is catalog model {known[0].name!r}, which is not in the cache "
                          f"(`specedge fetch {known[0].name}`, or {hint})")
        return None, f"the source {recorded!r} is a GGUF file recorded by name only; {hint}"
    if recorded in CATALOG:
        if is_cached(CATALOG[recorded]):
            return recorded, ""
        return None, f"the source {recorded!r} is not in the cache (`specedge fetch {recorded}`, or {hint})"
    if recorded and Path(recorded).expanduser().exists():
        return recorded, ""
    return None, f"the source {recorded!r} is not found on this machine; {hint}"


def torch_scorer(model: Any) -> Scorer:
    """Teacher-forced logits of a chunk: one forward of the HF model (float32 [n, vocab])."""
    from .validate import _torch_logits

    return lambda ids: _torch_logits(model, np.asarray(ids, np.int64))


def load_scorer(recorded: str, override: str | None = None, *,
                quiet: bool = False) -> tuple[Scorer | None, str, str]:
    """(scorer, source, note): the source loaded with export's loader, or None and why not.

    ``override`` (``--source``) must load: a bad one raises ExportError. The recorded source,
    when it cannot be found here, gives a note instead (the bundle is scored alone).
    """
    from .loader import load_source

    source = override
    if source is None:
        source, reason = locate_source(recorded)
        if source is None:
            return None, "", reason + "; scored the bundle alone"
    loaded = load_source(source, quiet=quiet)
    return torch_scorer(loaded.model), loaded.source, ""


def export_quality(graph: Path, entry, codec, model: Any, source: str, note: Callable[[str], None],
                   progress: Callable[[int, int], None] = lambda done, total: None):
    """The short ``specedge eval`` export records: EXPORT_MAX_TOKENS of each built-in kind, the
    written ``graph`` (ModelEntry ``entry``) against the already loaded HF ``model``. Returns a
    QualityRecord, or None when the tokenizer leaves a text nothing to predict. ``progress(done,
    total)`` after each chunk scored (by the source, then by the bundle)."""
    from ..engines.base import EngineOptions
    from ..engines.ort import OrtEngine
    from ..errors import InvalidParameterError
    from ..quality.evaluate import EXPORT_MAX_TOKENS, builtin_texts, engine_scorer, plan_eval, run_eval
    from .release import release_memory

    try:
        plan = plan_eval(builtin_texts(), codec, max_context=entry.max_context, max_tokens=EXPORT_MAX_TOKENS)
    except InvalidParameterError as exc:
        note(f"quality: not measured ({exc})")
        return None
    # The source scores every chunk before the bundle's session exists, and its logits are kept (at most
    # EXPORT_MAX_TOKENS per kind x vocabulary floats): a streamed source (export/streamed.py) then never
    # holds a module's weights next to the session's. The numbers are the same as scoring in turn.
    scored = {}
    source_scorer = torch_scorer(model)
    total = 2 * sum(len(chunks) for chunks in plan.kinds.values())
    for chunks in plan.kinds.values():
        for ids in chunks:
            scored[np.asarray(ids, np.int64).tobytes()] = source_scorer(ids)
            progress(len(scored), total)
    release_memory()  # the streamed modules' weights the source's forwards read, before the session loads
    done = [len(scored)]

    def bundle_chunk(kind: str, positions: int) -> None:
        done[0] += 1
        progress(done[0], total)

    record = run_eval(plan, engine_scorer(OrtEngine(entry, graph, EngineOptions())),
                      lambda ids: scored[np.asarray(ids, np.int64).tobytes()], source_name=source,
                      on_chunk=bundle_chunk)
    s = record.overall
    note(f"quality on {s.positions} tokens of built-in text: perplexity {s.perplexity:.3f} vs source "
         f"{s.source_perplexity:.3f} (ratio {s.perplexity_ratio:.4f}), top-1 agreement {s.top1_agreement:.3f}, "
         f"KL divergence {s.kl_divergence:.4f} nats")
    return record

