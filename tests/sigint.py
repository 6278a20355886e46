"""Start child processes that can be interrupted, however the test suite itself was started.

A background job of a non-interactive shell (``python -m pytest ... &``, ``nohup``, CI runners
that start jobs that way) starts with SIGINT set to SIG_IGN. An ignored signal stays ignored
across fork and exec, and CPython then installs no KeyboardInterrupt handler, so a child
started from such a suite never sees a test's Ctrl-C: it runs to the end and exits 0.
A signal with a handler, on the other hand, is reset to its default action at exec.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_default_in_children() -> Iterator[None]:
    """While inside, children started with subprocess get SIGINT at its default action
    (and so a Python child gets its KeyboardInterrupt handler). Main thread only."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
