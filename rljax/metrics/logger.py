"""`MetricsLogger`: the one object the host loop writes metrics through (process 0 only)."""

from __future__ import annotations

import pathlib
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO

from rljax.metrics.console import ConsoleWriter, EtaEstimator
from rljax.metrics.schema import lookup
from rljax.metrics.values import StepRecord, split_metrics
from rljax.metrics.writers import RESERVED_KEYS, JsonlWriter, TensorBoardWriter, WandbWriter

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class Writer(Protocol):
    def write(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    """Writes one dict of metrics per step to JSONL, TensorBoard, the console and (optionally) W&B.

    Files: `workdir/metrics.jsonl` (always; one object per step with "step"), `workdir/tensorboard/`,
    `workdir/wandb/` (W&B, when `wandb={"project": ..., "mode": "offline", "name": ...}`).
    Only `process_index == 0` writes; on other processes every method is a no-op and no file is created.

    Args:
      resume_step: the first step this run will write after a restart. Lines of metrics.jsonl with
        step >= resume_step are removed on open (so the file keeps one line per step) and TensorBoard purges
        the old events from that step on. None keeps an existing file as it is and appends after it.
      total_steps: the last step of the run (step k = k steps done), for the progress bar and ETA.
      console_stream, time_fn: where the progress line goes (default stderr) and the ETA clock.

    Values may be python numbers, numpy or jax scalars (copied to the host here); histogram metrics
    (e.g. `staleness/hist`) take a list of counts or a `{value: count}` dict. A name missing from
    `rljax.metrics.SCHEMA` is written anyway, with one warning per name.
    """

    def __init__(
        self,
        workdir: str | pathlib.Path,
        *,
        process_index: int = 0,
        tensorboard: bool = True,
        console: bool = True,
        wandb: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        resume_step: int | None = None,
        console_stream: TextIO | None = None,
        time_fn: Callable[[], float] = time.monotonic,
    ):
        self.workdir = pathlib.Path(workdir)
        self.active = process_index == 0
        self.eta_s: float | None = None
        self._eta = EtaEstimator(total_steps, time_fn)
        self._warned: set[str] = set()
        self._writers: list[Writer] = []
        if not self.active:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._writers.append(JsonlWriter(self.workdir / METRICS_FILE, resume_step))
            if tensorboard:
                self._writers.append(TensorBoardWriter(self.workdir / TENSORBOARD_DIR, resume_step))
            if wandb:
                self._writers.append(WandbWriter(self.workdir, wandb, resume_step))
            if console:
                self._writers.append(ConsoleWriter(total_steps, console_stream))
        except BaseException:
            self.close()
            raise

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes all metrics of `step` (one call per step, steps increasing)."""
        if not self.active:
            return
        if isinstance(step, bool) or int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        reserved = [k for k in RESERVED_KEYS if k in metrics]
        if reserved:
            raise ValueError(f"metric names {reserved} are reserved in metrics.jsonl")
        scalars, hists = split_metrics(metrics)
        self._warn_unknown([*scalars, *hists])
        self.eta_s = self._eta.update(int(step))
        record = StepRecord(int(step), scalars, hists, wall_time=time.time(), eta_s=self.eta_s)
        for writer in self._writers:
            writer.write(record)

    def _warn_unknown(self, names: list[str]) -> None:
        for name in names:
            if name not in self._warned and lookup(name) is None:
                self._warned.add(name)
                warnings.warn(
                    f"metric {name!r} is not in rljax.metrics.SCHEMA (docs/metrics.md); writing it anyway",
                    stacklevel=3,
                )

    def close(self) -> None:
        """Flushes and closes every writer (idempotent)."""
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
