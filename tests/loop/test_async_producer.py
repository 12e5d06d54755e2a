"""Control flow of the async rollout producer (a fake produce function; the real one is in the loop tests)."""

import threading
import time

import pytest

from rljax.loop.async_rollout import AsyncProducer, group_from_json, group_to_json
from rljax.trajectory import Group, Trajectory


class Recorder:
    def __init__(self):
        self.version = 0
        self.calls = []
        self.lock = threading.Lock()

    def produce(self, step):
        with self.lock:
            self.calls.append((step, self.version))
        time.sleep(0.01)
        traj = Trajectory([1, 2], [3], [-0.5], reward=1.0, group_id=0, policy_version=self.version)
        return [Group({"prompt": str(step)}, [traj], {})], {"rollout/generated_tokens": 1.0}


@pytest.mark.parametrize("k", [1, 2])
def test_no_batch_is_staler_than_max_staleness(k):
    rec = Recorder()
    producer = AsyncProducer(rec.produce, start_step=0, max_staleness=k, version=0, data_state=dict).start()
    for step in range(8):
        groups, _ = producer.take(step)
        version = groups[0].trajectories[0].policy_version
        assert 0 <= step - version <= k, (step, version)
        time.sleep(0.02)  # the "update": the producer runs ahead meanwhile
        rec.version = step + 1
        producer.set_version(step + 1)
    producer.close()
    assert [s for s, _ in rec.calls][:8] == list(range(8))
    # With k >= 1 the producer really overlaps: some batch was generated before its step's weights existed.
    assert any(step - version >= 1 for step, version in rec.calls)


class SlowToStart(Recorder):
    """A producer thread that starts each batch late (a busy host): without the trainer waiting for it,
    the next push would land first and the batch would come from a fresher policy."""

    def produce(self, step):
        time.sleep(0.05)
        return super().produce(step)


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_comes_from_policy_step_minus_k_whatever_the_timing(k):
    rec = SlowToStart()
    producer = AsyncProducer(rec.produce, start_step=0, max_staleness=k, version=0, data_state=dict).start()
    for step in range(6):
        producer.take(step)
        producer.await_generator_of(step + 1)  # the trainer, before serving the update's weights
        rec.version = step + 1
        producer.set_version(step + 1)
    producer.close()
    assert rec.calls[:6] == [(j, max(0, j - k)) for j in range(6)]


def test_snapshot_restores_the_buffer_exactly():
    rec = Recorder()
    producer = AsyncProducer(
        rec.produce, start_step=0, max_staleness=1, version=0, data_state=lambda: {"index": len(rec.calls)}
    ).start()
    producer.take(0)
    time.sleep(0.1)
    snap = producer.snapshot()
    producer.close()
    assert snap["next_step"] == 2 and [b["step"] for b in snap["buffer"]] == [1]
    assert snap["data"] == {"index": 2}
    fresh = AsyncProducer(rec.produce, start_step=1, max_staleness=1, version=1, data_state=dict)
    fresh.restore(snap)
    groups, metrics = fresh.take(1)  # served from the restored buffer, not regenerated
    assert groups[0].example == {"prompt": "1"} and metrics == {"rollout/generated_tokens": 1.0}
    assert len(rec.calls) == 2


def test_producer_failure_surfaces_in_take():
    def boom(step):
        raise ValueError("server died")

    producer = AsyncProducer(boom, start_step=0, max_staleness=1, version=0, data_state=dict).start()
    with pytest.raises(RuntimeError, match="server died"):
        producer.take(0)
    producer.close()


def test_group_json_round_trip():
    import numpy as np

    g = Group(
        {"prompt": "p", "answer": "1"},
        [Trajectory([1], [2, 3], [-0.1, -0.2], 0.5, 3, 7, True, [1, 0])],
        {"math": np.asarray([0.5], np.float32)},
    )
    back = group_from_json(group_to_json(g))
    assert back.example == g.example and back.trajectories == g.trajectories
    assert back.per_fn["math"].tolist() == [0.5]
