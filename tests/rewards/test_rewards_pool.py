"""RewardPool faults: a hang, a crash (os._exit), an exception, NaN/inf and a wrong type each score 0, are
counted, and never stall the call; healthy items in the same batch are scored correctly.

The fault functions live at module level so the worker processes can import them by reference.
Wall-clock bounds are liveness deadlines (a stall would take the full sleep of 3600 s), not performance
thresholds.
"""

import math
import os
import threading
import time

import numpy as np
import pytest

from rljax.rewards import RewardPool

TIMEOUT_S = 1.0
DEADLINE_S = 20.0  # a hang costs TIMEOUT_S plus a worker restart (~0.3 s); generous for a loaded machine


def faulty(*, prompt, completion, example, **options):
    """Behaves as the completion says: hang, crash, raise, nan, inf, str, none, or returns its length."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(7)
    if completion == "raise":
        raise RuntimeError("reward bug")
    if completion in ("nan", "inf"):
        return float(completion)
    if completion == "str":
        return "1.0"
    if completion == "none":
        return None
    return float(len(completion)) * options.get("scale", 1.0)


def item(completion, answer="4"):
    return {"prompt": "2 + 2 =", "completion": completion, "example": {"prompt": "2 + 2 =", "answer": answer}}


@pytest.fixture(scope="module")
def pool():
    specs = [("math", 1.0, {}), (faulty, 0.5, {"scale": 2.0})]
    with RewardPool(specs, num_workers=2, timeout_s=TIMEOUT_S) as p:
        assert p.wait_ready()
        yield p


def score_timed(pool, batch):
    start = time.monotonic()
    out = pool.score(batch)
    return (*out, time.monotonic() - start)


def test_healthy_batch_golden(pool):
    batch = [item(r"\boxed{4}"), item("it is 5"), item("4")]
    rewards, per_fn, metrics, _ = score_timed(pool, batch)
    np.testing.assert_array_equal(per_fn["math"], np.float32([1, 0, 1]))
    np.testing.assert_array_equal(per_fn["test_rewards_pool:faulty"], np.float32([18, 14, 2]))  # 2 * len
    np.testing.assert_allclose(rewards, np.float32([1 + 9, 0 + 7, 1 + 1]))
    assert rewards.dtype == np.float32 and rewards.shape == (3,)
    assert metrics["reward_fn/timeouts"] == 0 and metrics["reward_fn/errors"] == 0
    assert metrics["reward_fn/math/mean"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "fault, metric",
    [
        ("hang", "timeouts"),
        ("crash", "errors"),
        ("raise", "errors"),
        ("nan", "errors"),
        ("inf", "errors"),
        ("str", "errors"),
        ("none", "errors"),
    ],
)
def test_each_fault_scores_zero_is_counted_and_does_not_stall(pool, fault, metric):
    batch = [item("4"), item(fault), item("444")]
    rewards, per_fn, metrics, elapsed = score_timed(pool, batch)
    faulty_scores = per_fn["test_rewards_pool:faulty"]
    assert faulty_scores[1] == 0.0 and np.isfinite(rewards).all()
    np.testing.assert_array_equal(faulty_scores[[0, 2]], np.float32([2, 6]))  # healthy items unaffected
    np.testing.assert_array_equal(per_fn["math"][[0, 2]], np.float32([1, 0]))
    assert metrics[f"reward_fn/{metric}"] == 1
    assert metrics[f"reward_fn/test_rewards_pool:faulty/{metric}"] == 1
    assert metrics["reward_fn/math/timeouts"] == 0 and metrics["reward_fn/math/errors"] == 0
    assert elapsed < DEADLINE_S
    if fault in ("hang", "crash"):  # the worker was replaced, and the pool still works afterwards
        assert metrics["reward_fn/worker_restarts"] >= 1
    again, _, metrics_after, _ = score_timed(pool, [item("4")])
    assert again[0] == 1.0 + 0.5 * 2.0 and metrics_after["reward_fn/errors"] == 0


def test_many_hangs_are_bounded_by_the_total_timeout():
    specs = [("test_rewards_pool:faulty", 1.0, {})]
    with RewardPool(specs, num_workers=2, timeout_s=30.0, total_timeout_s=2.0) as p:
        p.score([item("ok")])  # workers started and ready
        rewards, _, metrics, elapsed = score_timed(p, [item("hang")] * 6 + [item("ok")])
    assert elapsed < DEADLINE_S  # without the total bound this would take 30 s per pair of hangs
    assert metrics["reward_fn/timeouts"] >= 6 and rewards[:6].sum() == 0.0


def test_inline_mode_counts_errors_without_processes():
    with RewardPool([("math", 1.0), (faulty, 1.0)], num_workers=0) as p:
        rewards, per_fn, metrics = p.score([item("4"), item("nan"), item("raise")])
    np.testing.assert_array_equal(per_fn["test_rewards_pool:faulty"], np.float32([1, 0, 0]))
    np.testing.assert_array_equal(rewards, np.float32([2, 0, 0]))
    assert metrics["reward_fn/errors"] == 2 and not math.isnan(metrics["reward_fn/time_s"])


def test_duplicate_names_get_distinct_keys_and_bad_specs_fail_early():
    with RewardPool([("format", 1.0, {}), ("format", 2.0, {"kind": "hash"})], num_workers=0) as p:
        rewards, per_fn, _ = p.score([item("#### 4"), item(r"\boxed{4}")])
    np.testing.assert_array_equal(per_fn["format"], np.float32([0, 1]))
    np.testing.assert_array_equal(per_fn["format#2"], np.float32([1, 0]))
    np.testing.assert_array_equal(rewards, np.float32([2, 1]))
    with pytest.raises(ValueError, match="no_such_pkg.mod:fn"):
        RewardPool([("no_such_pkg.mod:fn", 1.0, {})], num_workers=1)
    with pytest.raises(KeyError, match="valid names"):
        RewardPool([("maths", 1.0, {})], num_workers=1)


def sandboxed_sleeper(*, prompt, completion, example, **options):
    """Starts a sandboxed child that sleeps far past the pool's timeout (tagged so the test can find it)."""
    from rljax.rewards.sandbox import run_python

    run_python("import time\ntime.sleep(120)", timeout_s=60.0, env={"POOL_TAG": completion})
    return 1.0


