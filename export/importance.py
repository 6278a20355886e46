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
"""

from __future__ import annotations

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


def activation_importance(entry: "ModelEntry", graph: Path, token_lists: list[np.ndarray], *, threads: int = 0,
                          weights_of: Path | None = None,
                          progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Weight name -> E[x_k²] [K] float32 over every calibration token, for each MatMul over a constant weight of
    the fp32 graph ``weights_of`` (default ``graph``), measured by running ``graph`` (described by ``entry``):
    the fp32 graph itself, or, where a whole fp32 session would not fit the export's memory, a quantized copy
    of it (export/rtn.py keeps every MatMul's input name). ``progress(done, total)`` counts forwards."""
    import onnx
    from onnx import TensorProto, helper

    from ..engines.base import EngineOptions
    from ..engines.ort import OrtEngine

    taps = weighted_inputs(weights_of or graph)
    model = onnx.load(str(graph), load_external_data=False)
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                              for name in taps if name not in have)
    # beside the graph, so its external data file (a relative location) resolves the same way
    probe = graph.with_name(f"{graph.stem}.importance.onnx")
    onnx.save_model(model, str(probe))
    del model
    names = list(taps)
    sums = {name: None for name in names}
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
                    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
                    square = np.einsum("nk,nk->k", x, x)
                    sums[name] = square if sums[name] is None else sums[name] + square
                count += len(chunk)
                done += 1
                if progress is not None:
                    progress(done, total)
        del engine
    finally:
        probe.unlink(missing_ok=True)
    return {weight: (sums[name] / max(count, 1)).astype(np.float32) for name, weights in taps.items()
            for weight in weights if sums[name] is not None}
