"""Named, timed phases of a step: `with timer.phase("rollout"): ...` -> `timing/rollout_s`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


class PhaseTimer:
    """Accumulates wall time per phase for one step; `reset()` returns the step's timings as metrics.

    `on_phase(name)` is called when a phase starts (the status file records the current phase).
    """

    def __init__(self, on_phase: Callable[[str], None] | None = None):
        self._times: dict[str, float] = {}
        self._on_phase = on_phase
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._on_phase is not None:
            self._on_phase(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - t0

    def reset(self) -> dict[str, float]:
        """{'timing/<phase>_s': seconds, ..., 'timing/step_s': total} since the last reset."""
        out = {f"timing/{k}_s": v for k, v in self._times.items()}
        now = time.perf_counter()
        out["timing/step_s"] = now - self._start
        self._times = {}
        self._start = now
        return out
