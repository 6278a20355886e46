"""Invariant: ``specedge eval``'s numbers are the textbook ones, on exactly the same tokens.

- perplexity = exp(mean negative log-likelihood) over predicted positions, from a float64
  log-softmax of the logits (checked against hand computations, and stable for large logits);
- every chunk's first token is context, never predicted; with a BOS rule every chunk starts
  with BOS; chunks never overlap; the bundle and the source are given the very same chunks;
- overall = every predicted position of every kind together (not a mean of per-kind scores);
- top-1 agreement = share of positions whose argmaxes are equal;
- bad input (empty text, a missing file, a chunk out of range) is an InvalidParameterError.

numpy only: fake scorers and a fake codec stand in for the engines and the tokenizer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from specedge.quality.evaluate import (BUILTIN_KINDS, EvalText, builtin_texts, chunk_ids, plan_eval, read_texts,
                                       run_eval)
from specedge.quality.metrics import Tally, kl_divergence, token_scores


def test_token_scores_equal_a_hand_computation():
    logits = np.array([[0.0, 0.0, 0.0, 0.0],  # uniform over 4: -log(1/4)
                       [math.log(3.0), 0.0, 0.0, -np.inf]], np.float32)  # softmax [3/5, 1/5, 1/5, 0]
    nll, top1 = token_scores(logits, np.array([2, 1]))
    assert nll.dtype == np.float64
    assert nll == pytest.approx([math.log(4.0), math.log(5.0)], rel=1e-6)
    assert top1.tolist() == [0, 0]  # a tie resolves to the lowest id


def test_token_scores_stay_finite_for_large_logits():
    nll, _ = token_scores(np.array([[1000.0, 0.0], [-1000.0, 1000.0]], np.float32), np.array([0, 0]))
    assert nll[0] == pytest.approx(0.0, abs=1e-12) and nll[1] == pytest.approx(2000.0)


def test_token_scores_refuse_shapes_that_do_not_match():
    with pytest.raises(InvalidParameterError, match=r"logits \[n, vocab\] and targets \[n\]"):
        token_scores(np.zeros((3, 4)), np.zeros(2, np.int64))
    with pytest.raises(InvalidParameterError, match="outside the vocabulary of 4"):
        token_scores(np.zeros((1, 4)), np.array([4]))


def test_kl_divergence_equals_a_hand_computation():
    source = np.array([[math.log(3.0), 0.0, 0.0, -np.inf],  # p = [3/5, 1/5, 1/5, 0]
                       [1.0, 2.0, 3.0, 4.0]], np.float32)
    bundle = np.array([[0.0, 0.0, 0.0, 0.0],  # q uniform
                       [1.0, 2.0, 3.0, 4.0]], np.float32)
    kl = kl_divergence(source, bundle)
    p = np.array([0.6, 0.2, 0.2])
    assert kl.dtype == np.float64
    assert kl[0] == pytest.approx(float((p * np.log(p / 0.25)).sum()), rel=1e-6)  # the -inf token adds nothing
    assert kl[1] == 0.0  # one distribution: nothing diverges (never a rounding -0)
    assert (kl_divergence(bundle, source)[:1] == np.inf).all()  # the bundle gives 0 where the source does not
    big = np.random.default_rng(0).normal(size=(130, 50)) * 30  # more rows than one block, large logits
    other = big + np.random.default_rng(1).normal(size=big.shape)
    by_hand = [float((np.exp(a - np.logaddexp.reduce(a)) * ((a - np.logaddexp.reduce(a))
                                                              - (b - np.logaddexp.reduce(b)))).sum())
               for a, b in zip(big, other)]
    assert kl_divergence(big, other) == pytest.approx(by_hand, rel=1e-9, abs=1e-12)
    with pytest.raises(InvalidParameterError, match="two logits arrays"):
        kl_divergence(np.zeros((2, 4)), np.zeros((2, 5)))


def test_tally_perplexity_ratio_and_agreement():
    tally = Tally()
    tally.add(np.array([math.log(4.0), math.log(4 / 3)]), np.array([1, 2]),
              np.array([math.log(2.0), math.log(2.0)]), np.array([1, 5]), kl=np.array([0.25, 0.75]))
    score = tally.score()
    assert score.positions == 2
    assert score.perplexity == pytest.approx(4 / math.sqrt(3))  # exp((ln 4 + ln 4/3) / 2)
    assert score.source_perplexity == pytest.approx(2.0)
    assert score.perplexity_ratio == pytest.approx(2 / math.sqrt(3))
    assert score.top1_agreement == 0.5
    assert score.kl_divergence == pytest.approx(0.5)
    alone = Tally()
    alone.add(np.array([0.5]), np.array([0]))
    assert alone.score().source_perplexity is None and alone.score().perplexity_ratio is None
    assert alone.score().kl_divergence is None
    with pytest.raises(InvalidParameterError, match="with the source, or none is"):
        alone.add(np.array([0.5]), np.array([0]), np.array([0.5]), np.array([0]), kl=np.array([0.0]))
    with pytest.raises(InvalidParameterError, match="needs its KL divergence per position"):
        Tally().add(np.array([0.5]), np.array([0]), np.array([0.5]), np.array([0]))


@pytest.mark.parametrize("bos, want", [
    (None, [[1, 2, 3], [4, 5, 6], [7, 8, 9]]),  # 10 is alone in its chunk: nothing to predict, dropped
    (0, [[0, 1, 2], [0, 3, 4], [0, 5, 6], [0, 7, 8], [0, 9, 10]]),
])
def test_chunks_do_not_overlap_and_bos_opens_each_one(bos, want):
    assert [c.tolist() for c in chunk_ids(list(range(1, 11)), 3, bos)] == want


class FakeCodec:
    """Whitespace-separated integers are token ids; BOS id 0 under a BOS rule."""

    def __init__(self, add_bos: bool) -> None:
        self.add_bos_token = add_bos
        self.bos_token = "<s>"
        self.tokenizer = self

    def token_to_id(self, token: str) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        return ([0] if self.add_bos_token else []) + [int(w) for w in text.split()]


VOCAB = 12


def _scorer(seed: int, calls: list):
    """A deterministic fake model: logits depend on the chunk's tokens so far; records its chunks."""
    table = np.random.default_rng(seed).normal(size=(VOCAB, VOCAB)).astype(np.float32)

    def score(ids: np.ndarray) -> np.ndarray:
        calls.append(ids.tolist())
        return table[ids]

    return score


