"""Invariant: greedy speculation changes speed, never the tokens.

In exact mode (``exact=True``), for every drafter and every k, speculative greedy output equals
plain greedy output (the baseline loop, itself proven equal to transformers in test_decode_oracle);
fast mode's weaker promise is tests/integration/test_fast_mode.py's:

- self-speculation (draft == target, fp32) accepts every drafted token;
- a different draft gets corrected (accepted < drafted) and the output is unchanged;
- accepted <= drafted overall and per position, and per-position counts never grow
  with the position (a token is only reached if every earlier one was accepted);
- EOS, max_new_tokens and stop strings landing inside an accepted block cut the
  output exactly where the baseline stops: nothing past the stop is emitted or counted;
- streamed deltas add up to the final text;
- a draft whose vocabulary differs from the target's is refused at export and at load.
"""

from __future__ import annotations

import pytest

from conftest import PROMPT_IDS
from exactness import assert_agrees, exact_holds
from specedge.errors import VocabMismatchError
from specedge.runtime.generator import Generator
from tiny_models import edit_manifest, word

N_TOKENS = 48


@pytest.fixture(scope="module")
def self_spec(self_spec_bundle, load_generator):
    return load_generator(self_spec_bundle)


@pytest.fixture(scope="module")
def baseline(self_spec):
    """Plain greedy tokens of the llama target (self_spec's target) for PROMPT_IDS."""
    result = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=True)
    assert result.finish_reason == "length" and len(result.token_ids) == N_TOKENS
    return result


@pytest.fixture(scope="module", params=["independent", "perturbed"])
def other_draft(request, tiny_model, export, load_generator):
    """llama target with a different draft: an independent seed (almost never agrees), or the
    target's weights plus noise (agrees often, not always)."""
    target = tiny_model("llama")
    if request.param == "independent":
        draft = tiny_model("llama", seed=5)
    else:
        draft = tiny_model("llama", seed=7, perturb=(target, 0.1))
    return request.param, load_generator(export(target, draft=draft))


def _check_stats(stats, new_tokens: int, *, truncated: bool = False) -> None:
    """Counting invariants of one generation's stats."""
    assert 0 <= stats.accepted <= stats.drafted
    assert sum(stats.drafted_per_position) == stats.drafted
    assert sum(stats.accepted_per_position) == stats.accepted
    assert len(stats.drafted_per_position) == len(stats.accepted_per_position)
    for i, (a, d) in enumerate(zip(stats.accepted_per_position, stats.drafted_per_position)):
        assert 0 <= a <= d, f"position {i}: accepted {a} > drafted {d}"
    for counts in (stats.drafted_per_position, stats.accepted_per_position):
        assert all(x >= y for x, y in zip(counts, counts[1:])), f"per-position counts grow: {counts}"
    assert sum(stats.k_chosen.values()) == stats.steps
    assert stats.new_tokens == new_tokens == len(stats.token_times_s)
    # Every step commits its accepted draft tokens plus one target token; the first
    # token comes from the prefill. A stop inside a block drops that step's target token.
    committed = 1 + stats.steps + stats.accepted
    assert new_tokens == committed or (truncated and new_tokens == committed - 1)


# --------------------------------------------------------------------------- (a) self-speculation


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_self_speculation_accepts_everything_and_equals_greedy(k, self_spec, baseline):
    result = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=k, exact=True)
    assert result.token_ids == baseline.token_ids
    assert result.text == baseline.text
    assert result.finish_reason == "length"
    stats = result.stats
    assert stats.drafter == "model"
    assert stats.drafted > 0
    assert stats.acceptance == 1.0
    assert stats.accepted == stats.drafted
    assert set(stats.k_chosen) <= set(range(k + 1)) and max(stats.k_chosen) == k
    # Every full step commits k + 1 tokens: (N - 1) / (k + 1) steps, rounded up.
    assert stats.steps == -(-(N_TOKENS - 1) // (k + 1))
    _check_stats(stats, N_TOKENS)


# --------------------------------------------------------------------------- (b) a different draft


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_different_draft_is_corrected_and_output_equals_greedy(k, other_draft, baseline):
    kind, gen = other_draft
    result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=k, exact=True)
    assert result.token_ids == baseline.token_ids
    stats = result.stats
    assert stats.drafted > 0
    assert stats.accepted < stats.drafted, "a different draft must get corrections"
    if kind == "perturbed":
        assert stats.accepted > 0, "the perturbed draft should agree sometimes (else the test is trivial)"
    _check_stats(stats, N_TOKENS)
    assert len(stats.drafted_per_position) <= k


