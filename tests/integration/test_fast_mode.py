"""Invariant: fast mode (the default: 1-row plain steps) changes greedy tokens only at near ties.

A verify row goes through other kernels than a 1-row plain step (a GEMM, not a GEMV), so in fast
mode greedy speculative output may differ from 1-row plain decoding, but only where the target's
top-2 logits nearly tie: at the first position where the two differ, the target's top-2 gap
(runtime/divergence.py ``explain``) must be below the bundle's near-tie gap
(``Generator.near_tie_gap``, runtime/verify.py). A divergence at a clear winner is a bug.

- Checked on an fp32 target with its own fp32 draft, an int4 target whose weights give top-2 gaps
  of a few hundredths (near ties are common: the int4 1-row and multi-row steps differ by up to
  about a logit), and the tiny gpt2 (standard attention, no draft), for several prompts, every
  drafter (draft model, n-gram, suffix, the default auto) and k in {1, 2, 4, 8} and adaptive.
- Sampling in fast mode keeps the target's distribution (chi-square against exact-mode plain sampling).
- Exact mode is refused by name on a bundle whose export recorded its target as not row-invariant
  (``extra.exact_steps.target.bit_identical`` false), while fast mode runs it as usual.
Exact mode's token-for-token promise: test_speculative_oracle.py, test_exact_quantized.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from distribution import assert_same_distribution, token_counts
from specedge.errors import InvalidParameterError
from specedge.runtime.divergence import explain, first_divergence
from specedge.runtime.generator import GenerationConfig, Generator
from tiny_models import edit_manifest

N_TOKENS = 40
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(6, 300, size=2 + 3 * i)] for i in range(6)]
DRAFT_TOKENS = [1, 2, 4, 8, None]  # None: adaptive k
# Weights of std 0.05 (test_exact_quantized.py's near-tie target): top-2 gaps of a few hundredths.
NEAR_TIE_STD = 0.05

@pytest.fixture(scope="module")
def bundles(self_spec_bundle, tiny_model, export, arch_bundle):
    """name -> (private Generator, drafters to check). Private: this module's replies and learned
    costs stay out of the shared Generators other modules compare in exact mode."""
    int4 = export(tiny_model("llama", 3, config={"initializer_range": NEAR_TIE_STD}), draft="self-int4",
                  precision="int4")
    loaded = {}

    def get(name: str):
        if name not in loaded:
            path = {"fp32": self_spec_bundle, "int4": int4, "gpt2": arch_bundle("gpt2")}[name]
            gen = Generator.from_bundle(path, threads=1)
            drafters = ("model", "ngram", "suffix", "auto") if gen.draft is not None else ("ngram", "suffix", "auto")
            loaded[name] = gen, drafters
        return loaded[name]

    return get


@pytest.mark.parametrize("name", ["fp32", "int4", "gpt2"])
def test_fast_speculation_differs_from_fast_plain_decoding_only_at_near_ties(name, bundles):
    gen, drafters = bundles(name)
    assert GenerationConfig().exact is False  # the default is fast mode
    compared, divergences = 0, []
    for p, prompt in enumerate(PROMPTS):
        # Cold starts on both sides: what differs is the plain steps' kernels, not a reused prefix.
        plain = gen.generate(input_ids=prompt, max_new_tokens=N_TOKENS, speculation=False, chat=False,
                             reuse_prefix=False)
        assert plain.stats.steps == len(plain.token_ids) - 1
        for drafter in drafters:
            for k in DRAFT_TOKENS:
                spec = gen.generate(input_ids=prompt, max_new_tokens=N_TOKENS, chat=False, drafter=drafter,
                                    draft_tokens=k, adaptive=k is None, reuse_prefix=False)
                compared += 1
                i = first_divergence(plain.token_ids, spec.token_ids)
                if i is None:
                    continue
                where = f"{name} {drafter} k={k} prompt {p}"
                assert i < min(len(plain.token_ids), len(spec.token_ids)), f"{where}: one run stopped early"
                d = explain(gen.target.inner, prompt, plain.token_ids, spec.token_ids, near_tie=gen.near_tie_gap)
                assert d.near_tie, f"{where}: diverged from plain decoding at a clear winner: {d.as_dict()}"
                divergences.append(f"{where}: token {d.index}, top-2 gap {d.top2_gap:.4g} < {d.threshold:.4g}")
    # Every comparison ran (on int4, where divergences are likely, too); what they met, with -s:
    assert compared == len(PROMPTS) * len(drafters) * len(DRAFT_TOKENS) > 0
    print(f"\n[fast mode] {name}: {compared} comparisons, {len(divergences)} near-tie divergences",
          *divergences, sep="\n  ")


def test_fast_sampling_keeps_the_target_distribution(sampling_pair):
    """Fast-mode speculative sampling (1-row plain steps, lookups and the perturbed draft model; the
    chi-square tests elsewhere run the default, fast mode too, but do not pin it)
    commits tokens distributed as exact-mode plain sampling's (chi-square, p = 0.001)."""
    prompt = [3, 5, 3, 5, 3, 5, 7]
    sampling_pair.forget_replies()
    try:
        plain = token_counts(sampling_pair, prompt, 500, 16, speculation=False, exact=True)
        fast = token_counts(sampling_pair, prompt, 500, 16, drafter="auto", draft_tokens=2, adaptive=False,
                            exact=False)
        stats = sampling_pair.generate(input_ids=prompt, max_new_tokens=8, temperature=1.0, seed=0, drafter="auto",
                                       draft_tokens=2, adaptive=False, exact=False).stats
        assert stats.drafted > 0
        assert_same_distribution(plain, fast)
    finally:
        sampling_pair.forget_replies()


def test_exact_mode_is_refused_on_a_target_recorded_as_not_row_invariant(self_spec_bundle, bundle_copy, tmp_path):
    bundle = bundle_copy(self_spec_bundle)
    assert Generator.from_bundle(bundle, threads=1).manifest.extra.exact_steps["target"].bit_identical

    def not_row_invariant(obj):
        obj["extra"]["exact_steps"]["target"]["bit_identical"] = False

    edit_manifest(bundle, not_row_invariant)  # manifest.json carries no checksum of its own
    gen = Generator.from_bundle(bundle, threads=1)
    prompt = PROMPTS[2]
    for call in (gen.generate, gen.stream, gen.prefill):  # refused at the call, before anything runs
        with pytest.raises(InvalidParameterError, match="not row-invariant"):
            call(input_ids=prompt, exact=True)
    with pytest.raises(InvalidParameterError, match=r"not row-invariant .*extra\.exact_steps\.target\.bit_identical"):
        gen.generate(input_ids=prompt, config=GenerationConfig(exact=True))
    with pytest.raises(InvalidParameterError, match="not row-invariant"):
        gen.load_prompt_cache(tmp_path / "never-read.cache", exact=True)
    # Fast mode runs it as usual, plain and speculative.
    plain = gen.generate(input_ids=prompt, max_new_tokens=8, speculation=False)
    spec = gen.generate(input_ids=prompt, max_new_tokens=8, drafter="model", draft_tokens=4)
    assert len(plain.token_ids) == len(spec.token_ids) == 8 and spec.stats.drafted > 0
