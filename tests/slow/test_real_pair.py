"""Invariant, on a real draft/target pair: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B
(both fp32) leaves the greedy output (exact mode) exactly as plain decoding of the 1.5B gives it.

Both GGUFs come from the catalog (1.6 GB in all, cached under $SPECEDGE_CACHE or
~/.cache/specedge). The export dequantizes both (cached), builds and validates two
graphs, and needs several GB of RAM: about 10 minutes on 2 cores. Run it with
``-m real_pair``; set SPECEDGE_REAL_PAIR_BUNDLE to reuse an fp32 bundle of the pair.
"""

from __future__ import annotations

import os

import pytest

from specedge.errors import FetchError

pytestmark = [pytest.mark.slow, pytest.mark.real_pair]

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
N_TOKENS = 64
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain what a hash map is, then show a minimal example in C."]


@pytest.fixture(scope="module")
def pair_generator(tmp_path_factory):
    from specedge.export.bundle import ExportConfig, export_bundle
    from specedge.export.fetch import fetch
    from specedge.runtime.generator import Generator

    try:
        for name in (TARGET, DRAFT):
            fetch(name, progress=False)
    except FetchError as exc:
        pytest.skip(f"cannot fetch the Qwen2.5-Coder pair: {exc}")
    reuse = os.environ.get("SPECEDGE_REAL_PAIR_BUNDLE")  # an fp32 bundle of this pair exported earlier
    if reuse:
        return Generator.from_bundle(reuse)
    bundle = tmp_path_factory.mktemp("qwen-pair") / "bundle"
    export_bundle(ExportConfig(target=TARGET, draft=DRAFT, out=bundle, precision="fp32", max_context=1024,
                               quiet=True))
    return Generator.from_bundle(bundle)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_greedy_equals_the_baseline(prompt, pair_generator):
    gen = pair_generator
    assert gen.manifest.draft is not None and gen.manifest.draft.vocab_size == gen.manifest.target.vocab_size
    base = gen.generate(prompt, max_new_tokens=N_TOKENS, speculation=False, exact=True)
    assert len(base.token_ids) > 16
    for options in ({"drafter": "model", "draft_tokens": 4}, {"drafter": "composite"}, {}):
        spec = gen.generate(prompt, max_new_tokens=N_TOKENS, exact=True, **options)
        assert spec.token_ids == base.token_ids, options
        assert spec.stats.accepted <= spec.stats.drafted
        if "draft_tokens" in options:  # fixed k always drafts (adaptive k may decide not to)
            assert spec.stats.accepted > 0
