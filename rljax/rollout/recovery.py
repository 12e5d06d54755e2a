"""Rollout-server fault handling: retry an operation after restarting the server.

The rollout engine (`rljax.rollout.engine.RolloutEngine`) wraps each generate call and each weight push in
`call_with_recovery`, through its `Recovery` (the owned servers, the lock, the last pushed version). When
the call raises one of the recoverable errors (`RolloutError`, `WeightSyncError`, `ServerError`),
`recover()` restarts the server and re-pushes the current weights and version; the operation (the same
prompts, same seed) is then resubmitted. After `max_restarts` failed restarts the run stops with a
`RecoveryExhaustedError` naming the last error.

Fault injection for tests lives outside the package (tests/support/faults.py: `FaultyEngine`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from rljax.rollout.client import RolloutError
from rljax.rollout.pushing import Snapshot, push_verified
from rljax.rollout.server import ServerError, VLLMServer
from rljax.weight_sync.gate import PolicyGate
from rljax.weight_sync.syncer import WeightSyncer, WeightSyncError

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


def _restarting(servers: Sequence[VLLMServer]) -> str:
    return f"restarting {', '.join(s.url for s in servers)}; serving again after the re-push"


class Recovery:
    """Restart + re-push for one engine (`max_restarts` > 0; 0: every error is raised as it is).

    `call(op, recover, what)` runs `op` under `call_with_recovery`; `recover_from(epoch)` is the generate
    side's recover: restart every owned server that died or stopped answering, re-push the last pushed
    version (`remember`) and count one recovery (`epoch`). A server that crashes again after a restart
    with the same root-cause line in its log ends the call at once (`EngineCrashError`). One recovery (or
    push) runs at a time (`lock`, shared by the loop and the async push's thread); a caller whose failure
    predates a recovery that already happened just retries. recovery/* counts accumulate until `drain()`.
    """

    def __init__(
        self, servers: Sequence[VLLMServer], syncer: WeightSyncer, gate: PolicyGate, max_restarts: int = 0
    ):
        self.servers, self.syncer, self.gate, self.max_restarts = list(servers), syncer, gate, max_restarts
        self.lock = threading.RLock()  # one recovery (or push) at a time
        self.epoch = 0  # recoveries done; a failure seen before the latest one needs no new restart
        self._last_crash: str | None = None  # root cause of the crash the latest restart followed
        self._current: tuple[Snapshot, int] | None = None  # (last pushed weights, kept; version)
        self._stats: dict[str, float] = dict.fromkeys(RECOVERY_METRICS, 0.0)
        self._stats_lock = threading.Lock()

    def call(self, op: Callable[[], T], recover: Callable[[], object], what: str) -> T:
        if self.max_restarts == 0:
            return op()
        stats: dict[str, float] = {}
        try:
            result = call_with_recovery(op, recover, self.max_restarts, f"rollout {what}", stats=stats)
            self._last_crash = None  # a crash after a call that worked is a new one
            return result
        finally:
            self.count(stats)

    def remember(self, snapshot: Snapshot, version: int) -> None:
        """`snapshot` (pushed as `version`) is what a later recovery re-pushes (a kept copy)."""
        if self.max_restarts > 0:
            self._current = (snapshot.keep(), version)

    def recovered(self) -> None:
        """Counts a recovery that a push did itself (restart, then its own snapshot pushed)."""
        self.epoch += 1

    def restart_unhealthy(self) -> list[VLLMServer]:
        """Restarts (all at once) the owned servers that died or do not answer `/health` and forgets the
        syncer's per-server state; returns the restarted servers. A full push must follow (it also
        repairs a live server left with mixed weights by a failed push). Until it succeeds the gate is
        broken: a restarted server serves the checkpoint, not the gate's version, so a generate call that
        came in meanwhile would get samples labelled with the wrong policy version."""
        dead = [s for s in self.servers if not s.healthy()]
        self._check_repeated_crash(dead)
        if dead and not self.gate.broken:  # (a failed push's "mixed weights" stays until its re-push)
            self.gate.broken = _restarting(dead)
        for s in dead:
            s.stop()
            s.spawn()
        for s in dead:
            s.wait_healthy(s.options.startup_timeout_s)
        self.syncer.reset()
        return dead

    def _check_repeated_crash(self, dead: Sequence[VLLMServer]) -> None:
        """Raises EngineCrashError when a server crashed with the root cause (`VLLMServer.crash_cause`) of
        the crash the previous restart followed, with no call succeeding in between: the same requests
        crash the same engine again, so restarting more only repeats it."""
        crashes = [(s, cause) for s in dead if (cause := s.crash_cause())]
        for server, cause in crashes:
            if cause == self._last_crash:
                raise EngineCrashError(
                    f"vLLM server {server.url} crashed again after a restart with the same error, not "
                    f"retried: {cause} (server log: {server.log_path})"
                )
        self._last_crash = crashes[0][1] if crashes else None

    def recover_from(self, seen_epoch: int) -> bool:
        """Restart + re-push of the last pushed weights and version (False: someone else recovered)."""
        with self.lock:
            if self.epoch != seen_epoch:
                return False
            dead = self.restart_unhealthy()
            if self._current is not None:
                kept, version = self._current
                push_verified(self.syncer, kept, version)
            elif dead and self.gate.broken == _restarting(dead):  # nothing was pushed: a restarted
                self.gate.broken = None  # server serves the same checkpoint as before
            self.epoch += 1
            return True

    def count(self, stats: dict) -> None:
        with self._stats_lock:
            for k, v in stats.items():
                self._stats[k] = self._stats.get(k, 0.0) + v

    def drain(self) -> dict[str, float]:
        """The recovery/* counts since the last call."""
        with self._stats_lock:
            out, self._stats = self._stats, dict.fromkeys(RECOVERY_METRICS, 0.0)
        return out
