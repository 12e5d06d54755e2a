"""`rljax.rollout.background.BackgroundPush` (async mode's push, `RolloutEngine.start_push`): what runs on
the trainer's thread, what runs behind it, and how failures and metrics come back. The real push behind it
is the engine's (tests/loop/test_loop_grpo.py's async run goes through it against a real vLLM server)."""

import threading

import numpy as np
import pytest

from rljax.rollout.background import BackgroundPush

QUESTION = ([1, 2, 3], [4, 5])


class Snapshot:
    """Records which thread answered the canary question and made the host copy (both in `keep`, as the
    loop's snapshots do: `rljax.loop.snapshots`)."""

    def __init__(self, params: np.ndarray, log: list):
        self.params, self.log = params, log

    def logprobs(self, prompt_ids, completion_ids):
        self.log.append(
            ("logprobs", threading.current_thread().name, (list(prompt_ids), list(completion_ids)))
        )
        return np.zeros(len(completion_ids), np.float32)

    def keep(self):
        self.logprobs(*QUESTION)  # the canary's trainer side, waited for
        self.log.append(("keep", threading.current_thread().name))
        return Snapshot(self.params.copy(), self.log)


class Push:
    """`BackgroundPush` started from params, as the loop does: a snapshot of them, then `start`."""

    def __init__(self, deliver, log):
        self.push, self.log = BackgroundPush(deliver), log

    def start(self, params, version, on_served=None):
        self.push.start(Snapshot(params, self.log), version, on_served)

    def __getattr__(self, name):
        return getattr(self.push, name)


def make(deliver, log):
    return Push(deliver, log)


def test_trainer_side_runs_on_the_callers_thread_and_the_delivery_behind_it():
    log, release, delivered, served = [], threading.Event(), [], []

    def deliver(snapshot, version):
        assert release.wait(30)
        delivered.append((version, snapshot.params.copy(), threading.current_thread().name))
        return {
            "weight_sync/seconds": 1.0 + version,
            "weight_sync/canary_logprob_max_abs_diff": 0.1 * version,
        }

    push = make(deliver, log)
    params = np.arange(4.0)
    push.start(params, 1, on_served=served.append)
    me = threading.current_thread().name
    assert log == [("logprobs", me, QUESTION), ("keep", me)]  # both before start returned
    params[:] = -1.0  # the next update donates (here: overwrites) the trainer's arrays
    assert delivered == [] and served == []  # start did not wait for the delivery
    release.set()
    push.wait()
    ((version, sent, thread),) = delivered
    assert version == 1 and thread != me and thread.startswith("rljax-push")
    np.testing.assert_array_equal(sent, np.arange(4.0))  # the host copy, not the overwritten arrays
    assert served == [1]
    push.start(np.ones(4), 2, on_served=served.append)
    push.start(np.ones(4), 3, on_served=served.append)  # waits for push 2 first: one in flight at a time
    assert served == [1, 2]
    push.wait()
    assert served == [1, 2, 3]
    m = push.metrics()  # three deliveries since the last call, combined by each metric's reduction
    assert m["weight_sync/seconds"] == pytest.approx(2.0 + 3.0 + 4.0)  # sum
    assert m["weight_sync/canary_logprob_max_abs_diff"] == pytest.approx(0.3)  # max
    assert push.metrics() == {}
    push.close()


def test_a_failed_delivery_is_raised_by_the_next_start_before_it_hands_anything_off():
    log, served = [], []

    def deliver(snapshot, version):
        if version == 1:
            raise RuntimeError("canary disagreed on push 1")
        return {"weight_sync/seconds": 1.0}

    push = make(deliver, log)
    push.start(np.zeros(2), 1, on_served=served.append)
    n = len(log)
    with pytest.raises(RuntimeError, match="canary disagreed on push 1"):
        push.start(np.zeros(2), 2, on_served=served.append)
    assert len(log) == n and served == []  # push 2 never began; the producer never heard of version 1
    push.start(np.zeros(2), 2, on_served=served.append)  # the failure was reported once
    push.wait()
    assert served == [2]
    push.close()


def test_close_waits_for_the_push_in_flight_and_logs_its_failure(caplog):
    started = threading.Event()

    def deliver(snapshot, version):
        started.set()
        raise RuntimeError("server died during the last push")

    push = make(deliver, [])
    push.start(np.zeros(2), 7)
    assert started.wait(30)
    push.close()  # does not raise: the run is ending
    assert "server died during the last push" in caplog.text
