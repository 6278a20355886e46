"""A bounded draft catch-up (the draft window) changes what the draft reads, never the output.

Guards:
- after a bridge, the draft's cache holds exactly ``history[:head] + history[tail:]`` at
  contiguous positions, and its proposals equal a fresh draft run on that sequence;
- a bridge after plain steps keeps everything the cache already held as its head, and a
  rejection inside the bridged tail rewinds to the right token;
- greedy output with a tiny window equals plain greedy in exact mode (fixed k and adaptive), and the
  catch-up never feeds more than the window;
- sampling with a window keeps the target's distribution (chi-square homogeneity);
- an invalid window is refused with a clear message before anything runs;
- adaptive speculation never runs the draft when its catch-up cannot pay off.
"""

from __future__ import annotations

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from specedge.export.bundle import ExportConfig, export_bundle
from specedge.runtime.costs import CostModel
from specedge.runtime.memory import SpeculationMemory
from specedge.runtime.drafters import CompositeDrafter, ModelDrafter, NGramDrafter
from specedge.runtime.generator import GenerationConfig, Generator
from specedge.runtime.sampling import SamplingConfig

from distribution import assert_same_distribution, token_counts
from tiny_models import build_model

LONG_PROMPT = [int(t) for t in np.random.default_rng(4).integers(6, 290, size=40)]  # greedy runs 40 tokens, no EOS
SINK = ModelDrafter.SINK_TOKENS


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    target = build_model(root / "target", "llama", seed=11)
    draft = build_model(root / "draft", "llama", seed=12, perturb=(target, 0.6))
    export_bundle(ExportConfig(target=str(target), draft=str(draft), out=root / "b", max_context=256, quiet=True))
    return Generator.from_bundle(root / "b")


def fresh_greedy(gen: Generator, sequence: list[int], k: int) -> list[int]:
    """k greedy draft tokens continuing ``sequence``, from an empty draft cache."""
    cache = gen.draft.new_cache()
    tokens, feed = [], np.asarray(sequence, np.int64)
    for _ in range(k):
        logits = gen.draft.forward(feed, cache, num_logits=1)[-1]
        tokens.append(int(np.argmax(logits)))
        feed = np.asarray(tokens[-1:], np.int64)
    return tokens


def drafter(gen: Generator, window: int | None) -> ModelDrafter:
    return ModelDrafter(gen.draft, SamplingConfig(), cache=gen.draft.new_cache(), window=window)


def test_bridged_prefill_equals_a_fresh_run_on_the_bridged_sequence(gen):
    d = drafter(gen, window=8)
    d.begin(np.asarray(LONG_PROMPT))
    history = np.asarray(LONG_PROMPT, np.int64)
    proposal = d.propose(history, 3).tokens.tolist()
    bridged = LONG_PROMPT[:SINK] + LONG_PROMPT[-(8 - SINK):]
    assert proposal == fresh_greedy(gen, bridged, 3)
    assert d.cached == bridged + proposal[:-1]
    assert d.catchup_tokens == 8
    assert d.cache.length == len(d.cached)


def test_no_window_reads_the_whole_prompt(gen):
    d = drafter(gen, window=None)
    d.begin(np.asarray(LONG_PROMPT))
    proposal = d.propose(np.asarray(LONG_PROMPT, np.int64), 3).tokens.tolist()
    assert proposal == fresh_greedy(gen, LONG_PROMPT, 3)
    assert d.catchup_tokens == len(LONG_PROMPT)


def test_bridge_after_plain_steps_keeps_the_cached_head_and_rewinds_inside_the_tail(gen):
    d = drafter(gen, window=12)
    first = LONG_PROMPT[:10]
    d.begin(np.asarray(first))
    drafted = d.propose(np.asarray(first, np.int64), 2).tokens.tolist()  # 10 <= 12: no bridge
    assert d.cached == first + drafted[:1]
    # The target rejects everything and then runs 25 plain steps the draft never sees.
    later = first + [int(t) for t in np.random.default_rng(9).integers(6, 290, size=26)]
    d.accept(np.asarray(later[:11], np.int64), 0)
    proposal = d.propose(np.asarray(later, np.int64), 3).tokens.tolist()
    bridged = later[:10] + later[-12:]  # the cache's agreeing head (the prompt), then the newest 12
    assert d.cached == bridged + proposal[:-1]
    assert proposal == fresh_greedy(gen, bridged, 3)
    # A correction inside the bridged tail: the committed history diverges from the proposal
    # at its second token, so the cache keeps the tail + the first proposed token only.
    other = (proposal[1] + 1) % 290 or 6
    corrected = later + [proposal[0], other]
    d.accept(np.asarray(corrected, np.int64), 1)
    assert d.cached == bridged + [proposal[0]]
    again = d.propose(np.asarray(corrected, np.int64), 2).tokens.tolist()
    assert again == fresh_greedy(gen, bridged + [proposal[0], other], 2)


def test_a_second_gap_replaces_the_first_tail(gen):
    d = drafter(gen, window=8)
    d.begin(np.asarray(LONG_PROMPT))
    d.propose(np.asarray(LONG_PROMPT, np.int64), 1)
    longer = LONG_PROMPT + [int(t) for t in np.random.default_rng(4).integers(6, 290, size=30)]
    d.accept(np.asarray(longer, np.int64), 0)
    proposal = d.propose(np.asarray(longer, np.int64), 2).tokens.tolist()
    # The sink is already cached, so the whole window of 8 fed tokens goes to the new tail.
    bridged = longer[:SINK] + longer[-8:]
    assert d.cached == bridged + proposal[:-1]
    assert proposal == fresh_greedy(gen, bridged, 2)


