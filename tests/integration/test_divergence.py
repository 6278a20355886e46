"""Divergence diagnosis: find the first differing token and the target's top-2 gap there.

Guards the near-tie claim for quantized bundles: the tool that backs it must find
the right index and measure the gap from the target's own logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.export.bundle import ExportConfig, export_bundle
from specedge.runtime.divergence import explain, first_divergence
from specedge.runtime.generator import Generator
from specedge.runtime.verify import NEAR_TIE_GAP

from tiny_models import build_model


@pytest.mark.parametrize("a, b, want", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1),
                                        ([1, 2], [1, 2, 3], 2), ([], [4], 0),
                                        ([1, 2, 3], [1, 2], 2), ([1, 2, 3, 4], [1, 2, 9, 4], 2)])
def test_first_divergence(a, b, want):
    assert first_divergence(a, b) == want


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    root = tmp_path_factory.mktemp("div")
    folder = build_model(root / "m", "llama", seed=5)
    export_bundle(ExportConfig(target=str(folder), out=root / "b", max_context=128, quiet=True))
    return Generator.from_bundle(root / "b")


def test_explain_measures_gap_at_first_divergence(gen):
    prompt = [6, 7, 8, 9]
    base = gen.generate(input_ids=prompt, max_new_tokens=12, speculation=False).token_ids
    other = base[:5] + [(base[5] + 1) % 300] + base[6:]
    d = explain(gen.target, prompt, base, other)
    assert d.index == 5 and d.tokens == (base[5], other[5])
    kv = gen.target.new_cache()
    logits = gen.target.forward(np.array(prompt + base[:5]), kv, 1)[-1].astype(np.float64)
    top = np.sort(logits)[-2:]
    assert d.top2_gap == pytest.approx(top[1] - top[0])
    assert d.near_tie == (d.top2_gap < NEAR_TIE_GAP)
    assert explain(gen.target, prompt, base, base) is None


def test_batch_variance_counts_only_the_tokens_that_could_win():
    """The near-tie bound (export/validate.py batch_variance) is measured where an argmax can flip: among
    each row's top tokens. A screened head's tail moves with the row count by up to a logit; that must not
    widen the bound, while a difference at the top must."""
    from specedge.export.validate import _top_difference

    rng = np.random.default_rng(0)
    step = rng.normal(size=(3, 1000))
    step[:, :10] += 20.0  # the ten tokens that can win
    step[:, 500:] -= 20.0  # the unrescored tail, far below
    tail_moved = step.copy()
    tail_moved[:, 500:] += rng.uniform(-1.0, 1.0, size=(3, 500))
    assert _top_difference(tail_moved, step, 64) == 0.0
    assert _top_difference(tail_moved, step, 1000) == pytest.approx(np.abs(tail_moved - step).max())  # whole row
    top_moved = step.copy()
    top_moved[1, 3] -= 0.25
    assert _top_difference(top_moved, step, 64) == pytest.approx(0.25)
    # A token that climbs into one row's top only (it is in b's top, not a's) still counts.
    climbed = step.copy()
    climbed[2, 900] = 30.0
    assert _top_difference(step, climbed, 4) == pytest.approx(30.0 - step[2, 900])
    assert _top_difference(climbed, step, 4) == pytest.approx(30.0 - step[2, 900])
