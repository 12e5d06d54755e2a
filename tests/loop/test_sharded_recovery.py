"""Recovery of a sharded (multi-process) push without collectives: the kept files and canary answers
(pure parts; the 2-process re-push with real vLLM is tests/weight_sync/test_weight_sync_multiprocess.py)."""

import numpy as np
import pytest

from rljax.loop import sharded_sync
from rljax.loop.snapshots import CanaryAnswers, StagedSnapshot, question_key
from rljax.weight_sync import WeightSyncError
from rljax.weight_sync.staging import StagedBuckets


class _Bucket:
    def __init__(self, name):
        self.name, self.unlinked = name, False

    def unlink(self):
        self.unlinked = True


def test_answers_score_once_and_their_frozen_copy_answers_only_what_the_push_asked():
    calls = []

    def scorer(prompt, completion):
        calls.append((list(prompt), list(completion)))
        return np.asarray([float(sum(prompt) + sum(completion))])

    memo = CanaryAnswers({question_key([9], [9]): lambda: np.asarray([18.0])}, scorer)
    assert memo([1, 2], [3])[0] == 6.0 and memo((1, 2), (3,))[0] == 6.0  # lists and tuples: one key
    assert calls == [([1, 2], [3])]
    staged = StagedBuckets(["bucket"], (1,), wait_sent=lambda copies, timeout_s: True)
    kept = StagedSnapshot(staged=staged, logprobs=memo, metrics={}).keep()
    assert kept.staged.buckets == ["bucket"] and kept.staged.wait_sent is None
    assert kept.logprobs([1, 2], [3])[0] == 6.0 and kept.logprobs([9], [9])[0] == 18.0  # pending: waited
    with pytest.raises(WeightSyncError, match="did not see"):
        kept.logprobs([1, 2], [4])  # a different greedy answer: the re-push cannot be verified
    assert len(calls) == 1  # the frozen copy never calls the (collective) scorer


def test_retire_keeps_the_last_pushed_buckets_until_the_next_push_succeeds():
    state = sharded_sync.PushState()
    first = [_Bucket("a"), _Bucket("b")]
    state.retire(first, keep=True)
    assert not any(b.unlinked for b in first) and state.kept == first
    failed = [_Bucket("c")]
    state.retire(failed, keep=False)  # a failed push: its files go, the kept ones stay
    assert failed[0].unlinked and state.kept == first and not first[0].unlinked
    second = [_Bucket("d")]
    state.retire(second, keep=True)
    assert all(b.unlinked for b in first) and state.kept == second and not second[0].unlinked
    state.release()  # the run is over
    assert second[0].unlinked and state.kept == []
    assert [state.next_key(), state.next_key()] == ["rljax/ws/1", "rljax/ws/2"]  # a fresh prefix per push


class _KeyValue:
    """The key-value store calls `_SentWait` makes (a dict; a missing key times out)."""

    def __init__(self):
        self.d = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.d
        self.d[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.d:
            raise TimeoutError(key)
        return self.d[key]

    def key_value_delete(self, key):
        self.d.pop(key, None)


class _Served:
    def wait_sent(self, copies, timeout_s):
        return True


def test_the_leader_waits_for_every_process_once_per_push(monkeypatch):
    kv = _KeyValue()
    monkeypatch.setattr(sharded_sync, "kv_client", lambda: kv)
    monkeypatch.setattr(sharded_sync.jax, "process_count", lambda: 3)
    kv.d.update({"rljax/ws/5/sent/1": "1", "rljax/ws/5/sent/2": "1"})
    wait = sharded_sync._SentWait("rljax/ws/5", _Served())
    assert wait(2, 1.0) and kv.d["rljax/ws/5/copies"] == "2"  # two rollout hosts: two copies each
    assert not any("/sent/" in k for k in kv.d)  # the reports were read
    # a recovery re-pushes the same snapshot: nobody reports again, so it must not wait (30 s here)
    assert wait(2, 30.0) is False
    kv.d["rljax/ws/4/copies"] = "1"
    wait.release()  # keeps this push's count, removes the previous push's
    assert kv.d["rljax/ws/5/copies"] == "2" and "rljax/ws/4/copies" not in kv.d

    kv.d.update({"rljax/ws/6/sent/1": "1", "rljax/ws/6/sent/2": "0"})  # process 2's transfer failed
    assert sharded_sync._SentWait("rljax/ws/6", None)(1, 1.0) is False
    unasked = sharded_sync._SentWait("rljax/ws/7", _Served())
    unasked.release()  # the push failed before the load: the followers' threads are told to stop
    assert kv.d["rljax/ws/7/copies"] == "0"
