"""The policy version the servers hold, and a readers-writer gate between generation and weight sync.

`generate` holds the gate shared for a whole batch and tags every completion with `version`; a sync
holds it exclusively (waiting for in-flight batches, so no completion mixes two versions) and sets the
new version when the engine has it. After a failed sync the servers hold a mix of old and new
weights: the gate is `broken` and generation refuses to run until a full push succeeds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class PolicyGate:
    """Shared (generation) / exclusive (weight sync) lock plus the served policy version."""

    def __init__(self, version: int = 0):
        self.version = version
        self.broken: str | None = None
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[int]:
        """Held by one generate batch; yields the version every completion of the batch gets."""
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._readers += 1
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float | None = None) -> Iterator[None]:
        """Held by one sync; waits (up to `timeout_s`) for in-flight generate batches to finish."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writer and self._readers == 0, timeout_s):
                raise TimeoutError(f"generation still in flight after {timeout_s} s; cannot sync weights")
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
