"""A screened output head: an int4 copy of an int8 head picks each position's likeliest tokens, and their
logits are computed again in fp32 from the int8 integers the bundle already holds.

Why: a 1-token step reads every weight once, and an int8 output head (the float mixes' and a GGUF's Q6_K
or Q8_0 head) is the biggest of them: 151936 x 1536 on Qwen2.5-Coder-1.5B, 233 MB of integers, about a
fifth of what its int4 step reads. The int4 screen reads half of that; the rescoring reads
:data:`SCREEN_ROWS` rows per position. A token outside the screen's top rows keeps its int4 logit: its
probability is too small for the rounding to move the greedy choice, and the KL divergence from the
source measured no change on Qwen 1.5B (docs/results/2026-12-07-screened-head.md).

The rewrite, after quantization (``x`` is the final hidden state [..., H], the head's input)::

    screen = MatMulNBits(x, head4)                   [..., V]  int4 copy of the int8 head
    rows   = TopK(screen, SCREEN_ROWS).indices       [..., R]
    w      = GatherBlockQuantized(head8, rows)       [..., R, H]  the int8 rows, dequantized
    exact  = (w @ x[..., None])[..., 0]              [..., R]  fp32
    logits = ScatterElements(screen, rows, exact)    [..., V]

Every op works per position, so a verify row's logits are computed as a single step's are (the int4
MatMulNBits varies with the row count exactly as every other layer's does; the export measures that as
the bundle's batch variance, as before). The copy only ranks tokens, so a fast-mode export writes it in
blocks of 128 (export/mixquant.py ``WIDE_INT8_BLOCK``: Qwen2.5-Coder-0.5B's step 1.08x faster than with
a copy of 32, for 0.0003 nats of KL); ``export --exact`` keeps the head's block, whose rows match at
every verify length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Rows each position rescores. 1024 kept Qwen 1.5B's KL divergence from the source at 0.0156 (the int8
# head's own) and SmolLM2's within 0.003 nats of it (64 rows: +0.014); the gather of 1024 int8 rows costs
# about a verify step's saving at 5 rows, so fewer rows would buy verify speed for quality.
SCREEN_ROWS = 1024
# Screen only a head at least this many times wider than the rows it rescores: below it the rescoring's
# gather reads a large share of what the int4 copy saves.
MIN_VOCAB_PER_ROW = 16
# ... and only a head of at least this many weights: the screen's TopK over the vocabulary, its gather and
# its nine small nodes cost about 2 ms a step on 2 cores whatever the head's size. Measured (paired 1-token
# steps, 2-core Xeon): SmolLM2's 49152 x 576 head (28M) 0.98x, Qwen2.5-Coder-0.5B's 151936 x 896 (136M)
# 1.05x, Qwen2.5-Coder-1.5B's 151936 x 1536 (233M) 1.05-1.09x; the break-even lies between 28M and 136M.
MIN_HEAD_ELEMENTS = 100_000_000
_CHUNK_ROWS = 16384  # head rows dequantized and rounded at a time (Qwen 1.5B: 100 MB of fp32)


@dataclass(frozen=True)
class ScreenedHead:
    """What :func:`add_head_screen` wrote: the head's shape and the rows each position rescores."""

    vocab: int
    hidden: int
    block: int
    rows: int
    copy_block: int  # the int4 copy's block (the int8 head's, or wider: export/mixquant.py WIDE_INT8_BLOCK)


