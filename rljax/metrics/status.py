"""Per-process status files for job monitoring: `workdir/status/process_<i>.json`, replaced atomically.

Every process (not only process 0) calls `StatusWriter.update(...)` at each loop phase. The file is written
to a temporary name in the same directory, flushed and fsynced, then `os.replace`d over the old one, so a
reader sees either the previous or the new status, never a half-written one. The heartbeat is refreshed
only by `update` calls from the loop itself (no background thread): a process stuck in a collective or a
rollout stops heartbeating, which is what `python -m rljax.monitor` flags.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
from collections.abc import Callable
from typing import Any

STATUS_DIR = "status"
DONE_PHASES = ("done", "failed")  # a process in these phases is finished, never "stalled"
STATUS_FIELDS = ("step", "phase", "policy_version", "eta_s", "total_steps")


def atomic_write_text(path: str | pathlib.Path, text: str, fsync: bool = True) -> None:
    """Writes `text` to `path` via a temporary file in the same directory and `os.replace`."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def status_path(workdir: str | pathlib.Path, process_index: int) -> pathlib.Path:
    return pathlib.Path(workdir) / STATUS_DIR / f"process_{process_index}.json"


class StatusWriter:
    """Keeps `workdir/status/process_<i>.json` current: step, phase, policy version, ETA, heartbeat time.

    `update` merges the given fields into the last status (fields not given keep their values) and writes
    it with `heartbeat` = `time_fn()` (unix seconds). Extra keyword fields are stored as they are.
    """

    def __init__(
        self,
        workdir: str | pathlib.Path,
        process_index: int,
        *,
        time_fn: Callable[[], float] = time.time,
        fsync: bool = True,
    ):
        self.path = status_path(workdir, process_index)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._time_fn = time_fn
        self._fsync = fsync
        now = time_fn()
        self.status: dict[str, Any] = {
            "process_index": process_index,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": now,
            "heartbeat": now,
            **{k: None for k in STATUS_FIELDS},
        }

    def update(self, **fields: Any) -> dict[str, Any]:
        """Merges `fields` (step=, phase=, policy_version=, eta_s=, total_steps=, ...) and writes the file."""
        for reserved in ("process_index", "host", "pid", "started", "heartbeat"):
            if reserved in fields:
                raise ValueError(f"status field {reserved!r} is set by StatusWriter itself")
        self.status.update(fields)
        self.status["heartbeat"] = self._time_fn()
        atomic_write_text(self.path, json.dumps(self.status, default=_json_default), fsync=self._fsync)
        return dict(self.status)

    def close(self, phase: str = "done") -> None:
        """Marks the process finished (phase "done" or "failed"): the monitor stops expecting heartbeats."""
        self.update(phase=phase)


def _json_default(value: Any) -> Any:
    try:  # numpy / jax scalars
        return value.item()
    except AttributeError:
        raise TypeError(f"status value {value!r} is not JSON serializable") from None


def read_statuses(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
    """All processes' status dicts under `workdir/status/`, by process index; unreadable ones skipped."""
    out = []
    for p in sorted((pathlib.Path(workdir) / STATUS_DIR).glob("process_*.json")):
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            continue  # removed between glob and read, or not a status file
    return sorted(out, key=lambda s: s.get("process_index", 0))


def is_stalled(status: dict[str, Any], now: float, stall_after_s: float) -> bool:
    """True if the process is not finished and its heartbeat is older than `stall_after_s` seconds."""
    if status.get("phase") in DONE_PHASES:
        return False
    return now - float(status["heartbeat"]) > stall_after_s
