"""The screened output head (export/head_screen.py, issue #36): an int4 copy of the int8 head picks each
position's top rows, whose logits are computed again in fp32 from the int8 integers.

Invariants:
* the export rewrites exactly the int8 head of an int4 target and draft, and nothing where the vocabulary is
  too small for the rows or the option is 0;
* on every position the screened logits of the rescored rows equal the int8 head's up to the int8-activation
  rounding of MatMulNBits, the greedy token equals the unscreened graph's, and every other token keeps the
  int4 copy's logit (below the rescored maximum);
* exact-mode speculation with a screened target and draft equals plain greedy decoding;
* a negative row count is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from tiny_models import assert_model_drafts_equal_plain

ROWS = 16  # the tiny vocabulary (300) holds MIN_VOCAB_PER_ROW * 16 = 256 rows: the screen applies


@pytest.fixture(autouse=True)
def tiny_heads_are_screened(monkeypatch):
    """The tiny models' heads are far below the size where the screen pays (MIN_HEAD_ELEMENTS)."""
    from specedge.export import head_screen

    monkeypatch.setattr(head_screen, "MIN_HEAD_ELEMENTS", 0)


@pytest.fixture
def screened(tiny_model, export) -> Path:
    return export(tiny_model("llama"), draft="self-int4", precision="int4", head_screen_rows=ROWS)


@pytest.fixture
def unscreened(tiny_model, export) -> Path:
    return export(tiny_model("llama"), draft="self-int4", precision="int4", head_screen_rows=0)


def _ops(graph: Path) -> list:
    import onnx

    return list(onnx.load(str(graph), load_external_data=False).graph.node)


def _bits(node) -> int:
    return next(a.i for a in node.attribute if a.name == "bits")


@pytest.mark.parametrize("role", ["target", "draft"])
def test_export_screens_the_int8_head(screened, unscreened, role):
    heads = [n for n in _ops(screened / role / "model.onnx")
             if n.op_type == "MatMulNBits" and any(a.name == "N" and a.i == 300 for a in n.attribute)]
    assert [_bits(n) for n in heads] == [4]  # the int8 head is read only through the rescoring gather
    ops = {n.op_type for n in _ops(screened / role / "model.onnx")}
    assert {"TopK", "ScatterElements"} <= ops
    # the int8 head's own float16 scales went with it: no Cast is left making what nothing reads
    nodes = _ops(screened / role / "model.onnx")
    read = {i for n in nodes for i in n.input}
    assert all(n.output[0] in read for n in nodes if n.op_type == "Cast")
    plain = _ops(unscreened / role / "model.onnx")
    assert not {"TopK", "ScatterElements"} & {n.op_type for n in plain}
    assert [_bits(n) for n in plain if n.op_type == "MatMulNBits" and any(
        a.name == "N" and a.i == 300 for a in n.attribute)] == [8]


