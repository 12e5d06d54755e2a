"""Rollout-server fault handling: retry an operation after restarting the server.

The rollout engine (`rljax.rollout.engine.RolloutEngine`) wraps each generate call and each weight push in
`call_with_recovery`. When the call raises one of the recoverable errors (`RolloutError`,
`WeightSyncError`, `ServerError`), `recover()` restarts the server and re-pushes the current weights and
version; the operation (the same prompts, same seed) is then resubmitted. After `max_restarts` failed
restarts the run stops with a `RecoveryExhaustedError` naming the last error.

Fault injection for tests lives outside the package (tests/support/faults.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from rljax.rollout.client import RolloutError
from rljax.rollout.server import ServerError
from rljax.weight_sync.syncer import WeightSyncError

T = TypeVar("T")
log = logging.getLogger(__name__)
RECOVERABLE: tuple[type[BaseException], ...] = (RolloutError, WeightSyncError, ServerError)
RECOVERY_METRICS = (
    "recovery/restarts",
    "recovery/failed_restarts",
    "recovery/resubmitted",
    "recovery/seconds",
)


class RecoveryExhaustedError(RuntimeError):
    """The rollout server failed again after `max_restarts` restarts."""


class EngineCrashError(RuntimeError):
    """A vLLM server crashed again, after a restart, with the same root cause: a deterministic crash
    (the same requests crash the same engine), not retried further."""


def _add(stats: dict | None, key: str, value: float) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0.0) + value


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
    sees the same policy; it returns False when it had nothing to do (another caller recovered the server
    meanwhile), which still uses up one attempt but is not counted as a restart. A failing `recover()`
    counts as a failed restart. `stats`, if given, gets `recovery/restarts`, `recovery/failed_restarts`
    (counts) and `recovery/seconds` (time spent recovering) added.
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
                if recover() is not False:
                    _add(stats, "recovery/restarts", 1.0)
                break
            except recoverable as err:
                last = err
                _add(stats, "recovery/restarts", 1.0)
                _add(stats, "recovery/failed_restarts", 1.0)
            finally:
                _add(stats, "recovery/seconds", time.perf_counter() - t0)
