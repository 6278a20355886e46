"""Progress with an estimate of the time left, for the export's long phases (issue #38 item 4).

``Eta(what, total, unit, emit)`` is told how many of ``total`` units are done (layers of a graph
written, weights quantized) and emits ``"      writing the fp32 graph: 8/16 layers, 21 s, about 21 s
left"`` at most every ``every_s`` seconds and once at the end. The estimate is the rate so far: the
layers of one model cost alike, so the rest takes about (total - done) x (elapsed / done). Its lines carry no
``(t=..s)`` stamp, so ``specedge export-measure`` (export/measure.py) does not take them for phases.
Standard library only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min 05 s"``, ``"1 h 02 min"``: rounded to the unit a person plans with."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def eta_text(what: str, done: int, total: int, unit: str, elapsed: float) -> str:
    """``"<what>: done/total unit, elapsed, about T left"`` (no estimate before the first unit is done)."""
    head = f"{what}: {done}/{total} {unit}, {format_duration(elapsed)}"
    if done <= 0:
        return head
    if done >= total:
        return head + ", done"
    return head + f", about {format_duration(elapsed / done * (total - done))} left"


@dataclass
class Eta:
    """Counts the units of one phase; emits :func:`eta_text` lines through ``emit``."""

    what: str
    total: int
    unit: str
    emit: Callable[[str], None]
    every_s: float = 10.0  # at most one line this often: a 32-layer model would otherwise print 32
    clock: Callable[[], float] = time.perf_counter
    start: float = field(default=-1.0)
    _last: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.clock()
        self._last = self.start

    def update(self, done: int, total: int) -> None:
        """:meth:`__call__` for a phase that learns its total as it starts (``progress(done, total)``)."""
        self.total = total
        self(done)

    def __call__(self, done: int) -> None:
        now = self.clock()
        if done >= self.total or now - self._last >= self.every_s:
            self._last = now
            self.emit("      " + eta_text(self.what, done, self.total, self.unit, now - self.start))
