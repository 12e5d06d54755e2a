"""Faults with a real vLLM server: killed mid-sync or mid-generation -> a clear error within 30 s (no hang);
restart + re-push then serves the trainer's weights at the trainer's version."""

import threading
import time

import pytest
from vllm_server import assert_serves_reference, perturbed

from rljax.rollout import RolloutError
from rljax.weight_sync import SyncOptions, WeightSyncError

pytestmark = pytest.mark.vllm


def test_server_killed_mid_sync_fails_fast_then_restart_and_repush_succeeds(served_qwen2):
    engine, version = served_qwen2.engine, served_qwen2.engine.version
    state = perturbed(served_qwen2.ref.state(), seed=31)
    killed_at = []

    post = engine.syncer._post

    def post_killing_the_server(url, path, *args, **kwargs):
        if path == "/update_weights" and not killed_at:  # paused, the load call about to start
            killed_at.append(time.monotonic())  # before: the sync may fail while kill() reaps
            served_qwen2.server.kill()
        return post(url, path, *args, **kwargs)

    engine.syncer._post = post_killing_the_server
    engine.syncer.options = SyncOptions(bucket_bytes=40 * 1024)
    try:
        with pytest.raises(WeightSyncError, match="update_weights|finish_weight_update") as err:
            engine.push_weights(state.items(), version + 1)  # the engine has no restarts
    finally:
        del engine.syncer._post
        engine.syncer.options = SyncOptions()
    assert killed_at, str(err.value)
    assert time.monotonic() - killed_at[0] < 30
    assert engine.urls[0] in str(err.value)
    with pytest.raises(RolloutError):
        engine.generate([[1, 2, 3]], n=1, temperature=0.0, max_tokens=2)
    served_qwen2.ref.load(state)
    assert engine.restart_unhealthy() == [served_qwen2.server]
    metrics = engine.push_weights(state.items(), version + 1)
    assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= 1e-4
    assert_serves_reference(served_qwen2, version + 1)


def test_server_killed_mid_generation_raises_rollout_error_fast(served_qwen2):
    # the last test on the shared server: a later user gets it restarted by the fixture
    engine, errors, done = served_qwen2.engine, [], threading.Event()

    def generate():
        try:
            engine.generate([[i + 1, 2, 3] for i in range(16)], n=4, temperature=1.0, max_tokens=256, seed=0)
        except RolloutError as e:
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=generate)
    t.start()
    time.sleep(1.0)
    assert not done.is_set()  # still generating when the server dies
    served_qwen2.server.kill()
    killed = time.monotonic()
    assert done.wait(30), "generate hung after the server died"
    assert time.monotonic() - killed < 30
    assert errors and "failed after" in str(errors[0])
    t.join()