@pytest.mark.parametrize("add_bos", [False, True])
def test_run_eval_scores_both_models_on_the_same_chunks_against_a_hand_sum(add_bos):
    texts = [EvalText("a", " ".join(str(i % 11 + 1) for i in range(23))), EvalText("b", "3 4 5 6 7"),
             EvalText("a", "9 8 7 6")]
    plan = plan_eval(texts, FakeCodec(add_bos), max_context=64, chunk=8)
    bundle_calls, source_calls = [], []
    record = run_eval(plan, _scorer(1, bundle_calls), _scorer(2, source_calls), source_name="src")
    assert bundle_calls == source_calls
    assert record.source == "src" and record.chunk == 8 and set(record.kinds) == {"a", "b"}
    # By hand: every chunk's rows 0..n-2 against tokens 1..n-1.
    sums = {}
    for seed, calls in ((1, bundle_calls), (2, source_calls)):
        table = np.random.default_rng(seed).normal(size=(VOCAB, VOCAB))
        total, count, argmax = 0.0, 0, []
        for ids in calls:
            for i in range(len(ids) - 1):
                row = table[ids[i]].astype(np.float32).astype(np.float64)
                total += math.log(np.exp(row).sum()) - row[ids[i + 1]]
                argmax.append(int(np.argmax(row)))
                count += 1
        sums[seed] = (total, count, argmax)
    total, count, argmax = sums[1]
    bundle_table, source_table = (np.random.default_rng(seed).normal(size=(VOCAB, VOCAB)).astype(np.float32)
                                  .astype(np.float64) for seed in (1, 2))
    kls = []
    for ids in bundle_calls:
        for i in range(len(ids) - 1):
            p_log = source_table[ids[i]] - np.logaddexp.reduce(source_table[ids[i]])
            q_log = bundle_table[ids[i]] - np.logaddexp.reduce(bundle_table[ids[i]])
            kls.append(float((np.exp(p_log) * (p_log - q_log)).sum()))
    assert record.overall.positions == count
    assert record.overall.perplexity == pytest.approx(math.exp(total / count), rel=1e-9)
    assert record.overall.source_perplexity == pytest.approx(math.exp(sums[2][0] / count), rel=1e-9)
    assert record.overall.top1_agreement == pytest.approx(np.mean(np.array(argmax) == np.array(sums[2][2])))
    assert record.overall.kl_divergence == pytest.approx(np.mean(kls), rel=1e-9)
    expected_positions = 22 + 3 + 3 + 4 if add_bos else 20 + 4 + 3
    # with BOS: chunks of BOS + 7 text tokens predict every text token; without: chunk 8 -> 7 predicted each
    assert count == expected_positions
    assert sum(s.positions for s in record.kinds.values()) == count
    if add_bos:
        assert all(c[0] == 0 for c in bundle_calls)