@pytest.mark.parametrize("mode", ["pipelined", "auto"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_verify_while_draft_modes_equal_greedy(mode, k, self_spec, other_draft, baseline):
    """Pipelined steps draft block n+1 while block n verifies; the committed tokens must not change."""
    for gen in (self_spec, other_draft[1]):
        result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=k, mode=mode, exact=True)
        assert result.token_ids == baseline.token_ids
        _check_stats(result.stats, N_TOKENS)
        if gen is self_spec:
            assert result.stats.acceptance == 1.0


# --------------------------------------------------------------------------- (c) other drafters


@pytest.mark.parametrize("options", [
    {"drafter": "ngram", "draft_tokens": 4},
    {"drafter": "ngram"},  # adaptive k
    {"drafter": "composite", "draft_tokens": 3},
    {"drafter": "composite"},
    {},  # the bundle's defaults: the auto drafter (lookups, the model where it pays), DefaultK
    {"adaptive": True, "draft_tokens": 8},
    {"drafter": "model", "draft_tokens": 6, "p_min": 0.05},  # the draft stops early when unsure
])
def test_every_drafter_equals_greedy(options, self_spec, baseline):
    for _ in range(2):  # the second call runs with the adaptive profile learned by the first
        result = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, exact=True, **options)
        assert result.token_ids == baseline.token_ids
        _check_stats(result.stats, N_TOKENS)
    assert result.stats.drafter == options.get("drafter", "auto")


def test_ngram_drafter_speculates_on_repetitive_output(arch_bundle, load_generator):
    """The tiny gpt2 loops on a few tokens, so prompt lookup finds long matches."""
    gen = load_generator(arch_bundle("gpt2"))
    exact = exact_holds(gen)  # its standard-attention graph is not row-invariant on every CPU
    base = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=exact)
    for k in (2, 5):
        result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="ngram", draft_tokens=k, exact=exact)
        assert_agrees(gen, PROMPT_IDS, base.token_ids, result.token_ids, exact=exact)
        assert result.stats.accepted > 0
        _check_stats(result.stats, N_TOKENS)


def test_drafter_none_and_speculation_false_are_plain_decoding(self_spec, baseline):
    for options in ({"drafter": "none"}, {"speculation": False, "draft_tokens": 4}):
        result = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, exact=True, **options)
        assert result.token_ids == baseline.token_ids
        assert result.stats.drafted == 0 and result.stats.steps == N_TOKENS - 1


# --------------------------------------------------------------------------- (d) stops inside a block


@pytest.mark.parametrize("n", [2, 5, 13, 22, 31])
def test_max_new_tokens_inside_a_block(n, self_spec, baseline):
    """k = 8 commits 9 tokens per step; none of these n is 1 + a multiple of 9."""
    result = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=n, drafter="model", draft_tokens=8, exact=True)
    assert result.token_ids == baseline.token_ids[:n]
    assert result.finish_reason == "length"
    assert result.text == self_spec.codec.decode(baseline.token_ids[:n])
    assert result.stats.drafted <= n - 1  # nothing is drafted for positions past the limit
    _check_stats(result.stats, n)


def _first_new_token_at(tokens: list[int], lo: int, hi: int) -> tuple[int, int]:
    for pos in range(lo, hi):
        if tokens[pos] not in tokens[:pos] and tokens[pos] > 2:
            return tokens[pos], pos
    raise AssertionError(f"no token first seen in positions {lo}..{hi - 1}")


@pytest.fixture
def eos_mid_block(self_spec_bundle, bundle_copy, baseline):
    """A copy of the self-spec bundle whose EOS is a token greedy first emits at position 3..7,
    i.e. inside the first k = 8 block (positions 1..9)."""
    eos, pos = _first_new_token_at(baseline.token_ids, 3, 8)
    bundle = bundle_copy(self_spec_bundle)

    def set_eos(obj):
        for model in obj["models"].values():
            model["eos_token_ids"] = [eos]

    edit_manifest(bundle, set_eos)
    return Generator.from_bundle(bundle, threads=1), eos, pos


@pytest.mark.parametrize("k", [8, 4])
def test_eos_inside_an_accepted_block_ends_generation_there(k, eos_mid_block, baseline):
    gen, eos, pos = eos_mid_block
    expected = baseline.token_ids[:pos + 1]
    plain = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, exact=True)
    assert plain.token_ids == expected and plain.finish_reason == "stop"

    result = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=k, exact=True)
    assert result.token_ids == expected
    assert result.token_ids[-1] == eos
    assert result.finish_reason == "stop"
    assert result.text == plain.text
    stats = result.stats
    # Nothing past EOS is counted: committed draft tokens only, and self-speculation
    # still accepted every token it counts.
    assert stats.accepted == stats.drafted, "tokens drafted past EOS must not be counted"
    _check_stats(stats, pos + 1, truncated=True)
    streamed = gen.stream(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=k, exact=True)
    assert "".join(streamed) == result.text
    assert streamed.result.token_ids == expected


