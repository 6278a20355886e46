"""Invariants of a stoppable, resumable ``export --tune`` (export/tune.py ``tune_block_size``,
export/tune_saved.py), on fake measurements (no ONNX Runtime, no model):

- a Ctrl-C while measuring keeps what was measured: the choice is made among the candidates measured
  in full, and the record says the tuning was stopped and lists only them;
- a Ctrl-C before the finest block was measured leaves nothing to choose from (None: the caller keeps
  the untuned default);
- a saved measurement is reused, never measured again, and its block is never quantized for it; the
  saved fp32 reference is reused when it fits the prompts, and taken again when it does not;
- a saved file is trusted only under the key it was taken with, and a corrupt, foreign or oversized one
  is ignored with a note, never an error.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specedge.bundle.extra import BlockCandidate, MachineFingerprint
from specedge.export import tune
from specedge.export.tune import Candidate, Measurements, continuation_tokens, tune_block_size
from specedge.export.tune_saved import FORMAT, MAX_BYTES, SavedTuning, TuneKey

BLOCKS = (32, 64, 128)
PROMPTS = [np.arange(5, dtype=np.int64), np.arange(7, dtype=np.int64)]
REFERENCE = SimpleNamespace(max_context=256, vocab_size=100)  # all tune_block_size reads of the fp32 entry
# The fp32 greedy continuations the fake reference takes: one per prompt, continuation_tokens(256) long.
REFERENCES = tuple(tuple([7] * continuation_tokens(256)) for _ in PROMPTS)


def record(block: int, step_ms: float, default_ms: float | None = None) -> BlockCandidate:
    return BlockCandidate(block, step_ms, 2 * step_ms, 0.9, True, default_step_ms=default_ms)


class Fakes:
    """Fake quantization and measurement; ``interrupt_at``: the block whose measurement a Ctrl-C stops."""

    def __init__(self, monkeypatch, interrupt_at: int | None = None, steps=None):
        self.quantized: list[int] = []
        self.measured: list[int] = []
        self.references = 0  # fp32 references taken
        self.steps = steps or {32: 10.0, 64: 8.0, 128: 9.5}
        self.interrupt_at = interrupt_at
        monkeypatch.setattr(tune, "greedy_references", self.greedy_references)
        monkeypatch.setattr(tune, "measure_candidate", self.measure)

    def greedy_references(self, entry, graph, prompts):
        self.references += 1
        return [np.asarray(r, np.int64) for r in REFERENCES]

    def quantize(self, block: int) -> Candidate:
        self.quantized.append(block)
        return Candidate(block, None, Path(f"block{block}.onnx"))

    def measure(self, candidate, prompts, references, *, default, max_verify, threads, exact_role):
        if candidate.block_size == self.interrupt_at:
            raise KeyboardInterrupt
        self.measured.append(candidate.block_size)
        assert (default is None) == (candidate.block_size == 32)  # coarser blocks are timed beside block 32
        return record(candidate.block_size, self.steps[candidate.block_size],
                      None if default is None else self.steps[32])

    def run(self, **kw):
        lines: list[str] = []
        tuning = tune_block_size(BLOCKS, self.quantize, REFERENCE, Path("fp32.onnx"), PROMPTS, max_verify=9,
                                 progress=lines.append, **kw)
        return tuning, lines


def test_a_ctrl_c_after_the_first_block_keeps_it_and_says_the_tuning_stopped(monkeypatch):
    fakes = Fakes(monkeypatch, interrupt_at=64)
    saves: list[Measurements] = []
    tuning, lines = fakes.run(on_measured=saves.append)
    assert tuning.stopped and [c.block_size for c in tuning.candidates] == [32] and tuning.chosen == 32
    # Saved as soon as each part was measured: the fp32 reference, then block 32.
    assert saves == [Measurements(REFERENCES, {}), Measurements(REFERENCES, {32: record(32, 10.0)})]
    assert tuning.positions == len(PROMPTS) * continuation_tokens(256)
    assert any("stopped by Ctrl-C; block sizes measured: 32" in line and "Ctrl-C again aborts" in line
               for line in lines)


def test_the_choice_after_a_stop_is_among_the_blocks_measured(monkeypatch):
    fakes = Fakes(monkeypatch, interrupt_at=128)
    tuning, _ = fakes.run()
    assert tuning.stopped and [c.block_size for c in tuning.candidates] == [32, 64] and tuning.chosen == 64


def test_a_ctrl_c_before_the_first_block_leaves_nothing_to_choose(monkeypatch):
    fakes = Fakes(monkeypatch, interrupt_at=32)
    tuning, lines = fakes.run()
    assert tuning is None and fakes.measured == []
    assert any("block sizes measured: none" in line for line in lines)


def test_saved_measurements_are_reused_and_only_the_rest_is_measured(monkeypatch):
    fakes = Fakes(monkeypatch)
    tuning, lines = fakes.run(saved=Measurements(REFERENCES, {32: record(32, 10.0)}))
    assert fakes.measured == [64, 128] and fakes.references == 0  # block 32 and the reference are not taken again...
    assert fakes.quantized.count(32) >= 1  # ...but block 32 is quantized: the others are timed beside it
    assert not tuning.stopped and [c.block_size for c in tuning.candidates] == [32, 64, 128] and tuning.chosen == 64
    assert any("reusing the saved measurements of block 32" in line for line in lines)
    assert any("reusing the saved fp32 greedy reference" in line for line in lines)

    fakes = Fakes(monkeypatch)
    everything = {32: record(32, 10.0), 64: record(64, 8.0, 10.0), 128: record(128, 9.5, 10.0)}
    tuning, _ = fakes.run(saved=Measurements((), everything))
    assert fakes.measured == [] and fakes.quantized == [] and fakes.references == 0 and tuning.chosen == 64


@pytest.mark.parametrize("references", [
    REFERENCES[:1],  # one per prompt
    tuple(r[:-1] for r in REFERENCES),  # as long as this context's continuations
    tuple((100,) + r[1:] for r in REFERENCES),  # within the vocabulary: they are fed back as input ids
])
def test_a_saved_reference_that_does_not_fit_is_taken_again(monkeypatch, references):
    fakes = Fakes(monkeypatch)
    fakes.run(saved=Measurements(references, {32: record(32, 10.0)}))
    assert fakes.references == 1 and fakes.measured == [64, 128]


# --------------------------------------------------------------------------- the saved file


def key(**changes) -> TuneKey:
    fields = dict(source=(("model.safetensors", "100", "1", "2", "3"),), role="target", bits=4, mix="rtn-sym4",
                  accuracy_level=4, max_context=256, attention="gqa", layers=2, head="", prompts="ab" * 32,
                  max_verify=9, step_rows=1, machine=MachineFingerprint("Some CPU", 2, 0, "avx2"),
                  method=tune.METHOD, versions="specedge 0")
    return TuneKey(**(fields | changes))


MEASURED = Measurements(REFERENCES, {32: record(32, 10.0), 64: record(64, 8.0, 10.5)})


def test_measurements_round_trip_through_the_file_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    saved = SavedTuning.in_cache(key(), "my model/v2")
    assert saved.path.parent == tmp_path / "tune" and saved.path.name.startswith("my_model_v2-target-")
    notes: list[str] = []
    assert saved.load(notes.append) == Measurements() and notes == []  # nothing saved yet: not worth a note
    saved.save(MEASURED, notes.append)
    assert saved.load(notes.append) == MEASURED and notes == []
    assert [p.name for p in saved.path.parent.iterdir()] == [saved.path.name]  # no temporary file left
    # Any part of the key changed: another file, and this one is not read for it.
    assert SavedTuning.in_cache(key(step_rows=2), "my model/v2").path != saved.path
    # A file without references (none taken yet) still gives its blocks; the reference is then taken again.
    data = json.loads(saved.path.read_text())
    del data["references"]
    saved.path.write_text(json.dumps(data))
    assert saved.load(notes.append) == Measurements((), MEASURED.candidates) and notes == []


@pytest.mark.parametrize("content, why", [
    (b"{not json", "unreadable"),
    (b"\xff\xfe garbage", "unreadable"),
    (b"[]", "not a format-1 tuning file"),
    (json.dumps({"format": 99}).encode(), "not a format-1 tuning file"),
    (None, "measured for another source"),  # a valid file whose stored key differs (edited, or a collision)
    (b"candidates-bad", "field 'candidates[0].greedy_agreement' must be a fraction"),
    (b"duplicate", "block 32 listed twice"),
    (b" " * (MAX_BYTES + 1), f"larger than {MAX_BYTES} bytes"),
    (b"references-bad", "the fp32 references are not lists of token ids"),
])
def test_a_corrupt_or_foreign_file_is_ignored_with_a_note(tmp_path, content, why):
    saved = SavedTuning.in_cache(key(), "m", cache=tmp_path)
    saved.save(MEASURED, lambda note: None)
    good = json.loads(saved.path.read_text())
    if content is None:
        good["key"]["layers"] = 3
        content = json.dumps(good).encode()
    elif content == b"candidates-bad":
        good["candidates"][0]["greedy_agreement"] = 7
        content = json.dumps(good).encode()
    elif content == b"references-bad":
        good["references"][0][3] = -1
        content = json.dumps(good).encode()
    elif content == b"duplicate":
        good["candidates"].append(good["candidates"][0])
        content = json.dumps(good).encode()
    assert good["format"] == FORMAT
    saved.path.write_bytes(content)
    notes: list[str] = []
    assert saved.load(notes.append) == Measurements()
    assert len(notes) == 1 and f"ignoring the saved measurements in {saved.path}: {why}" in notes[0]
    saved.save(MEASURED, notes.append)  # and the next save replaces it
    assert saved.load(notes.append) == MEASURED


def test_a_cache_that_cannot_be_written_is_a_note_not_an_error(tmp_path):
    blocker = tmp_path / "tune"
    blocker.write_text("a file where the folder should be")
    notes: list[str] = []
    SavedTuning.in_cache(key(), "m", cache=tmp_path).save(MEASURED, notes.append)
    assert len(notes) == 1 and "could not save the measurements" in notes[0]
