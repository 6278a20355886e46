"""``export --tune`` stopped with Ctrl-C and run again (issue #38), through the real exporter on a tiny
random-weight llama:

- a Ctrl-C after the first block was measured still writes a bundle, quantized at a measured block,
  whose record says the tuning stopped and lists only the measured blocks;
- the same export run again measures only the blocks still missing (the saved ones, and the fp32
  reference, are not measured again), and once everything is saved it measures nothing and quantizes
  only the chosen block;
- a corrupt saved file is ignored with a note and everything is measured again;
- a Ctrl-C before block 32 was measured keeps block 32, untuned;
- a second Ctrl-C aborts the export as before (no bundle, no leftovers), and what was measured stays saved.

Every test has its own cache folder ($SPECEDGE_CACHE), so none touches the user's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.bundle.manifest import load_manifest
from specedge.cli.main import main
from specedge.export import tune
from specedge.export.bundle import ExportConfig, export_bundle


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


MEASURE = tune.measure_candidate


class Measure:
    """export/tune.py ``measure_candidate``, counted; a Ctrl-C (KeyboardInterrupt) at ``interrupt_at``."""

    def __init__(self, monkeypatch, interrupt_at: int | None = None):
        self.blocks: list[int] = []
        self.interrupt_at = interrupt_at
        monkeypatch.setattr(tune, "measure_candidate", self)

    def __call__(self, candidate, *args, **kwargs):
        if candidate.block_size == self.interrupt_at:
            raise KeyboardInterrupt
        self.blocks.append(candidate.block_size)
        return MEASURE(candidate, *args, **kwargs)


def _export(model: Path, out: Path) -> Path:
    export_bundle(ExportConfig(target=str(model), out=out, precision="int4", tune_block_size=True, max_context=64))
    return out


def _tuning(bundle: Path):
    return load_manifest(bundle).extra.quant_tuning.get("target")


def _block_sizes(bundle: Path) -> set[int]:
    """The target's int4 blocks (a fast-mode export's 8-bit layers take export/mixquant.py WIDE_INT8_BLOCK)."""
    import onnx

    model = onnx.load(str(bundle / load_manifest(bundle).target.graph), load_external_data=False)
    attrs = [{a.name: a.i for a in n.attribute} for n in model.graph.node if n.op_type == "MatMulNBits"]
    return {a["block_size"] for a in attrs if a["bits"] == 4}


def test_a_stopped_tuning_ships_what_was_measured_and_the_same_export_resumes(tiny_model, tmp_path, cache,
                                                                              monkeypatch, capsys):
    model = tiny_model("llama")
    measure = Measure(monkeypatch, interrupt_at=64)  # Ctrl-C while block 64 is measured
    stopped = _tuning(_export(model, tmp_path / "stopped"))
    assert measure.blocks == [32]
    assert stopped.stopped and [c.block_size for c in stopped.candidates] == [32] and stopped.chosen == 32
    assert _block_sizes(tmp_path / "stopped") == {32}
    err = capsys.readouterr().err
    assert "tune: stopped by Ctrl-C; block sizes measured: 32" in err
    assert "the same export run again measures only the block sizes still missing" in err
    assert len(list((cache / "tune").glob("*.json"))) == 1
    info = CliRunner().invoke(main, ["info", str(tmp_path / "stopped")]).output
    line = next(l for l in info.splitlines() if "target block size" in l)
    assert "(the only block measured)" in line and "tuning was stopped (Ctrl-C) after block 32" in line

    measure = Measure(monkeypatch)
    references = []
    real_references = tune.greedy_references
    monkeypatch.setattr(tune, "greedy_references", lambda *a: references.append(1) or real_references(*a))
    resumed = _tuning(_export(model, tmp_path / "resumed"))
    assert measure.blocks == [64, 128] and references == []  # block 32 and the fp32 reference are not taken again
    err = capsys.readouterr().err
    assert "reusing the saved measurements of block 32" in err and "reusing the saved fp32 greedy reference" in err
    assert not resumed.stopped and [c.block_size for c in resumed.candidates] == list(tune.CANDIDATE_BLOCKS)
    assert resumed.candidate(32) == stopped.candidate(32)
    assert all(c.default_step_ms is not None for c in resumed.candidates if c.block_size != 32)
    assert _block_sizes(tmp_path / "resumed") == {resumed.chosen}

    # Everything saved: nothing measured, and only the chosen block quantized.
    import specedge.export.quantize as quantize

    quantized: list[int] = []
    real_quantize = quantize.quantize_graph
    monkeypatch.setattr(quantize, "quantize_graph", lambda src, dst, config, **kw: quantized.append(
        config.block_size) or real_quantize(src, dst, config, **kw))
    measure = Measure(monkeypatch)
    again = _tuning(_export(model, tmp_path / "again"))
    assert measure.blocks == [] and quantized == [again.chosen]
    assert again.candidates == resumed.candidates and again.chosen == resumed.chosen


def test_a_corrupt_saved_file_is_ignored_with_a_note(tiny_model, tmp_path, cache, monkeypatch, capsys):
    model = tiny_model("llama")
    Measure(monkeypatch, interrupt_at=64)
    _export(model, tmp_path / "stopped")
    (saved,) = (cache / "tune").glob("*.json")
    saved.write_text('{"format": 1, "key": {"trunc')
    capsys.readouterr()
    measure = Measure(monkeypatch)
    tuning = _tuning(_export(model, tmp_path / "after"))
    assert measure.blocks == list(tune.CANDIDATE_BLOCKS) and not tuning.stopped
    assert f"tune: ignoring the saved measurements in {saved}: unreadable" in capsys.readouterr().err


def test_a_ctrl_c_before_block_32_was_measured_keeps_it_untuned(tiny_model, tmp_path, cache, monkeypatch, capsys):
    Measure(monkeypatch, interrupt_at=32)
    bundle = _export(tiny_model("llama"), tmp_path / "untuned")
    assert _tuning(bundle) is None and _block_sizes(bundle) == {32}
    assert "stopped before block 32 was measured: target keeps block 32, untuned" in capsys.readouterr().err


def test_a_second_ctrl_c_aborts_the_export_and_keeps_the_saved_measurements(tiny_model, tmp_path, cache,
                                                                             monkeypatch):
    import specedge.export.validate as validate

    Measure(monkeypatch, interrupt_at=64)  # the first Ctrl-C stops the tuning...

    def second_ctrl_c(*args, **kwargs):  # ...the second comes later in the export
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "batch_variance", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        _export(tiny_model("llama"), tmp_path / "aborted")
    assert not (tmp_path / "aborted").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(list((cache / "tune").glob("*.json"))) == 1  # block 32's measurement, for the next run