def test_overall_weights_every_position_not_every_kind():
    plan = plan_eval([EvalText("long", " ".join(["1"] * 40)), EvalText("short", "2 3")], FakeCodec(False),
                     max_context=64, chunk=64)
    record = run_eval(plan, _scorer(3, []))
    kinds = record.kinds
    log_mean = (sum(math.log(s.perplexity) * s.positions for s in kinds.values())
                / sum(s.positions for s in kinds.values()))
    assert record.overall.perplexity == pytest.approx(math.exp(log_mean))
    assert record.overall.source_perplexity is None and record.source == ""


def test_max_tokens_bounds_each_text():
    plan = plan_eval([EvalText("a", " ".join(["1"] * 50)), EvalText("b", " ".join(["2"] * 50))], FakeCodec(True),
                     max_context=64, chunk=16, max_tokens=20)
    assert plan.positions == 2 * 20  # BOS + 15, BOS + 5 per text: every taken token predicted


@pytest.mark.parametrize("kwargs, match", [
    ({"chunk": 1}, r"--chunk must be in \[2, 32\]"),
    ({"chunk": 33}, r"--chunk must be in \[2, 32\]"),
    ({"max_tokens": 1}, "--max-tokens must be >= 2"),
])
def test_out_of_range_settings_are_refused(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        plan_eval([EvalText("a", "1 2 3")], FakeCodec(False), max_context=32, **kwargs)


def test_the_default_chunk_is_capped_by_max_context():
    assert plan_eval([EvalText("a", "1 2 3")], FakeCodec(False), max_context=32).chunk == 32


def test_empty_and_one_token_texts_are_refused():
    with pytest.raises(InvalidParameterError, match="text 'a' is empty"):
        plan_eval([EvalText("a", "  \n")], FakeCodec(False), max_context=32)
    with pytest.raises(InvalidParameterError, match="encodes to 1 token"):
        plan_eval([EvalText("a", "5")], FakeCodec(False), max_context=32)
    with pytest.raises(InvalidParameterError, match="no texts"):
        plan_eval([], FakeCodec(False), max_context=32)


def test_text_files_are_read_and_bad_ones_named(tmp_path):
    good = tmp_path / "notes.txt"
    good.write_text("some words\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    twin = tmp_path / "sub" / "notes.txt"
    twin.write_text("more words", encoding="utf-8")
    assert [t.kind for t in read_texts([good])] == ["notes.txt"]
    assert [t.kind for t in read_texts([good, twin])] == [str(good), str(twin)]  # same name: told apart
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    for name, match in (("missing.txt", "does not exist"), ("empty.txt", "is empty"), ("latin1.txt", "not UTF-8"),
                        ("sub", "does not exist or is not a file")):
        with pytest.raises(InvalidParameterError, match=match):
            read_texts([tmp_path / name])


def test_the_built_in_texts_ship_every_kind_with_a_few_hundred_words():
    texts = builtin_texts()
    assert [t.kind for t in texts] == list(BUILTIN_KINDS)
    for t in texts:
        assert 300 <= len(t.text.split()) <= 1500, (t.kind, len(t.text.split()))
    with pytest.raises(InvalidParameterError, match="unknown text kind 'poetry'"):
        builtin_texts(["poetry"])


def test_the_recorded_source_is_found_here_or_named_with_the_fix(tmp_path, monkeypatch):
    from specedge.export.quality import locate_source

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "empty-cache"))  # nothing cached, nothing downloaded
    source, reason = locate_source("gguf:SmolLM2-135M-Instruct.Q4_1.gguf")
    assert source is None and "catalog model 'smollm2-135m-instruct', which is not in the cache" in reason
    assert "`specedge fetch smollm2-135m-instruct`" in reason and "--source" in reason
    assert "not in the cache" in locate_source("smollm2-135m-instruct")[1]
    assert "recorded by name only; pass --source" in locate_source("gguf:someone-elses.gguf")[1]
    assert "not found on this machine" in locate_source(str(tmp_path / "gone"))[1]
    folder = tmp_path / "hf-folder"
    folder.mkdir()
    assert locate_source(str(folder)) == (str(folder), "")


def test_a_source_with_another_vocabulary_is_refused():
    plan = plan_eval([EvalText("a", "1 2 3 4")], FakeCodec(False), max_context=32)
    wider = np.zeros((VOCAB, VOCAB + 1), np.float32)
    with pytest.raises(InvalidParameterError, match=r"the source scores 13 tokens, the bundle 12"):
        run_eval(plan, _scorer(1, []), lambda ids: wider[ids])