def add_head_screen(graph_path: Path, vocab: int, rows: int = SCREEN_ROWS,
                    min_elements: int | None = None, copy_block: int | None = None) -> ScreenedHead | None:
    """Rewrite ``graph_path``'s 8-bit MatMulNBits output head (N == ``vocab``) as a screened head.

    The int4 copy (asymmetric, searched blocks of ``copy_block`` elements where that is wider than the
    head's block and divides the hidden size, else of the head's block; rounded from the int8 head's
    dequantized values) and the gather's scales are appended to the head's external data file. Returns
    None, the graph untouched, where there is nothing to screen or it would not pay: no 8-bit head,
    ``vocab`` below ``MIN_VOCAB_PER_ROW * rows``, or a head of fewer than ``min_elements`` weights
    (default :data:`MIN_HEAD_ELEMENTS`).
    """
    import onnx
    from onnx import TensorProto, helper

    from .mixquant import Blocks, TensorQuant, quantize
    from .rtn import DataFile, _read
    from .scales import read_scales, write_scales

    if rows < 1 or vocab < MIN_VOCAB_PER_ROW * rows:
        return None
    model = onnx.load(str(graph_path), load_external_data=False)
    graph = model.graph
    heads = [n for n in graph.node if n.op_type == "MatMulNBits" and _attrs(n).get("N") == vocab]
    if len(heads) != 1 or _attrs(heads[0])["bits"] != 8:
        return None
    head = heads[0]
    attrs = _attrs(head)
    hidden, block = attrs["K"], attrs["block_size"]
    if vocab * hidden < (MIN_HEAD_ELEMENTS if min_elements is None else min_elements):
        return None
    inits = {t.name: t for t in graph.initializer}
    data = inits[head.input[1]]
    zero_points = inits.get(head.input[3]) if len(head.input) > 3 and head.input[3] else None
    if any(name for name in head.input[4:]) or data.data_location != TensorProto.EXTERNAL:
        return None  # g_idx or a bias: not a head this exporter writes
    folder = graph_path.parent
    location = next(e.value for e in data.external_data if e.key == "location")
    n_blocks = hidden // block
    if copy_block is None or copy_block < block or hidden % copy_block:
        copy_block = block
    form = TensorQuant(4, copy_block, symmetric=False, search=True)
    packed, screen_scales, screen_zero_points = [], [], []
    all_scales = read_scales(graph, head.input[2], folder).reshape(vocab, n_blocks)
    symmetric = zero_points is None
    all_zero_points = (np.full((vocab, n_blocks), 1 << 7, np.uint8) if symmetric  # the kernels' 8-bit default
                       else _read(zero_points, folder).reshape(vocab, n_blocks))
    for start in range(0, vocab, _CHUNK_ROWS):
        span = slice(start, min(start + _CHUNK_ROWS, vocab))
        q = _read(data, folder, span).reshape(-1, n_blocks, block)
        weight = Blocks(q, all_scales[span], all_zero_points[span], 8, symmetric).dequantize()
        blocks = quantize(weight, form)
        packed.append(blocks.packed())
        screen_scales.append(blocks.scales)
        screen_zero_points.append(blocks.packed_zero_points())

    name = head.name or "lm_head"

    def t(suffix: str) -> str:
        return f"{name}_screen_{suffix}"

    out = DataFile(folder / location, append=True)
    try:
        q4 = out.tensor(f"{name}_screen_Q4", TensorProto.UINT8, (vocab, hidden // copy_block, copy_block // 2),
                        np.concatenate(packed))
        s4 = write_scales(out, f"{name}_screen_scales", np.concatenate(screen_scales))
        z4 = np.concatenate(screen_zero_points)
        z4 = out.tensor(f"{name}_screen_zero_points", TensorProto.UINT8, z4.shape, z4)
        # GatherBlockQuantized takes its scales (and zero points) shaped like the data's block axis; a copy in
        # float32, which the lookup reads from the file page by page (export/scales.py)
        s3 = write_scales(out, f"{name}_rescore_scales", all_scales, (vocab, n_blocks, 1), half=False)
        new_inits = [q4, *s4.initializers, z4, *s3.initializers]
        gather_inputs = [head.input[1], t("rows"), s3.name]
        if not symmetric:
            z3 = out.tensor(f"{name}_rescore_zero_points", TensorProto.UINT8, (vocab, n_blocks, 1), all_zero_points)
            new_inits.append(z3)
            gather_inputs.append(z3.name)
    finally:
        out.close()
    consts = [helper.make_tensor(t("k"), TensorProto.INT64, [1], [rows]),
              helper.make_tensor(t("width"), TensorProto.INT64, [1], [hidden]),
              helper.make_tensor(t("axis"), TensorProto.INT64, [1], [-1])]
    rows_c, hidden_c, last_c = (c.name for c in consts)
    x, logits = head.input[0], head.output[0]
    level = {"accuracy_level": attrs["accuracy_level"]} if "accuracy_level" in attrs else {}
    nodes = [
        *s4.nodes, *s3.nodes,
        helper.make_node("MatMulNBits", [x, q4.name, s4.name, z4.name], [t("logits")], name=t("matmul"),
                         domain="com.microsoft", K=hidden, N=vocab, bits=4, block_size=copy_block, **level),
        helper.make_node("TopK", [t("logits"), rows_c], [t("top"), t("rows")], name=t("topk"),
                         axis=-1, largest=1, sorted=0),
        helper.make_node("GatherBlockQuantized", gather_inputs, [t("blocks")], name=t("gather"),
                         domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=block, bits=8),
        helper.make_node("Shape", [t("rows")], [t("rows_shape")], name=t("rows_shape")),
        helper.make_node("Concat", [t("rows_shape"), hidden_c], [t("weights_shape")], name=t("weights_shape"),
                         axis=0),
        helper.make_node("Reshape", [t("blocks"), t("weights_shape")], [t("weights")], name=t("weights")),
        helper.make_node("Unsqueeze", [x, last_c], [t("x")], name=t("x")),
        helper.make_node("MatMul", [t("weights"), t("x")], [t("exact_col")], name=t("rescore")),
        helper.make_node("Squeeze", [t("exact_col"), last_c], [t("exact")], name=t("exact")),
        helper.make_node("ScatterElements", [t("logits"), t("rows"), t("exact")], [logits], name=t("scatter"),
                         axis=-1),
    ]
    at = list(graph.node).index(head)
    graph.node.remove(head)
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)
    # the head's scales were read above; the Cast or Reshape that made them for it alone goes too
    maker = next((n for n in graph.node if head.input[2] in n.output and n.op_type in ("Cast", "Reshape")), None)
    if maker is not None and not any(head.input[2] in n.input for n in graph.node):
        graph.node.remove(maker)
    used = {i for n in graph.node for i in n.input}
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits + consts)
    onnx.save_model(model, str(graph_path))
    return ScreenedHead(vocab, hidden, block, rows, copy_block)


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}
