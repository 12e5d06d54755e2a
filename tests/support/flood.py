"""Strangers for the listener tests: threads that open connections as fast as they can, each connection
holding a few bytes of a greeting, while the test talks to the server as a legitimate client."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def strangers(host: str, port: int, greeting: bytes, *, threads: int = 3, hold: int = 1000):
    """The burst runs (after half a second to build up) for the body of the `with`; every connection is
    closed afterwards. Each thread keeps at most about `2 * hold` connections open."""
    stop, held = threading.Event(), []

    def flood():
        while not stop.is_set():
            try:
                s = socket.create_connection((host, port), timeout=5)
                s.sendall(greeting)
                held.append(s)
            except OSError:
                time.sleep(0.001)
            if len(held) > 2 * hold:
                for s in held[:hold]:
                    s.close()
                del held[:hold]

    workers = [threading.Thread(target=flood, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        stop.set()
        for t in workers:
            t.join(10)
        for s in held:
            s.close()
