"""Rollout-server fault handling for the host loop: retry an operation after restarting the server.

The loop wraps each rollout call and each weight push in `call_with_recovery`. When the call raises one of
the recoverable errors (`RolloutError`, `WeightSyncError`), `recover()` restarts the server and re-pushes
the current weights and version; the operation (e.g. the same prompts, same seed) is then resubmitted.
After `max_restarts` failed restarts the run stops with a `RecoveryExhaustedError` naming the last error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from rljax.rollout.client import RolloutError
from rljax.weight_sync.syncer import WeightSyncError

T = TypeVar("T")
log = logging.getLogger(__name__)
RECOVERABLE: tuple[type[BaseException], ...] = (RolloutError, WeightSyncError)


class RecoveryExhaustedError(RuntimeError):
    """The rollout server failed again after `max_restarts` restarts."""


def call_with_recovery(
    op: Callable[[], T],
    recover: Callable[[], object],
    max_restarts: int,
    what: str,
    recoverable: tuple[type[BaseException], ...] = RECOVERABLE,
    stats: dict | None = None,
) -> T:
    """Runs `op()`; on a recoverable error calls `recover()` and retries, at most `max_restarts` times.

    `recover` must restart the server and re-push the current weights and version, so that a resubmitted `op`
    sees the same policy. A failing `recover()` counts as a failed restart. `stats`, if given, gets
    `recovery/restarts` (count) and `recovery/seconds` (time spent recovering) added.
    Raises `RecoveryExhaustedError` (chained to the last error) once the restarts are used up.
    """
    restarts = 0
    while True:
        try:
            return op()
        except recoverable as err:
            last = err
        while True:
            if restarts >= max_restarts:
                raise RecoveryExhaustedError(
                    f"{what}: rollout server still failing after {restarts} restart(s) "
                    f"(rollout.vllm.max_restarts={max_restarts}); last error: {last!r}"
                ) from last
            restarts += 1
            log.warning(
                "%s failed (%r): restarting rollout server (%d/%d)", what, last, restarts, max_restarts
            )
            t0 = time.perf_counter()
            try:
                recover()
                break
            except recoverable as err:
                last = err
            finally:
                if stats is not None:
                    stats["recovery/restarts"] = stats.get("recovery/restarts", 0.0) + 1.0
                    stats["recovery/seconds"] = stats.get("recovery/seconds", 0.0) + time.perf_counter() - t0
