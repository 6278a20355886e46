"""A small progress bar on stderr (tqdm is not a dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``Progress(total)``; ``advance(label)`` after each unit of work; ``close()`` at the end.

    Redraws one line with ``\\r`` when the stream is a terminal, else prints a line every
    ``every`` units (logs and CI stay readable). ``enabled=False`` prints nothing.
    """

    def __init__(self, total: int, *, title: str = "bench", stream: TextIO | None = None, enabled: bool = True,
                 width: int = 28, every: int = 10) -> None:
        self.total = max(total, 1)
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.every = every
        self.done = 0
        self.t0 = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def render(self, label: str = "") -> str:
        frac = min(self.done / self.total, 1.0)
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return (f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{elapsed:4.0f}s eta {eta:4.0f}s {label}")

    def advance(self, label: str = "", n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._tty:
            self.stream.write("\r" + self.render(label)[:160].ljust(100))
            self.stream.flush()
        elif self.done % self.every == 0 or self.done >= self.total:
            self.stream.write(self.render(label) + "\n")
            self.stream.flush()

    def note(self, message: str) -> None:
        """A message on its own line, without breaking the bar."""
        if not self.enabled:
            return
        self.stream.write(("\n" if self._tty and self.done else "") + message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