# --------------------------------------------------------------------------- (e) stop strings


@pytest.mark.parametrize("k", [8, 3])
@pytest.mark.parametrize("span", [1, 2])
def test_stop_string_inside_a_block_truncates_text_and_tokens(k, span, self_spec, baseline):
    """A stop string made of ``span`` consecutive tokens first seen at positions 4..7."""
    tokens = baseline.token_ids
    _, pos = _first_new_token_at(tokens, 4, 8)
    stop = " ".join(word(t) for t in tokens[pos:pos + span])
    full_text = baseline.text
    cut = full_text.find(stop)
    assert cut > 0
    expected_text = full_text[:cut]

    plain = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, speculation=False, stop=[stop], exact=True)
    spec = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=k, stop=[stop], exact=True)
    for result in (plain, spec):
        assert result.text == expected_text
        assert stop not in result.text
        assert result.finish_reason == "stop"
        n = len(result.token_ids)
        assert result.token_ids == tokens[:n]
        assert pos < n <= pos + span  # through the stop's first token, never past the one completing it
        assert result.stats.new_tokens == n
    assert spec.token_ids == plain.token_ids

    deltas = list(self_spec.stream(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=k, stop=[stop], exact=True))
    assert "".join(deltas) == expected_text


def test_stop_string_inside_a_block_is_not_counted_in_stats(self_spec, baseline):
    _, pos = _first_new_token_at(baseline.token_ids, 4, 8)
    result = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=8,
                                stop=[word(baseline.token_ids[pos])], exact=True)
    assert len(result.token_ids) == pos + 1
    _check_stats(result.stats, pos + 1, truncated=True)


def test_stop_string_never_seen_changes_nothing(self_spec, baseline):
    result = self_spec.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, drafter="model", draft_tokens=4, stop=["zzz"], exact=True)
    assert result.token_ids == baseline.token_ids and result.finish_reason == "length"


# --------------------------------------------------------------------------- (f) streaming


@pytest.mark.parametrize("options", [{"draft_tokens": 4}, {"draft_tokens": 8}, {"drafter": "composite"}])
def test_speculative_stream_deltas_concatenate_to_generate_text(options, self_spec, other_draft):
    _, other = other_draft
    for gen in (self_spec, other):
        full = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, exact=True, **options)
        stream = gen.stream(input_ids=PROMPT_IDS, max_new_tokens=N_TOKENS, exact=True, **options)
        deltas = list(stream)
        assert "".join(deltas) == full.text
        assert stream.result.token_ids == full.token_ids
        assert stream.result.finish_reason == full.finish_reason
        assert 1 < len(deltas) <= stream.result.stats.steps + 1  # at most one delta per committed block


# --------------------------------------------------------------------------- (g) vocabulary checks


def test_export_refuses_a_draft_with_another_tokenizer(tiny_model, tmp_path):
    from specedge.export.bundle import ExportConfig, export_bundle

    draft = tiny_model("llama", seed=3, vocab_size=280)
    out = tmp_path / "b"
    with pytest.raises(VocabMismatchError, match=r"different vocabulary .*\(280 vs 300 tokens\).* share the "
                                                 r"target's tokenizer"):
        export_bundle(ExportConfig(target=str(tiny_model("llama")), out=out, draft=str(draft), max_context=64,
                                   quiet=True))
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_draft_with_another_vocab_size(tiny_model, tmp_path):
    """Same tokenizer, but the draft's embedding is padded to 320 rows: ids would not line up."""
    from specedge.export.bundle import ExportConfig, export_bundle

    draft = tiny_model("llama", seed=3, vocab_size=320, tokenizer_size=300)
    with pytest.raises(VocabMismatchError, match=r"draft vocab_size 320 != target vocab_size 300"):
        export_bundle(ExportConfig(target=str(tiny_model("llama")), out=tmp_path / "b", draft=str(draft),
                                   max_context=64, quiet=True))
    assert list(tmp_path.iterdir()) == []


def test_load_refuses_a_manifest_whose_draft_vocab_differs(self_spec_bundle, bundle_copy):
    bundle = bundle_copy(self_spec_bundle)
    edit_manifest(bundle, lambda obj: obj["models"]["draft"].update(vocab_size=308))
    with pytest.raises(VocabMismatchError, match=r"draft vocab_size 308 differs from target vocab_size 300"):
        Generator.from_bundle(bundle)


def test_load_refuses_a_manifest_whose_draft_tokenizer_differs(self_spec_bundle, bundle_copy):
    bundle = bundle_copy(self_spec_bundle)
    edit_manifest(bundle, lambda obj: obj["models"]["draft"].update(tokenizer_sha256="ab" * 32))
    with pytest.raises(VocabMismatchError, match=r"draft tokenizer \(sha256 abababababab…\) differs"):
        Generator.from_bundle(bundle)
