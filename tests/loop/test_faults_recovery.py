"""Control flow of rljax.rollout.recovery (call_with_recovery), the test-only FaultPlan
(tests/support/faults.py) and RolloutEngine's recovery lock (pure: no server; the real faults are in
tests/loop/test_faults_loop.py)."""

import threading
from types import SimpleNamespace

import pytest
from faults import FaultPlan

from rljax.rollout import RolloutEngine
from rljax.rollout.client import RolloutError
from rljax.rollout.recovery import RecoveryExhaustedError, call_with_recovery
from rljax.rollout.server import ServerError
from rljax.weight_sync.gate import PolicyGate
from rljax.weight_sync.syncer import WeightSyncError


def _flaky(failures: list[BaseException], result):
    calls = []

    def op():
        calls.append(len(calls))
        if failures:
            raise failures.pop(0)
        return result

    return op, calls


def test_recovers_and_resubmits():
    op, calls = _flaky([RolloutError("dead"), WeightSyncError("mid-sync")], "ok")
    recovered, stats = [], {}
    out = call_with_recovery(op, lambda: recovered.append(1), max_restarts=3, what="rollout", stats=stats)
    assert out == "ok"
    assert len(calls) == 3 and len(recovered) == 2
    assert stats["recovery/restarts"] == 2.0 and stats["recovery/seconds"] >= 0.0


def test_exhausted_gives_clear_error():
    op, calls = _flaky([RolloutError(f"dead {i}") for i in range(10)], "ok")
    with pytest.raises(RecoveryExhaustedError, match=r"after 2 restart\(s\).*max_restarts=2.*dead 2"):
        call_with_recovery(op, lambda: None, max_restarts=2, what="rollout")
    assert len(calls) == 3


def test_failed_restart_counts_and_other_errors_propagate():
    def bad_recover():
        raise RolloutError("restart failed")

    op, calls = _flaky([RolloutError("dead")], "ok")
    with pytest.raises(RecoveryExhaustedError, match="restart failed"):
        call_with_recovery(op, bad_recover, max_restarts=2, what="sync")
    assert len(calls) == 1
    op, _ = _flaky([ValueError("bug")], "ok")
    with pytest.raises(ValueError, match="bug"):
        call_with_recovery(op, lambda: None, max_restarts=5, what="rollout")


def test_skipped_recovery_is_not_a_restart_and_failed_restarts_are_counted():
    op, calls = _flaky([RolloutError("dead")], "ok")
    stats = {}
    assert call_with_recovery(op, lambda: False, max_restarts=1, what="rollout", stats=stats) == "ok"
    assert len(calls) == 2 and stats.get("recovery/restarts", 0.0) == 0.0
    outcomes = [ServerError("start-up failed"), None]

    def recover():
        if outcomes.pop(0) is not None:
            raise ServerError("start-up failed")

    op, calls = _flaky([RolloutError("dead")], "ok")
    stats = {}
    assert call_with_recovery(op, recover, max_restarts=3, what="rollout", stats=stats) == "ok"
    assert stats["recovery/restarts"] == 2.0 and stats["recovery/failed_restarts"] == 1.0


def test_fault_plan_parses_counts_calls_and_postpones():
    spec = "kill_server_mid_generate:2, kill_server_mid_sync:1,kill_server_mid_generate:4"
    plan = FaultPlan.parse(spec)
    assert plan.next_call("generate") == set()
    assert plan.next_call("generate") == {"kill_server_mid_generate"}
    assert plan.next_call("push") == {"kill_server_mid_sync"}
    plan.postpone("kill_server_mid_generate")
    assert plan.next_call("generate") == {"kill_server_mid_generate"}
    assert plan.next_call("generate") == {"kill_server_mid_generate"} and plan.next_call("generate") == set()
    assert FaultPlan.parse("").next_call("generate") == set()
    for bad in ("kill_server:1", "kill_server_mid_sync", "kill_server_mid_sync:0"):
        with pytest.raises(ValueError, match="bad item"):
            FaultPlan.parse(bad)


class _FakeServer:
    url = "http://fake"

    def __init__(self):
        self.alive, self.restarts, self.gate_while_restarting = False, 0, []

    def healthy(self):
        return self.alive

    def stop(self):
        self.alive = False

    def spawn(self):
        self.restarts += 1
        self.alive = True
        self.gate_while_restarting.append(self.gate.broken)  # set by the test

    def wait_healthy(self, timeout_s):
        assert self.alive

    def crash_cause(self):
        return None  # killed, not crashed: no traceback in its log

    options = SimpleNamespace(startup_timeout_s=1.0)


class _FakeClient:
    """Two generate calls in flight together on a dead server (both fail), then it serves."""

    def __init__(self, server):
        self.server, self.urls, self.gate = server, ["http://fake"], PolicyGate()
        self.both_in_flight = threading.Barrier(2, timeout=10)
        server.gate = self.gate

    def generate(self, prompts, **sampling):
        if self.gate.broken:
            raise RolloutError(f"servers are not servable: {self.gate.broken}")
        if not self.server.alive:
            self.both_in_flight.wait()
            raise RolloutError("connection refused")
        return [f"completion of {p}" for p in prompts]


def test_engine_one_recovery_for_concurrent_failures_and_resubmits_both():
    server = _FakeServer()
    syncer = SimpleNamespace(reset=lambda: None)
    engine = RolloutEngine(_FakeClient(server), syncer, servers=[server], max_restarts=1)
    results, errors = {}, []

    def call(name):
        try:
            results[name] = engine.generate([name, name + "2"], n=1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert results == {n: [f"completion of {n}", f"completion of {n}2"] for n in ("a", "b")}
    assert server.restarts == 1  # the second failure saw the first one's recovery: no restart
    # generation was refused while the restarted server served only its checkpoint; open again after
    assert server.gate_while_restarting == ["restarting http://fake; serving again after the re-push"]
    assert engine.gate.broken is None
    stats = engine.recovery.drain()
    assert stats["recovery/restarts"] == 1.0 and stats["recovery/resubmitted"] == 4.0
    assert engine.recovery.drain()["recovery/restarts"] == 0.0  # drained per push


def test_without_restarts_the_error_is_raised_as_it_is():
    server = _FakeServer()
    engine = RolloutEngine(_FakeClient(server), SimpleNamespace(reset=lambda: None), servers=[server])
    engine.client.both_in_flight = threading.Barrier(1)
    with pytest.raises(RolloutError, match="connection refused"):
        engine.generate(["a"], n=1)
    assert server.restarts == 0
