"""Activation importance: how much each input channel of each weight matters (#37, data-aware rounding).

Rounding a weight column ``w`` [K] (one output) to ``ŵ`` costs that output ``x · (w - ŵ)`` for an
input ``x`` [K]. Over calibration tokens its mean square is ``eᵀ E[x xᵀ] e`` with ``e = w - ŵ``, about
``Σ_k E[x_k²] e_k²`` when the input channels are uncorrelated: the diagonal of the inputs' second
moment weighs each channel's rounding error. It is what llama.cpp's importance matrix
(``llama-imatrix``) collects, and what makes its 4-bit types better than rounding alone; a few
channels of a transformer's hidden state carry most of the energy, and their weights need the finest
rounding.

Here the fp32 ONNX graph the export has just validated is given each weighted MatMul's input as an
extra output and run over the calibration texts (export/calibration/*.txt: prose, code, dialogue and
tool-call JSON written for this, none of them the eval texts of quality/texts), so every family the
exporter writes is covered, without torch. export/mixquant.py's searched forms weigh each element's
squared error by its channel's importance.

The ``-gptq`` mixes need the whole second moment ``E[x xᵀ]`` [K, K] of each input, not only its
diagonal (export/mixquant.py ``_gptq``): :func:`activation_moments` keeps, per input, whichever is
smaller, the running ``xᵀx`` or the calibration activations themselves (an MLP down projection's K is
larger than the calibration's token count), and forms the moment when a weight asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from ..bundle.manifest import ModelEntry

CALIBRATION_DIR = Path(__file__).with_name("calibration")
CALIBRATION_KINDS = ("prose", "code", "dialogue", "tool_call")
# Tokens per forward: each tapped activation is [n, K] fp32, so a Qwen-1.5B-sized graph's 4 inputs per
# layer (K = 1536, 1536, 1536, 8960) hold about 7 MB per layer at 128 tokens.
CHUNK = 128


def calibration_ids(encode: Callable[[str], list[int]], vocab_size: int, max_context: int) -> list[np.ndarray]:
    """Token ids of each calibration text (ids outside the graph's vocabulary dropped), cut to the context."""
    out = []
    for kind in CALIBRATION_KINDS:
        ids = [i for i in encode((CALIBRATION_DIR / f"{kind}.txt").read_text(encoding="utf-8")) if 0 <= i < vocab_size]
        if ids:
            out.append(np.asarray(ids[:max_context - 1], np.int64))
    return out


def weighted_inputs(graph: Path) -> dict[str, list[str]]:
    """Activation name -> the weights of the MatMuls that read it (a fused input may feed several)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    taps: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            taps.setdefault(node.input[0], []).append(node.input[1])
    return taps


class _Moment:
    """The running second moment of one input [K]: ``xᵀx`` [K, K] float32, or, while that would be bigger than
    the activations themselves (K > tokens), the activations [tokens, K] float32, multiplied out on request.

    ``spill``: a file for those activations (memory-mapped: the pages go to disk as they fill, so an 8B
    model's 7 GB of calibration activations need not be resident); None keeps them in memory."""

    def __init__(self, k: int, tokens: int, spill: Path | None = None) -> None:
        self.stack = k > tokens
        self.filled = 0
        self.product = None
        if not self.stack:
            self.product = np.zeros((k, k), np.float32)
        elif spill is None:
            self.rows = np.empty((tokens, k), np.float32)
        else:
            self.rows = np.memmap(spill, dtype=np.float32, mode="w+", shape=(tokens, k))

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32)
        if self.stack:
            self.rows[self.filled:self.filled + len(x)] = x
        else:
            self.product += x.T @ x
        self.filled += len(x)

    def mean(self, count: int) -> np.ndarray:
        if self.stack:
            x = self.rows[:self.filled]
            return (x.T @ x) / np.float32(max(count, 1))
        return self.product / np.float32(max(count, 1))


class Moments(Mapping):
    """Weight name -> E[x xᵀ] [K, K] float32 of its input over the calibration tokens, formed on each lookup
    from the input's :class:`_Moment` (weights that read one input share it; nothing [K, K] is kept that
    the calibration's activations hold in less)."""

    def __init__(self, moments: dict[str, _Moment], input_of: dict[str, str], count: int) -> None:
        self._moments, self._input_of, self._count = moments, input_of, count

    def __getitem__(self, weight: str) -> np.ndarray:
        return self._moments[self._input_of[weight]].mean(self._count)

    def __iter__(self):
        return iter(self._input_of)

    def __len__(self) -> int:
        return len(self._input_of)


def activation_moments(entry: "ModelEntry", graph: Path, token_lists: list[np.ndarray], *, threads: int = 0,
                       weights_of: Path | None = None, spill: Path | None = None,
                       progress: Callable[[int, int], None] | None = None) -> Moments:
    """As :func:`activation_importance`, but each weight's whole input second moment E[x xᵀ] [K, K] (for the
    ``-gptq`` mixes), formed when looked up. ``spill``: a folder (existing) for the activations kept as they
    are (:class:`_Moment`); the caller removes it when the moments are no longer needed."""
    taps = weighted_inputs(weights_of or graph)
    tokens = sum(len(ids) for ids in token_lists)
    moments: dict[str, _Moment] = {}

    def add(name: str, x: np.ndarray) -> None:
        if name not in moments:
            moments[name] = _Moment(x.shape[-1], tokens, None if spill is None else spill / f"{len(moments)}.f32")
        moments[name].add(x)

    count = _run_taps(entry, graph, token_lists, taps, add, threads=threads, progress=progress)
    return Moments(moments, {weight: name for name, weights in taps.items() for weight in weights if name in moments},
                   count)


def activation_importance(entry: "ModelEntry", graph: Path, token_lists: list[np.ndarray], *, threads: int = 0,
                          weights_of: Path | None = None,
                          progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Weight name -> E[x_k²] [K] float32 over every calibration token, for each MatMul over a constant weight of
    the fp32 graph ``weights_of`` (default ``graph``), measured by running ``graph`` (described by ``entry``):
    the fp32 graph itself, or, where a whole fp32 session would not fit the export's memory, a quantized copy
    of it (export/rtn.py keeps every MatMul's input name). ``progress(done, total)`` counts forwards."""
    taps = weighted_inputs(weights_of or graph)
    sums: dict[str, np.ndarray] = {}

    def add(name: str, x: np.ndarray) -> None:
        square = np.einsum("nk,nk->k", x, x)
        sums[name] = square if name not in sums else sums[name] + square

    count = _run_taps(entry, graph, token_lists, taps, add, threads=threads, progress=progress)
    return {weight: (sums[name] / max(count, 1)).astype(np.float32) for name, weights in taps.items()
            for weight in weights if name in sums}


def _run_taps(entry: "ModelEntry", graph: Path, token_lists: list[np.ndarray], taps: dict[str, list[str]],
              add: Callable[[str, np.ndarray], None], *, threads: int,
              progress: Callable[[int, int], None] | None) -> int:
    """Run ``graph`` over the calibration tokens with each tapped activation as an extra output; hand every
    chunk's activation [n, K] float64 to ``add(name, x)``; return the tokens run."""
    import onnx
    from onnx import TensorProto, helper

    from ..engines.base import EngineOptions
    from ..engines.ort import OrtEngine

    model = onnx.load(str(graph), load_external_data=False)
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                              for name in taps if name not in have)
    # beside the graph, so its external data file (a relative location) resolves the same way
    probe = graph.with_name(f"{graph.stem}.importance.onnx")
    onnx.save_model(model, str(probe))
    del model
    names = list(taps)
    count = 0
    total = sum(-(-len(ids) // CHUNK) for ids in token_lists)
    done = 0
    try:
        engine = OrtEngine(entry, probe, EngineOptions(intra_op_threads=threads, use_io_binding=False))
        for ids in token_lists:
            kv = engine.new_cache()
            for start in range(0, len(ids), CHUNK):
                chunk = ids[start:start + CHUNK]
                for name, x in zip(names, engine.outputs(chunk, kv, names)):
                    add(name, np.asarray(x, np.float64).reshape(-1, x.shape[-1]))
                count += len(chunk)
                done += 1
                if progress is not None:
                    progress(done, total)
        del engine
    finally:
        probe.unlink(missing_ok=True)
    return count
