"""Control flow of rljax.loop.recovery.call_with_recovery (pure: no server)."""

import pytest

from rljax.loop.recovery import RecoveryExhaustedError, call_with_recovery
from rljax.rollout.client import RolloutError
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
