"""Leftovers of interrupted runs: temporary files and folders named after the process that made them.

``export`` builds a bundle in ``.OUT.partial-PID`` and keeps the bundle it replaces in
``.OUT.old-PID`` until the swap is done; ``fetch`` assembles a model in
``NAME.partial-PID-XXXX`` and unpacks wheels in ``specedge-fetch-PID-XXXX``. Each run
removes its own on every exit Python sees, but SIGKILL, an OOM kill or a power cut
leave them (issue 20 found a 1.2 GB ``.partial-PID``). The next run removes what such
runs left: a leftover is stale when the process named in it is gone, or (process ids are
reused) when it has not been touched for ``STALE_AFTER_S``.

Standard library only: ``specedge fetch`` imports this.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

# A live run touches its files continuously (a download writes every second, an export
# writes each graph within minutes); a day without a write means the writer is gone even
# if another process now has its id.
STALE_AFTER_S = 24 * 3600


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 checks without signalling)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except (OverflowError, OSError):
        return False
    return True


def is_stale(path: Path, pid: int | None, *, now: float | None = None) -> bool:
    """Whether a leftover made by process ``pid`` (None: unknown, an older naming) may be removed.

    Never this process's own: its run may still be using it.
    """
    if pid == os.getpid():
        return False
    try:
        age = (time.time() if now is None else now) - path.lstat().st_mtime
    except OSError:
        return False  # gone already
    if age > STALE_AFTER_S:
        return True
    return pid is not None and not pid_alive(pid)


def pid_after(name: str, prefix: str) -> int | None:
    """The process id written right after ``prefix`` in ``name`` ("x.partial-123-abc" -> 123), or None."""
    match = re.match(re.escape(prefix) + r"(\d{1,10})(?:-|$)", name)
    return int(match.group(1)) if match else None
