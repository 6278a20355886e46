"""Export progress lines with an estimate of the time left (export/progress.py, issue #38 item 4).

- Durations read as a person plans: seconds, then minutes and seconds, then hours and minutes.
- The estimate is the rate so far times the units left; none before the first unit, "done" at the end.
- ``Eta`` prints at most one line per ``every_s`` (a fake clock here), always the last one, and its
  lines carry no ``(t=..s)`` stamp, so export-measure does not count them as phases.
"""

from __future__ import annotations

from specedge.export.measure import _NOTE, _STAGE
from specedge.export.progress import Eta, eta_text, format_duration


def test_durations_round_to_the_unit_a_person_plans_with():
    assert format_duration(0.4) == "0 s"
    assert format_duration(59.4) == "59 s"
    assert format_duration(185) == "3 min 05 s"
    assert format_duration(3725) == "1 h 02 min"
    assert format_duration(-3) == "0 s"


def test_the_estimate_is_the_rate_so_far_times_what_is_left():
    assert eta_text("writing", 0, 16, "layers", 2.0) == "writing: 0/16 layers, 2 s"
    assert eta_text("writing", 4, 16, "layers", 10.0) == "writing: 4/16 layers, 10 s, about 30 s left"
    assert eta_text("writing", 16, 16, "layers", 40.0) == "writing: 16/16 layers, 40 s, done"


def test_eta_prints_at_most_every_so_often_and_always_the_end():
    now = [100.0]
    lines: list[str] = []
    eta = Eta("target: writing the fp32 graph", 8, "layers", lines.append, every_s=10.0, clock=lambda: now[0])
    for done, t in ((1, 103.0), (2, 111.0), (3, 112.0), (4, 121.5), (8, 125.0)):
        now[0] = t
        eta(done)
    assert lines == ["      target: writing the fp32 graph: 2/8 layers, 11 s, about 33 s left",
                     "      target: writing the fp32 graph: 4/8 layers, 22 s, about 22 s left",
                     "      target: writing the fp32 graph: 8/8 layers, 25 s, done"]
    assert not any(_NOTE.match(line) or _STAGE.match(line) for line in lines)


def test_a_phase_that_learns_its_total_as_it_runs_reports_against_it():
    """The quantizer counts its weights once it has read the graph: ``update(done, total)``."""
    now = [0.0]
    lines: list[str] = []
    eta = Eta("target: quantizing", 1, "weights", lines.append, every_s=10.0, clock=lambda: now[0])
    for done, t in ((1, 4.0), (5, 12.0), (10, 20.0)):
        now[0] = t
        eta.update(done, 10)
    assert lines == ["      target: quantizing: 5/10 weights, 12 s, about 12 s left",
                     "      target: quantizing: 10/10 weights, 20 s, done"]
