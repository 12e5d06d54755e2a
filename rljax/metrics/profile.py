"""Profiling chosen train steps (`metrics.profile_steps`) with `jax.profiler`.

A run of consecutive chosen steps becomes one trace: `jax.profiler.start_trace` before the first,
`stop_trace` after the last. Traces land in `<logdir>/plugins/profile/<timestamp>/`: `<host>.xplane.pb`
(TensorBoard's profile plugin: `tensorboard --logdir <logdir>`), `<host>.trace.json.gz` and
`perfetto_trace.json.gz` (open in ui.perfetto.dev). Each step is a `StepTraceAnnotation("train",
step_num=step)`, which the profile plugin's step-time views read. (`clu.profiler.start/stop` are these
same two jax.profiler calls.)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator

import jax


def profile_dir(workdir: str, process_index: int) -> str:
    """workdir/profile for process 0; workdir/profile/process_<i> for the others (one host name each)."""
    base = os.path.join(workdir, "profile")
    return base if process_index == 0 else os.path.join(base, f"process_{process_index}")


class StepProfiler:
    """`with profiler.step(s): ...` traces step `s` if it is one of `steps`; no-op otherwise.

    The body must finish its device work before it returns (the loop's step does: metrics and the
    weight sync read the update's results), so a trace holds whole steps.
    """

    def __init__(self, logdir: str, steps: Iterable[int]):
        self.logdir, self.steps, self.active = logdir, frozenset(int(s) for s in steps), False
        self._stopped_at = -float("inf")

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        if not self.active:
            # A trace is exported to plugins/profile/<time in whole seconds>/<host>.*: two traces that
            # end within the same second would overwrite each other, so they end >= 1 s apart.
            time.sleep(max(0.0, self._stopped_at + 1.0 - time.monotonic()))
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
            self.active = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield
        if step + 1 not in self.steps:
            self.stop()

    def stop(self) -> None:
        """Ends the open trace (if any) and writes it."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
            self._stopped_at = time.monotonic()
