"""Metric writers: JSONL (always), TensorBoard event files (tensorboardX), Weights & Biases (optional).

Each writer takes a `StepRecord` (host-side python values) per step and is closed once. They are used
through `MetricsLogger`, which runs them on process 0 only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rljax.metrics.status import atomic_write_text
from rljax.metrics.values import Number, StepRecord

RESERVED_KEYS = ("step", "time")  # JSONL keys that are not metrics


# ------------------------------------------------------------------------------------------------ JSONL
def _json_value(value: Any) -> Any:
    """Strict JSON: a non-finite float becomes null (TensorBoard and W&B keep the NaN itself)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def read_jsonl(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl, in file order; unparsable (crash-cut) lines skipped."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
    return records


def prepare_jsonl(path: str | pathlib.Path, resume_step: int | None) -> int | None:
    """Makes an existing metrics file hold exactly one line per step, all below `resume_step`.

    Lines with step >= `resume_step` (the first step the resumed run writes) are dropped; of duplicated steps
    the last line wins; unparsable lines are dropped. The file is rewritten atomically, and only if that
    changes it. Returns the last step kept, or None if none (or no file).
    """
    path = pathlib.Path(path)
    if not path.exists():
        return None
    by_step = {r["step"]: r for r in read_jsonl(path) if resume_step is None or r["step"] < resume_step}
    text = "".join(json.dumps(by_step[s], allow_nan=False) + "\n" for s in sorted(by_step))
    if text != path.read_text(encoding="utf-8", errors="replace"):
        atomic_write_text(path, text)
    return max(by_step) if by_step else None


class JsonlWriter:
    """Appends one JSON object per step to `path`: {"step": int, "time": unix s, <name>: value, ...}.

    Steps must increase: writing a step at or below the last one raises ValueError (merge a step's metrics
    into one write, and resume with `resume_step` so the file is truncated first).
    """

    def __init__(self, path: str | pathlib.Path, resume_step: int | None = None):
        self.path = pathlib.Path(path)
        self.last_step = prepare_jsonl(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        if self.last_step is not None and record.step <= self.last_step:
            raise ValueError(
                f"metrics for step {record.step} come after step {self.last_step}: write each step once, in "
                "order (merge a step's metrics into one write; on resume pass resume_step)"
            )
        clash = [k for k in RESERVED_KEYS if k in record.scalars or k in record.hists]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in metrics.jsonl")
        obj = {"step": record.step, "time": record.wall_time, **record.scalars, **record.hists}
        line = json.dumps({k: _json_value(v) for k, v in obj.items()}, allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()
        self.last_step = record.step

    def close(self) -> None:
        self._file.close()


# ------------------------------------------------------------------------------------------ TensorBoard
def histogram_from_counts(counts: Sequence[Number]) -> dict[str, Any] | None:
    """TensorBoard raw-histogram fields for counts[k] of integer value k (bucket k spans (k-0.5, k+0.5]).

    Returns None when all counts are 0 (TensorBoard has no empty histogram).
    """
    num = sum(counts)
    if num <= 0:
        return None
    present = [k for k, c in enumerate(counts) if c > 0]
    return {
        "min": float(present[0]),
        "max": float(present[-1]),
        "num": float(num),
        "sum": float(sum(k * c for k, c in enumerate(counts))),
        "sum_squares": float(sum(k * k * c for k, c in enumerate(counts))),
        "bucket_limits": [k + 0.5 for k in range(len(counts))],
        "bucket_counts": [float(c) for c in counts],
    }


class TensorBoardWriter:
    """Scalars and histograms into TensorBoard event files under `logdir`, flushed every step.

    On resume, `resume_step` is passed as tensorboardX's `purge_step`: TensorBoard then drops the old run's
    events at or after that step, so each step shows once.
    """

    def __init__(self, logdir: str | pathlib.Path, resume_step: int | None = None):
        from tensorboardX import SummaryWriter  # imported here: the monitor and report never need it

        # tensorboardX names files by second and host only: a restart within the same second would
        # overwrite the old file. The suffix keeps names unique and in write order (TensorBoard reads a
        # directory's files in name order, which purging relies on).
        suffix = f".{time.time_ns()}.{os.getpid()}"
        self._writer = SummaryWriter(
            logdir=str(logdir), purge_step=resume_step, flush_secs=30, filename_suffix=suffix
        )

    def write(self, record: StepRecord) -> None:
        for name, value in record.scalars.items():
            self._writer.add_scalar(name, value, record.step, walltime=record.wall_time)
        for name, counts in record.hists.items():
            fields = histogram_from_counts(counts)
            if fields is not None:
                self._writer.add_histogram_raw(
                    name, global_step=record.step, walltime=record.wall_time, **fields
                )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# ------------------------------------------------------------------------------------- Weights & Biases
@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """The `wandb=` dict of MetricsLogger. mode "offline" writes under workdir/wandb/ with no network."""

    project: str
    mode: str = "offline"  # "offline", "online" or "disabled"
    name: str | None = None
    entity: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    config: Mapping[str, Any] | None = None  # the run config, stored with the run

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> WandbSettings:
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(valid))
        if unknown or "project" not in settings:
            raise ValueError(f"wandb settings need 'project'; unknown keys {unknown}; valid keys: {valid}")
        return cls(**{**settings, "tags": tuple(settings["tags"]) if "tags" in settings else ()})


def import_wandb() -> Any:
    """Imports wandb, or raises ImportError saying how to install it or turn W&B off."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            "Weights & Biases logging is configured (MetricsLogger(wandb=...) / metrics.wandb_project) but "
            "the `wandb` package is not installed: `pip install 'rljax[wandb]'`, or turn W&B off (wandb=None)"
        ) from err
    return wandb


class WandbWriter:
    """Logs each step to a W&B run (histograms as wandb.Histogram with one bin per integer value).

    The run id is kept in `workdir/wandb_run_id`; a resumed logger (resume_step given) continues that run.
    """

    def __init__(
        self, workdir: str | pathlib.Path, settings: Mapping[str, Any], resume_step: int | None = None
    ):
        cfg = WandbSettings.from_dict(settings)
        self._wandb = import_wandb()
        id_file = pathlib.Path(workdir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
        self.run = self._wandb.init(
            project=cfg.project,
            mode=cfg.mode,
            name=cfg.name,
            entity=cfg.entity,
            group=cfg.group,
            tags=list(cfg.tags),
            config=dict(cfg.config) if cfg.config is not None else None,
            dir=str(workdir),
            id=run_id,
            resume="allow" if run_id else None,
            settings=self._wandb.Settings(silent=True),
        )
        atomic_write_text(id_file, self.run.id + "\n")

    def write(self, record: StepRecord) -> None:
        data: dict[str, Any] = dict(record.scalars)
        for name, counts in record.hists.items():
            if not counts:
                continue
            edges = [k - 0.5 for k in range(len(counts) + 1)]
            data[name] = self._wandb.Histogram(np_histogram=(list(counts), edges))
        self.run.log(data, step=record.step)

    def close(self) -> None:
        self.run.finish()
