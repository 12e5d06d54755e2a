"""Test-only fault injection at the vLLM boundary: real SIGKILLs of the rollout servers, timed by call count.

Nothing in `rljax/` knows about it. `FaultyEngine(engine, plan)` is an `rljax.sampling.Engine` that wraps a
`RolloutEngine` and injects the plan's faults through the engine's public calls (the fault suite's
`fault_main.py` wraps the engine `rljax.loop.engine.make_engine` builds):

- `kill_server_mid_generate:N` SIGKILLs the servers once the N-th `generate` call has requests running or
  waiting (vLLM `/metrics`), or at the latest when the call's answers came back (a generation that ends
  between two scrapes of the gauge is still killed, so the fault always lands on call N). A call whose
  answers came back before the kill landed is submitted again, as if its attempt had failed: the
  engine's recovery (restart, re-push, resubmit) always runs.
- `kill_server_mid_sync:N` SIGKILLs them halfway through the tensors of the N-th weight push's first
  attempt (`KillingSnapshot`): a `push_weights` call, or an async-mode `start_push` delivered in the
  background (on whichever thread delivers the push).

Calls are counted per plan; the recovery's own re-pushes are not counted.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Iterator

import requests

from rljax.rollout.auth import bearer_headers

log = logging.getLogger("rljax.test_faults")
FAULTS = {"kill_server_mid_generate": "generate", "kill_server_mid_sync": "push"}
_SPEC = re.compile(r"^([a-z_]+):([1-9][0-9]*)$")


@dataclasses.dataclass
class FaultPlan:
    """Faults to inject on the N-th (1-based) generate call or weight push: `{fault: {N, ...}}`."""

    faults: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """From "kill_server_mid_generate:2,kill_server_mid_sync:3" (empty: no faults)."""
        plan = cls()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            m = _SPEC.match(item)
            if not m or m.group(1) not in FAULTS:
                raise ValueError(f"faults: bad item {item!r}; expected NAME:N with NAME in {sorted(FAULTS)}")
            plan.faults.setdefault(m.group(1), set()).add(int(m.group(2)))
        return plan

    def next_call(self, op: str) -> set[str]:
        """Counts one `op` ("generate" or "push") call; returns the faults planned for it."""
        n = self.calls[op] = self.calls.get(op, 0) + 1
        return {f for f, o in FAULTS.items() if o == op and n in self.faults.get(f, ())}

    def postpone(self, fault: str) -> None:
        """Moves `fault` from the current call to the next one (it could not be injected this time)."""
        self.faults.setdefault(fault, set()).add(self.calls.get(FAULTS[fault], 0) + 1)


def kill_when_running(servers, done: threading.Event) -> dict:
    """Starts a thread that SIGKILLs `servers` once the first has requests running or waiting (vLLM
    `/metrics`), unless `done` is set first; the returned dict gets `killed: True` when it did, and its
    `kill(why)` kills them now (once, from any thread, not after `done`)."""
    result = {"killed": False}
    lock = threading.Lock()

    def kill(why: str) -> None:
        with lock:
            if result["killed"] or done.is_set():
                return
            log.warning("test faults: killing the rollout server mid-generation (%s)", why)
            for s in servers:
                s.kill()
            result["killed"] = True

    def run() -> None:
        while not done.is_set():
            try:
                headers = bearer_headers(servers[0].token)
                text = requests.get(servers[0].url + "/metrics", headers=headers, timeout=2.0).text
            except requests.RequestException:
                text = ""
            pattern = r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$"
            if any(float(v) > 0 for v in re.findall(pattern, text, re.M)):
                return kill("requests running or waiting")
            time.sleep(0.002)

    result["kill"] = kill
    result["thread"] = threading.Thread(target=run, name="rljax-fault-kill", daemon=True)
    result["thread"].start()
    return result


def kill_halfway(tensors: list[tuple[str, object]], servers) -> Iterator[tuple[str, object]]:
    """`tensors`, SIGKILLing `servers` after the first half of them (a server dying mid-sync)."""
    for k, item in enumerate(tensors):
        if k == len(tensors) // 2:
            log.warning("test faults: killing the rollout server mid-sync")
            for s in servers:
                s.kill()
        yield item


class KillingSnapshot:
    """A snapshot whose first push SIGKILLs the servers halfway through its tensors (a host-tensor snapshot:
    `tensors()` and `logprobs`); its later pushes (a recovery's) and its kept copies push as `inner` does.
    `attempts`: the thread of each push; `ended` is set once the killing push ended."""

    def __init__(self, inner, servers, fired: threading.Event | None = None, ended=None):
        self.inner, self.servers = inner, list(servers)
        self.fired = fired if fired is not None else threading.Event()
        self.ended = ended if ended is not None else threading.Event()
        self.attempts: list[str] = []

    def push(self, syncer, version: int) -> dict:
        self.attempts.append(threading.current_thread().name)
        if self.fired.is_set():
            return self.inner.push(syncer, version)
        self.fired.set()
        try:
            tensors = kill_halfway(list(self.inner.tensors()), self.servers)
            return syncer.push_weights(tensors, version, self.inner.logprobs)
        finally:
            self.ended.set()

    def keep(self) -> KillingSnapshot:
        kept = KillingSnapshot(self.inner.keep(), self.servers, self.fired, self.ended)
        kept.attempts = self.attempts  # async mode: the kept copy is the one pushed
        return kept

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class FaultyEngine:
    """`engine` (a `RolloutEngine`) with `plan`'s faults: counts `generate` calls and weight pushes and
    kills the servers on the planned ones (see the module docstring). Everything else is `engine`'s."""

    def __init__(self, engine, plan: FaultPlan):
        self.engine, self.plan = engine, plan

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, **sampling):
        if "kill_server_mid_generate" not in self.plan.next_call("generate"):
            return self.engine.generate(prompts, **sampling)
        epoch, done = self.engine.recovery.epoch, threading.Event()
        killer = kill_when_running(self.engine.servers, done)
        try:
            out = self.engine.generate(prompts, **sampling)
        finally:
            killer["kill"]("its answers came back")  # not killed while running: now
            done.set()
            killer["thread"].join()
        if self.engine.recovery.epoch == epoch:  # its answers came back before the kill landed
            out = self.engine.generate(prompts, **sampling)  # fails on the dead servers and recovers
        return out

    def push_weights(self, snapshot, version: int) -> dict:
        return self.engine.push_weights(self._armed(snapshot), version)

    def start_push(self, snapshot, version: int, on_served=None) -> None:
        self.engine.start_push(self._armed(snapshot), version, on_served)

    def _armed(self, snapshot):
        if "kill_server_mid_sync" in self.plan.next_call("push"):
            return KillingSnapshot(snapshot, self.engine.servers)
        return snapshot
