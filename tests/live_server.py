"""A live server for the integration tests: a uvicorn-style server on a free loopback port, run on a
background thread (only 127.0.0.1 is ever bound or contacted)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable


class LoopbackServer:
    """Runs ``server`` (anything with uvicorn.Server's ``run(sockets=...)``, ``started`` and
    ``should_exit``) on a socket bound here, so the port cannot be taken before it starts.
    Subclasses add the routes they call; :meth:`wait_for` polls their ``health()`` dict."""

    JOIN_S = 30.0  # a graceful stop waits this long for the thread

    def __init__(self, server) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = server
        self.thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def health(self) -> dict:
        raise NotImplementedError

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float = 10.0) -> dict:
        """The first ``health()`` state that satisfies ``predicate``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.health()
            if predicate(state):
                return state
            assert time.monotonic() < deadline, f"server never reached the expected state: {state}"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.JOIN_S)
        self.sock.close()
