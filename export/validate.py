"""Check an exported graph against PyTorch before a bundle is written.

Paths compared (as optimum's validator does): a multi-token prefill with an
empty past, a 1-token step on top of that past, and a multi-token (verify-sized)
step on top of a past. All run through the real OrtEngine, so the IO binding and
cache writes are validated too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engines.base import EngineOptions
from ..engines.ort import OrtEngine
from ..errors import ExportValidationError
from ..manifest import ModelEntry

# fp32 graphs reorder float sums relative to PyTorch; across ~30 layers that moves
# logits by ~1e-5 of their scale. 1e-3 of the scale still catches any real bug
# (a wrong rotary or mask moves logits by O(1)).
FP32_RELATIVE_TOLERANCE = 1e-3
FP16_RELATIVE_TOLERANCE = 3e-2


@dataclass
class ValidationReport:
    max_abs_diff: dict[str, float]
    tolerance: float
    top1_agreement: float  # fraction of compared positions whose argmax equals PyTorch's

    def as_dict(self) -> dict:
        return {"max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance, "top1_agreement": self.top1_agreement}


def _torch_logits(model: Any, ids: np.ndarray, layers: int | None = None) -> np.ndarray:
    """PyTorch logits [n, vocab]; ``layers`` runs only the first that many decoder layers."""
    import torch

    with torch.no_grad(), _first_layers(model, layers):
        return model(torch.from_numpy(ids[None]), use_cache=False).logits[0].float().numpy()


class _first_layers:
    """Temporarily cut an HF decoder to its first n layers (the early-exit draft's reference)."""

    def __init__(self, model: Any, n: int | None) -> None:
        self.model, self.n = model, n

    def __enter__(self):
        if self.n is not None:
            import torch

            body = self.model.model if hasattr(self.model, "model") else self.model.transformer
            name = "layers" if hasattr(body, "layers") else "h"
            self.saved = (body, name, getattr(body, name), self.model.config.num_hidden_layers)
            setattr(body, name, torch.nn.ModuleList(list(getattr(body, name))[: self.n]))
            self.model.config.num_hidden_layers = self.n
        return self

    def __exit__(self, *exc):
        if self.n is not None:
            body, name, layers, count = self.saved
            setattr(body, name, layers)
            self.model.config.num_hidden_layers = count


def _ort_logits(engine: OrtEngine, ids: np.ndarray, prefill: int, verify: int) -> dict[str, np.ndarray]:
    """Prefill ``prefill`` tokens, then one 1-token step, then a ``verify``-token step."""
    kv = engine.new_cache()
    out = {"prefill": engine.forward(ids[:prefill], kv, num_logits=prefill).copy()}
    out["step"] = engine.forward(ids[prefill:prefill + 1], kv, num_logits=1).copy()
    out["verify"] = engine.forward(ids[prefill + 1:prefill + 1 + verify], kv, num_logits=verify).copy()
    return out


def validate_graph(model: Any, entry: ModelEntry, graph: Path, *, relative_tolerance: float,
                   prefill: int = 7, verify: int = 5, seed: int = 0, strict: bool = True,
                   head_ids: np.ndarray | None = None, layers: int | None = None) -> ValidationReport:
    """Raise ExportValidationError naming the step and tensor if ORT and PyTorch disagree.

    ``layers`` / ``head_ids``: the graph is an early-exit and/or truncated-head copy; it is
    compared with the first ``layers`` layers of the PyTorch model, at the ``head_ids`` columns.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, entry.vocab_size, size=prefill + 1 + verify).astype(np.int64)
    reference = _torch_logits(model, ids, layers)
    if head_ids is not None:
        reference = reference[:, head_ids]
    engine = OrtEngine(entry, graph, EngineOptions())
    got = _ort_logits(engine, ids, prefill, verify)
    rows = {"prefill": reference[:prefill], "step": reference[prefill:prefill + 1],
            "verify": reference[prefill + 1:]}
    scale = max(1.0, float(np.abs(reference).max()))
    tolerance = relative_tolerance * scale
    diffs, agree, total = {}, 0, 0
    for name, ref in rows.items():
        diff = float(np.abs(got[name] - ref).max())
        diffs[name] = diff
        agree += int((got[name].argmax(-1) == ref.argmax(-1)).sum())
        total += len(ref)
        if strict and not diff <= tolerance:  # also catches NaN
            raise ExportValidationError(
                f"logits of the {name} step ({len(ref)} tokens) differ from PyTorch by {diff:.3g}, above the "
                f"tolerance {tolerance:.3g} ({relative_tolerance:g} x logit scale {scale:.3g}) for {entry.graph}")
    return ValidationReport(diffs, tolerance, agree / total)


def compare_graphs(entry_a: ModelEntry, graph_a: Path, entry_b: ModelEntry, graph_b: Path, *,
                   n_tokens: int = 64, seed: int = 0) -> dict:
    """Teacher-forced agreement of two graphs (e.g. int4 vs fp32) on a random sequence."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, entry_a.vocab_size, size=n_tokens).astype(np.int64)
    logits = []
    for entry, graph in ((entry_a, graph_a), (entry_b, graph_b)):
        engine = OrtEngine(entry, graph, EngineOptions())
        logits.append(engine.forward(ids, engine.new_cache(), num_logits=n_tokens).copy())
    a, b = logits
    if not np.isfinite(b).all():
        raise ExportValidationError(f"{graph_b.name} produced non-finite logits")
    return {"top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "max_abs_diff": float(np.abs(a - b).max())}


def batch_variance(entry: ModelEntry, graph: Path, *, verify: int = 5, prefix: int = 16, trials: int = 3,
                   seed: int = 1) -> float:
    """Largest logit difference between a ``verify``-token step and the same tokens one at a time.

    This is how far the graph is from batch-invariant; a greedy argmax can only differ
    between speculative and plain decoding where the top-2 gap is below about this.
    """
    rng = np.random.default_rng(seed)
    engine = OrtEngine(entry, graph, EngineOptions())
    worst = 0.0
    for _ in range(trials):
        ids = rng.integers(0, entry.vocab_size, size=prefix + verify).astype(np.int64)
        kv = engine.new_cache()
        engine.forward(ids[:prefix], kv, num_logits=1)
        batched = engine.forward(ids[prefix:], kv, num_logits=verify).copy()
        kv.rewind(verify)
        single = np.stack([engine.forward(ids[prefix + i:prefix + i + 1], kv, num_logits=1)[-1].copy()
                           for i in range(verify)])
        worst = max(worst, float(np.abs(batched - single).max()))
    return worst
