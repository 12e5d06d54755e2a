"""Faults with a real vLLM server: killed mid-sync or mid-generation -> a clear error within 30 s (no hang);
restart + re-push then serves the trainer's weights at the trainer's version. An async-mode push killed on
its background thread while a rollout runs recovers both, with no prompt lost."""

import re
import threading
import time

import pytest
import requests
from faults import KillingSnapshot
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
            engine.push_weights(served_qwen2.weights.snapshot(state.items()), version + 1)  # no restarts
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
    metrics = engine.push_weights(served_qwen2.weights.snapshot(state.items()), version + 1)
    assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= 1e-4
    assert_serves_reference(served_qwen2, version + 1)


def test_server_killed_during_a_background_push_recovers_the_push_and_the_rollout(
    served_qwen2, monkeypatch, caplog
):
    """Async mode's push (`start_push`) with restarts on: the server dies halfway through the push's
    tensors, on the push's own thread; the push thread restarts it and re-pushes. A rollout that comes in
    meanwhile (the async producer's) fails, waits for that recovery and is resubmitted: all of it sampled
    from the new version. While the restarted server serves only its checkpoint (after the restart, before
    the re-push), generation is refused rather than labelled with the previous version."""
    engine, version = served_qwen2.engine, served_qwen2.engine.version
    monkeypatch.setattr(engine.recovery, "max_restarts", 1)
    state = perturbed(served_qwen2.ref.state(), seed=37)
    reset, window = engine.syncer.reset, {}
    snapshot = KillingSnapshot(served_qwen2.weights.snapshot(state.items()), engine.servers)

    def reset_then_generate():  # the end of restart_unhealthy: the server is up, serving its checkpoint
        reset()
        try:
            window["out"] = engine.client.generate([[1, 2, 3]], n=1, temperature=0.0, max_tokens=2)
        except RolloutError as e:
            window["error"] = str(e)

    monkeypatch.setattr(engine.syncer, "reset", reset_then_generate)
    served_qwen2.ref.load(state)
    served, t0 = [], time.monotonic()
    engine.start_push(snapshot, version + 1, on_served=served.append)
    assert snapshot.ended.wait(60)
    prompts = [[i + 1, 2, 3] for i in range(8)]
    out = engine.generate(prompts, n=2, temperature=1.0, max_tokens=16, seed=0)  # during the recovery
    engine.wait_pushed()
    assert time.monotonic() - t0 < 240
    threads = snapshot.attempts
    assert len(threads) == 2 and all(name.startswith("rljax-push") for name in threads), threads
    assert served == [version + 1]
    metrics = engine.pushed_metrics()
    assert metrics["recovery/restarts"] == 1.0 and metrics["recovery/failed_restarts"] == 0.0
    assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= 1e-4
    assert "rollout generate failed" in caplog.text  # the rollout did meet the recovery
    assert len(out) == len(prompts) * 2  # nothing lost: every prompt's completions came back
    assert {c.policy_version for c in out} == {version + 1}  # resubmitted after the re-push
    assert "not servable: restarting" in window.get("error", ""), window
    assert_serves_reference(served_qwen2, version + 1)


def wait_for_running_requests(served, timeout_s: float = 30.0) -> None:
    headers, t0 = served.engine.syncer.headers, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        text = requests.get(served.server.url + "/metrics", headers=headers, timeout=5).text
        if any(
            float(v) > 0 for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        ):
            return
        time.sleep(0.01)
    raise AssertionError("the rollout never reached the server")


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