@pytest.fixture(scope="module")
def baseline(gen):
    tokens = gen.generate(input_ids=LONG_PROMPT, max_new_tokens=40, speculation=False, exact=True).token_ids
    assert len(tokens) == 40
    return tokens


@pytest.mark.parametrize("draft_tokens", [1, 4, None])
def test_windowed_greedy_equals_plain(gen, baseline, draft_tokens):
    # A cold start: with the slot's draft cache kept, a repeated prompt would need no catch-up at all.
    out = gen.generate(input_ids=LONG_PROMPT, max_new_tokens=40, drafter="model", draft_tokens=draft_tokens,
                       draft_window=8, reuse_prefix=False, exact=True)
    assert out.token_ids == baseline
    if draft_tokens is not None:  # fixed k: one catch-up, at the first propose
        assert 0 < out.stats.catchup_tokens <= 8
        assert out.stats.drafted > 0


def test_windowed_self_speculation_still_accepts_most_tokens(tmp_path_factory):
    """Self-speculation through a window reads a shortened context, so acceptance may dip
    below 1.0, but the output stays the target's."""
    root = tmp_path_factory.mktemp("window-self")
    target = build_model(root / "t", "llama", seed=11)
    export_bundle(ExportConfig(target=str(target), draft=str(target), out=root / "b", max_context=256, quiet=True))
    g = Generator.from_bundle(root / "b")
    plain = g.generate(input_ids=LONG_PROMPT, max_new_tokens=40, speculation=False, exact=True).token_ids
    full = g.generate(input_ids=LONG_PROMPT, max_new_tokens=40, drafter="model", draft_tokens=4, draft_window=None, exact=True)
    windowed = g.generate(input_ids=LONG_PROMPT, max_new_tokens=40, drafter="model", draft_tokens=4, draft_window=8,
                         reuse_prefix=False, exact=True)  # a cold draft: what the window bounds
    assert full.token_ids == plain == windowed.token_ids
    assert full.stats.acceptance == 1.0
    assert full.stats.catchup_tokens == len(LONG_PROMPT) + 1  # the prompt and the prefill's token
    assert windowed.stats.catchup_tokens == 8


def test_windowed_sampling_matches_plain_sampling_distribution(sampling_pair):
    g = sampling_pair
    prompt = [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 6, 7]  # 12 tokens, bridged to 4 + 2 by window 6
    plain = token_counts(g, prompt, 400, 16, speculation=False)
    windowed = token_counts(g, prompt, 400, 16, draft_tokens=2, draft_window=6)
    assert_same_distribution(plain, windowed)


@pytest.mark.parametrize("window", [0, 4, -1, 2.5, True])
def test_invalid_window_is_refused(gen, window):
    with pytest.raises(InvalidParameterError, match=r"draft_window must be an integer in \(4, \d+\] or None"):
        GenerationConfig(draft_window=window)
    with pytest.raises(InvalidParameterError, match=r"draft_window must be an integer in \(4, \d+\] or None"):
        ModelDrafter(gen.draft, SamplingConfig(), window=window)


def test_a_catchup_that_cannot_pay_off_never_runs_the_draft(gen, baseline):
    """Adaptive speculation on a short expected reply: the controller weighs the draft's
    catch-up against the rest of the reply and stays plain, so the draft never runs."""
    saved_memory = gen.memory
    try:
        gen.memory = SpeculationMemory()  # the optimistic prior: only the catch-up's cost can keep it plain
        # A nearly flat verify and a free draft step (speculation pays from the first step at the
        # prior acceptance), but a catch-up token costs 1 s.
        flat = {n: 0.001 * (1 + 0.05 * (n - 1)) for n in range(1, 10)}
        # (keyed by drafter and mode: the calls below run in exact mode)
        gen.memory.costs[("model", True)] = CostModel(flat, draft_token_s=1e-5, draft_catchup_token_s=1.0)
        out = gen.generate(input_ids=LONG_PROMPT, max_new_tokens=40, drafter="model", draft_tokens=None,
                           adaptive=True, reuse_prefix=False, exact=True)  # the draft starts empty: its catch-up is the window
        assert out.token_ids == baseline
        assert out.stats.drafted == 0 and out.stats.catchup_tokens == 0
        assert out.stats.catchup_deferred > 0
        assert len(gen.memory.reply_lengths) == 1  # this reply is on record for the next one
    finally:
        gen.memory = saved_memory


def test_the_composite_charges_no_catchup_to_a_step_its_ngram_side_serves(gen):
    """``pending_tokens`` is what a model proposal would read (the controller weighs it for the model
    source only); a step the n-gram side serves reads nothing and reports no catch-up."""
    composite = CompositeDrafter(NGramDrafter(3, 2), drafter(gen, window=8))
    repeating = LONG_PROMPT + LONG_PROMPT[:3]  # ends with a 3-gram seen at the start
    composite.begin(np.asarray(repeating))
    assert composite.pending_tokens(repeating) == 8  # the model's window, though the n-gram side has a match
    assert len(composite.propose(np.asarray(repeating, np.int64), 4).tokens) == 4  # served by the n-gram side
    assert composite.catchup_tokens == 0 and composite.model.cache.length == 0
    fresh = LONG_PROMPT  # its last 2 tokens occur nowhere earlier
    composite.begin(np.asarray(fresh))
    assert composite.pending_tokens(fresh) == 8  # the model would read its window
