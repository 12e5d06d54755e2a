"""Console progress: one line per step with a bar, an ETA and the key numbers (no curses).

On a terminal the line is redrawn in place (carriage return + ANSI erase-to-end-of-line); in a log file
(Slurm output, a pipe) each step gets its own line.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

from rljax.metrics.values import Number, StepRecord

# (metric name, short label) shown on the console line when the step has them, in this order.
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval_acc"),
    ("kl/mean", "kl"),
    ("entropy/mean", "entropy"),
    ("response/length_mean", "len"),
    ("staleness/mean", "stale"),
    ("optim/grad_norm", "gnorm"),
    ("timing/step_s", "step_s"),
)


class EtaEstimator:
    """Estimates the time left from the mean step time since the first step seen (compile time excluded).

    Step k means k steps done (the loop numbers steps by policy version, 1..total_steps, after an optional
    step-0 evaluation): the run ends at step `total_steps`. The first update only starts the clock.
    """

    def __init__(self, total_steps: int | None, time_fn: Callable[[], float] = time.monotonic):
        self.total_steps = total_steps
        self._time_fn = time_fn
        self._start: tuple[int, float] | None = None

    def update(self, step: int) -> float | None:
        """Seconds left after `step` finished, or None while unknown (no total, or a single step seen)."""
        now = self._time_fn()
        if self._start is None:
            self._start = (step, now)
            return None
        first_step, t0 = self._start
        if self.total_steps is None or step <= first_step:
            return None
        per_step = (now - t0) / (step - first_step)
        return per_step * max(self.total_steps - step, 0)


def format_duration(seconds: float | None) -> str:
    """`None` -> "?"; else compact: 45s, 3m12s, 2h05m."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def format_number(value: Number) -> str:
    """Compact number: ints as is, floats with 4 significant digits."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def format_progress(record: StepRecord, total_steps: int | None, width: int = 20) -> str:
    """The console line for one step, e.g. `[#####-----] 5/10  50% ETA 1m40s | reward 0.5 kl 0.01`."""
    done = record.step
    if total_steps:
        frac = min(max(done / total_steps, 0.0), 1.0)
        filled = int(round(frac * width))
        head = f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total_steps} {frac:4.0%}"
        head += f" ETA {format_duration(record.eta_s)}"
    else:
        head = f"step {record.step}"
    keys = [f"{label} {format_number(record.scalars[n])}" for n, label in KEY_METRICS if n in record.scalars]
    return head + (" | " + " ".join(keys) if keys else "")


class ConsoleWriter:
    """Writes the progress line to `stream` (default stderr) after every step."""

    def __init__(self, total_steps: int | None, stream: TextIO | None = None, width: int = 20):
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        isatty = getattr(self.stream, "isatty", None)
        self._inplace = bool(isatty and isatty())
        self._dirty = False

    def write(self, record: StepRecord) -> None:
        line = format_progress(record, self.total_steps, self.width)
        if self._inplace:
            self.stream.write("\r" + line + "\x1b[K")
            self._dirty = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._dirty:
            self.stream.write("\n")
            self.stream.flush()
            self._dirty = False