def test_a_small_vocabulary_or_zero_rows_is_left_alone(unscreened, tmp_path):
    import shutil

    from specedge.export.head_screen import MIN_VOCAB_PER_ROW, add_head_screen

    folder = shutil.copytree(unscreened / "target", tmp_path / "target")
    graph = folder / "model.onnx"
    before = graph.read_bytes()
    assert add_head_screen(graph, 300, rows=300 // MIN_VOCAB_PER_ROW + 1, min_elements=0) is None
    assert add_head_screen(graph, 300, rows=ROWS, min_elements=10**9) is None  # too small a head to pay
    assert add_head_screen(graph, 300, rows=0, min_elements=0) is None
    assert add_head_screen(graph, 301, rows=ROWS, min_elements=0) is None  # no head of that width
    assert graph.read_bytes() == before


def _prefill_logits(bundle: Path, ids: list[int]) -> np.ndarray:
    from specedge.bundle.manifest import load_manifest
    from specedge.engines.ort import OrtEngine

    entry = load_manifest(bundle).target
    engine = OrtEngine(entry, bundle / entry.graph)
    kv = engine.new_cache()
    return engine.forward(np.asarray(ids, np.int64), kv, num_logits=len(ids)).reshape(len(ids), -1).copy()


def test_rescored_rows_match_the_int8_head(screened, unscreened):
    ids = [1, 5, 9, 13, 2, 7, 40, 41, 42, 100, 200, 250, 17, 3]
    got, want = _prefill_logits(screened, ids), _prefill_logits(unscreened, ids)
    assert got.shape == want.shape == (len(ids), 300)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    scale = np.abs(want).max()
    for row_got, row_want in zip(got, want):
        top = np.argsort(-row_got)[:ROWS // 2]  # certainly among the rescored rows (the screen's top ROWS)
        # fp32 rescoring vs MatMulNBits' int8 activations: within its rounding, far below the logits' spread
        np.testing.assert_allclose(row_got[top], row_want[top], atol=2e-2 * scale)
    # rows outside the screen keep the int4 copy's logits: close to the int8 head's, not equal to them
    differs = np.abs(got - want) > 1e-6 * scale
    assert differs.any()


def test_exact_speculation_with_a_screened_head_equals_plain(tiny_model, export, load_generator):
    bundle = export(tiny_model("llama"), draft="self-int4", precision="int4", head_screen_rows=ROWS, exact=True)
    assert_model_drafts_equal_plain(load_generator(bundle))


def _screen_block(bundle: Path, role: str = "target") -> int:
    matmul = next(n for n in _ops(bundle / role / "model.onnx") if n.name.endswith("_screen_matmul"))
    return next(a.i for a in matmul.attribute if a.name == "block_size")


def test_a_fast_export_widens_the_screen_copy_and_an_exact_one_keeps_the_head_block(tiny_model, export):
    from specedge.export.mixquant import WIDE_INT8_BLOCK

    model = tiny_model("llama", config={"hidden_size": 128, "intermediate_size": 256})
    fast = export(model, draft="self-int4", precision="int4", head_screen_rows=ROWS)
    exact = export(model, draft="self-int4", precision="int4", head_screen_rows=ROWS, exact=True)
    assert _screen_block(fast) == _screen_block(fast, "draft") == WIDE_INT8_BLOCK == 128
    assert _screen_block(exact) == 32  # the int8 head's block: row-invariant kernels
    assert _screen_block(exact, "draft") == WIDE_INT8_BLOCK  # a draft's rows never reach the output
    # the wide copy only ranks: the greedy token is the int8 head's on every position
    ids = [1, 5, 9, 13, 2, 7, 40, 41, 42, 100, 200, 250, 17, 3]
    for screened, exact_layout in ((fast, False), (exact, True)):  # each beside its own layout's int8 head
        unscreened = export(model, draft="self-int4", precision="int4", head_screen_rows=0, exact=exact_layout)
        assert (_prefill_logits(screened, ids).argmax(-1) == _prefill_logits(unscreened, ids).argmax(-1)).all()


def test_a_copy_block_that_does_not_divide_the_hidden_size_falls_back_to_the_head_block(unscreened, tmp_path):
    import shutil

    from specedge.export.head_screen import add_head_screen

    folder = shutil.copytree(unscreened / "target", tmp_path / "target")
    screened = add_head_screen(folder / "model.onnx", 300, rows=ROWS, min_elements=0, copy_block=128)
    assert screened is not None and screened.hidden == 64 and screened.copy_block == screened.block == 32


def test_negative_rows_are_refused():
    from specedge.export.bundle import ExportConfig

    with pytest.raises(InvalidParameterError, match="head_screen_rows must be >= 0"):
        ExportConfig(target="x", out=Path("y"), head_screen_rows=-1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
def test_a_gguf_head_kept_at_8_bits_is_screened(kind, tiny_model, tmp_path, monkeypatch):
    """A GGUF's Q8_0 (tied: the embedding's blocks) or Q6_K output head, kept as 8-bit MatMulNBits, is screened,
    and greedy tokens equal the unscreened bundle's on every position."""
    from specedge.export.bundle import ExportConfig, export_bundle
    from tiny_models import gemma_tokens, write_gguf

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))  # the dequantized folder lands here
    if kind == "Q8_0":  # gemma3 ties its head to the embedding
        folder = tiny_model("gemma3_text", seed=3, vocab_size=len(gemma_tokens()))
        types = {"token_embd.weight": kind}
    else:  # qwen3 at a width K-quants take, with its own output layer
        folder = tiny_model("qwen3", seed=0, config={"hidden_size": 256, "intermediate_size": 512, "head_dim": 128})
        types = {"token_embd.weight": "Q8_0", "output.weight": kind}
    source = write_gguf(folder, tmp_path / f"{kind}.gguf", types=types)
    bundles = {}
    for rows in (ROWS, 0):
        bundles[rows] = tmp_path / f"b{rows}"
        export_bundle(ExportConfig(target=str(source), out=bundles[rows], precision="int4", quiet=True, max_context=64,
                                   head_screen_rows=rows))
    from specedge.bundle.manifest import load_manifest

    kept = load_manifest(bundles[ROWS]).extra.gguf_import["target"]["lm_head"]
    assert kept.sources == (("token_embd.weight",) if kind == "Q8_0" else ("output.weight",))
    assert "TopK" in {n.op_type for n in _ops(bundles[ROWS] / "target" / "model.onnx")}
    ids = list(range(3, 40, 3))
    got, want = _prefill_logits(bundles[ROWS], ids), _prefill_logits(bundles[0], ids)
    assert (got.argmax(-1) == want.argmax(-1)).all()