def test_killing_a_hung_worker_also_kills_its_sandbox_children():
    from test_sandbox import processes_tagged, wait_until_gone

    tag = f"tag{os.getpid()}x{time.monotonic_ns()}"
    seen = []
    watcher = threading.Thread(
        target=lambda: [seen.append(processes_tagged(tag)) or time.sleep(0.1) for _ in range(30)]
    )
    # A 3 s timeout leaves the worker time to start its sandbox; the watcher proves the child existed.
    with RewardPool([(sandboxed_sleeper, 1.0, {})], num_workers=1, timeout_s=3.0) as p:
        watcher.start()
        rewards, _, metrics, elapsed = score_timed(p, [item(tag)])
        workers = [w.proc for w in p._workers]
    watcher.join()
    assert max(seen) >= 1, "the sandboxed child never started"
    assert metrics["reward_fn/timeouts"] == 1 and rewards[0] == 0.0 and elapsed < DEADLINE_S
    assert wait_until_gone(tag) == 0, f"{processes_tagged(tag)} sandbox processes survived their worker"
    assert all(proc.poll() is not None for proc in workers)  # close() stopped the workers


def test_builtin_rewards_declare_ranges_and_failures_score_the_minimum():
    from rljax.rewards import REWARDS
    from rljax.rewards.base import reward_range

    assert reward_range(REWARDS.get("code"), {}) == (0.0, 1.0)
    assert reward_range(REWARDS.get("math"), {"incorrect": -1.0}) == (-1.0, 1.0)
    assert reward_range(REWARDS.get("overlong"), {"max_length": 8, "buffer": 4}) == (-1.0, 0.0)
    assert reward_range(REWARDS.get("length_penalty"), {"max_penalty": 0.5}) == (-0.5, 0.0)
    # A failing penalty call must not score its best value (0): it scores the range minimum.
    bad = {"prompt": "", "completion": "x", "example": {}}  # no token count: overlong raises
    with RewardPool([("overlong", 1.0, {"max_length": 8, "buffer": 4})], num_workers=0) as p:
        rewards, _, metrics = p.score([bad])
    assert rewards[0] == -1.0 and metrics["reward_fn/errors"] == 1


def test_configured_reward_options_reach_the_functions_they_name():
    from rljax.config import RewardConfig

    rw = RewardConfig(
        functions=("math", "length_penalty"),
        weights=(1.0, 1.0),
        eval_function="math",
        options=(("math", (("extract", "hash"),)), ("length_penalty", (("unit", "words"), ("coef", 0.5)))),
    )
    assert rw.eval_spec() == ("math", 1.0, {"extract": "hash"})
    example = {"answer": "7"}
    batch = [
        {"prompt": "q", "completion": "so it is 7", "example": example},  # no "#### 7": hash extracts nothing
        {"prompt": "q", "completion": "#### 7", "example": example},
    ]
    with RewardPool(rw.specs(), num_workers=0) as p:
        rewards, per_fn, _ = p.score(batch)
    np.testing.assert_allclose(per_fn["math"], [0.0, 1.0])
    np.testing.assert_allclose(per_fn["length_penalty"], [-2.0, -1.0])  # 0.5 a word past target 0
    np.testing.assert_allclose(rewards, [-2.0, 0.0])
