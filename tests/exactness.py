"""Which greedy promise a bundle keeps on this machine, for tests that compare two greedy runs.

Exact mode (``exact=True``) makes greedy speculation equal plain decoding token for token, but only
on a target whose 2-row plain steps equal its verify rows bit for bit; export checks that on its
machine and records it (``extra.exact_steps.target.bit_identical``), and the Generator refuses
exact mode where the record says no (e.g. the standard-attention graphs on an AVX-512 EPYC). There
a test can only hold fast mode's promise: the two runs agree, or at their first difference the
target's top-2 logits nearly tie (below ``Generator.near_tie_gap``). Asserting equality in fast
mode would pass by luck, so a test asks :func:`exact_holds` which promise to check.
"""

from __future__ import annotations

from typing import Sequence

from specedge.runtime.divergence import explain, first_divergence


def exact_holds(gen) -> bool:
    """Whether exact mode runs on ``gen``'s bundle (its target recorded row-invariant, or no record)."""
    record = gen.manifest.extra.exact_steps.get("target")
    return record is None or record.bit_identical


def assert_agrees(gen, prompt_ids: Sequence[int], plain: Sequence[int], other: Sequence[int], *,
                  exact: bool) -> None:
    """``exact``: ``other`` equals ``plain`` token for token. Fast mode: equal, or the first token
    where they differ is a near tie of the target (one run may not simply stop early)."""
    plain, other = list(plain), list(other)
    if exact:
        assert other == plain
        return
    i = first_divergence(plain, other)
    if i is None:
        return
    assert i < min(len(plain), len(other)), f"one run is a prefix of the other (lengths {len(plain)}, {len(other)})"
    d = explain(gen.target.inner, prompt_ids, plain, other, near_tie=gen.near_tie_gap)
    assert d.near_tie, f"fast mode diverged from plain decoding at a clear winner: {d.as_dict()}"
