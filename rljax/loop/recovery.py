"""Rollout-server fault handling for the host loop: retry an operation after restarting the server.

The loop's engine (`rljax.loop.engine.LoopEngine`) wraps each rollout call and each weight push in
`call_with_recovery`. When the call raises one of the recoverable errors (`RolloutError`,
`WeightSyncError`, `ServerError`), `recover()` restarts the server and re-pushes the current weights and
version; the operation (the same prompts, same seed) is then resubmitted. After `max_restarts` failed
restarts the run stops with a `RecoveryExhaustedError` naming the last error.

`FaultPlan` is the test-only fault injection the fault suite (tests/loop/test_faults_loop.py) drives through
the RLJAX_FAULTS environment variable; it is inert when the variable is unset.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import requests

from rljax.rollout.auth import bearer_headers
from rljax.rollout.client import RolloutError
from rljax.rollout.server import ServerError
from rljax.weight_sync.syncer import WeightSyncError

T = TypeVar("T")
log = logging.getLogger(__name__)
RECOVERABLE: tuple[type[BaseException], ...] = (RolloutError, WeightSyncError, ServerError)


class RecoveryExhaustedError(RuntimeError):
    """The rollout server failed again after `max_restarts` restarts."""


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


# --- test-only fault injection ---------------------------------------------------------------------------

FAULTS = ("kill_server_mid_generate", "kill_server_mid_sync")
_SPEC = re.compile(r"^([a-z_]+):([1-9][0-9]*)$")


@dataclasses.dataclass
class FaultPlan:
    """Faults to inject on the N-th (1-based) generate or weight-push call of this process's loop engine.

    RLJAX_FAULTS="kill_server_mid_generate:2,kill_server_mid_sync:3":
    `kill_server_mid_generate:N` SIGKILLs the servers once the N-th generate call has requests running
    (if that call ends before, the fault moves on to the next call),
    `kill_server_mid_sync:N` SIGKILLs them halfway through the N-th push's tensors.
    """

    faults: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_env(cls, env: dict | None = None) -> FaultPlan:
        raw = (os.environ if env is None else env).get("RLJAX_FAULTS", "")
        plan = cls()
        for item in filter(None, (s.strip() for s in raw.split(","))):
            m = _SPEC.match(item)
            if not m or m.group(1) not in FAULTS:
                raise ValueError(f"RLJAX_FAULTS: bad item {item!r}; expected NAME:N with NAME in {FAULTS}")
            plan.faults.setdefault(m.group(1), set()).add(int(m.group(2)))
        return plan

    def postpone(self, fault: str) -> None:
        """Moves `fault` from the current call to the next one (it could not be injected this time)."""
        op = "generate" if fault != "kill_server_mid_sync" else "sync"
        self.faults.setdefault(fault, set()).add(self.calls.get(op, 0) + 1)

    def next_call(self, op: str) -> set[str]:
        """Counts one `op` ("generate" or "sync") call; returns the faults planned for it."""
        n = self.calls[op] = self.calls.get(op, 0) + 1
        kinds = {"generate": ("kill_server_mid_generate",), "sync": ("kill_server_mid_sync",)}
        return {f for f in kinds[op] if n in self.faults.get(f, ())}


def kill_when_running(servers, done: threading.Event) -> dict:
    """Starts a thread that SIGKILLs `servers` once the first has requests running or waiting (vLLM
    `/metrics`), unless `done` is set first; the returned dict gets `killed: True` when it did."""
    result = {"killed": False}

    def run() -> None:
        while not done.is_set():
            try:
                headers = bearer_headers(servers[0].token)
                text = requests.get(servers[0].url + "/metrics", headers=headers, timeout=2.0).text
            except requests.RequestException:
                text = ""
            pattern = r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$"
            if any(float(v) > 0 for v in re.findall(pattern, text, re.M)) and not done.is_set():
                log.warning("RLJAX_FAULTS: killing the rollout server mid-generation")
                for s in servers:
                    s.kill()
                result["killed"] = True
                return
            time.sleep(0.002)

    result["thread"] = threading.Thread(target=run, name="rljax-fault-kill", daemon=True)
    result["thread"].start()
    return result


def kill_halfway(tensors: list[tuple[str, object]], servers) -> Iterator[tuple[str, object]]:
    """`tensors`, SIGKILLing `servers` after the first half of them (a server dying mid-sync)."""
    for k, item in enumerate(tensors):
        if k == len(tensors) // 2:
            log.warning("RLJAX_FAULTS: killing the rollout server mid-sync")
            for s in servers:
                s.kill()
        yield item
