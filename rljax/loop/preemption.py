"""Preemption: SIGTERM or SIGUSR1 -> save at the next step boundary (all processes agree) -> exit 143.

Exit status 143 (128 + SIGTERM) tells `launch/gpu_slurm.sh` to requeue the job; the requeued job resumes
from the checkpoint the boundary wrote.
"""

from __future__ import annotations

import signal
import sys

import numpy as np

PREEMPTED_EXIT_CODE = 143


class PreemptionWatch:
    """Installs handlers for SIGTERM and SIGUSR1 and reports, collectively, whether to stop now."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.requested = False
        self.signal_name = ""
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        print(
            f"rljax: received {self.signal_name}; saving at the next step boundary",
            file=sys.stderr,
            flush=True,
        )

    def should_stop(self) -> bool:
        """True on every process when any process received a signal (a collective in multi-process runs)."""
        import jax

        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray([int(self.requested)], np.int32))
        return bool(np.asarray(flags).any())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
