"""Test-only fault injection at the vLLM boundary: real SIGKILLs of the rollout servers, timed by call count.

Nothing in `rljax/` knows about it. `install(plan)` wraps `RolloutEngine`'s methods in this process (the
fault suite's `fault_main.py` does it before `rljax.main.run`):

- `kill_server_mid_generate:N` SIGKILLs the servers once the N-th `generate` call's first attempt has
  requests running or waiting (vLLM `/metrics`), or at the latest when its first answer reaches the
  client (before the client sees it: a generation that ends between two scrapes of the gauge is still
  killed, so the fault always lands on call N). A killed attempt fails with `RolloutError` even when its
  last request was answered just before the kill landed, so the engine's recovery (restart, re-push,
  resubmit) always runs.
- `kill_server_mid_sync:N` SIGKILLs them halfway through the tensors of the N-th weight push's first
  attempt: a `push_weights` call, or an async-mode `start_push` delivered in the background (both go
  through `RolloutEngine._push_snapshot`, on whichever thread delivers the push).

Calls are counted per process, over every engine; the recovery's own re-pushes are not counted.
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
from rljax.rollout.client import RolloutClient, RolloutError
from rljax.rollout.engine import RolloutEngine

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


@dataclasses.dataclass(frozen=True)
class KillingSnapshot:
    """A snapshot whose tensors SIGKILL the servers halfway through."""

    inner: object
    servers: list

    def tensors(self):
        return kill_halfway(list(self.inner.tensors()), self.servers)

    def push(self, syncer, version: int) -> dict:
        return syncer.push_weights(self.tensors(), version, self.inner.logprobs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install(plan: FaultPlan) -> None:
    """Wraps `RolloutEngine.generate`/`_push_snapshot` (count calls, arm this thread's next attempt) and
    their one-attempt methods (inject the armed fault) for the rest of this process. A push is counted
    where it is delivered, so a background push arms the thread that makes its attempts."""
    armed = threading.local()
    # the killer of the generate attempt in flight (the client's event-loop thread reads it)
    killing: list[dict] = []
    generate, push = RolloutEngine.generate, RolloutEngine._push_snapshot
    generate_attempt, push_attempt = RolloutEngine._generate_attempt, RolloutEngine._push_attempt
    post = RolloutClient._post

    def counted(method, op):
        def wrapper(self, *args, **kwargs):
            armed.faults = plan.next_call(op)
            return method(self, *args, **kwargs)

        return wrapper

    def faulty_generate_attempt(self, prompts, sampling):
        faults, armed.faults = getattr(armed, "faults", set()), set()
        if "kill_server_mid_generate" not in faults:
            return generate_attempt(self, prompts, sampling)
        done = threading.Event()
        killer = kill_when_running(self.servers, done)
        killing.append(killer)
        try:
            out = generate_attempt(self, prompts, sampling)
        finally:
            killing.remove(killer)
            done.set()
            killer["thread"].join()
            if not killer["killed"]:
                plan.postpone("kill_server_mid_generate")
        if killer["killed"]:  # its last request may have been answered just before the kill landed
            raise RolloutError("test faults: the server was killed during this generate call")
        return out

    def faulty_push_attempt(self, snapshot, version):
        faults, armed.faults = getattr(armed, "faults", set()), set()
        if "kill_server_mid_sync" in faults:
            snapshot = KillingSnapshot(snapshot, self.servers)
        return push_attempt(self, snapshot, version)

    async def post_then_kill(session, url, body):
        data = await post(session, url, body)
        for killer in list(killing):
            killer["kill"]("its first answer came back")
        return data

    RolloutClient._post = staticmethod(post_then_kill)
    RolloutEngine.generate = counted(generate, "generate")
    RolloutEngine._push_snapshot = counted(push, "push")
    RolloutEngine._generate_attempt = faulty_generate_attempt
    RolloutEngine._push_attempt = faulty_push_attempt
