"""Reward workers: an allow-listed environment (no tokens or keys) and temp dirs under one locked
per-run dir that the next pool sweeps when its owner is gone (a SIGKILLed trainer leaks nothing)."""

import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from rljax.rewards import RewardPool
from rljax.rewards._workdirs import worker_env

SECRETS = {
    "HF_TOKEN": "hf_secret",
    "AWS_SECRET_ACCESS_KEY": "aws_secret",
    "WANDB_API_KEY": "wandb_secret",
    "RLJAX_SYNC_TOKEN": "rljax_secret",
    "SOME_UNLISTED_VAR": "x",
}


def env_names_present(*, prompt, completion, example, **options):
    """How many of example["names"] the worker's environment has."""
    return float(sum(name in os.environ for name in example["names"]))


def dumpable(*, prompt, completion, example, **options):
    """The worker's PR_GET_DUMPABLE (0: no ptrace or /proc/<pid>/mem for other processes of its uid)."""
    import ctypes

    return float(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))


def test_workers_get_an_allow_listed_environment(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RLJAX_TEST_SETTING", "1")
    items = [
        {"prompt": "", "completion": "", "example": {"names": list(SECRETS)}},
        {"prompt": "", "completion": "", "example": {"names": ["PYTHONPATH", "PATH", "RLJAX_TEST_SETTING"]}},
    ]
    with RewardPool([(env_names_present, 1.0, {})], num_workers=1, timeout_s=20.0) as pool:
        rewards, _, metrics = pool.score(items)
    np.testing.assert_array_equal(rewards, np.float32([0, 3]))
    assert metrics["reward_fn/errors"] == 0
    env = worker_env(dict(SECRETS, PATH="/bin", LC_ALL="C"), "/tmp/x")
    assert env == {"PATH": "/bin", "LC_ALL": "C", "TMPDIR": "/tmp/x"}


def test_workers_are_not_dumpable():
    item = {"prompt": "", "completion": "", "example": {}}
    with RewardPool([(dumpable, 1.0, {})], num_workers=1, timeout_s=20.0) as pool:
        rewards, _, metrics = pool.score([item])
    assert rewards[0] == 0.0 and metrics["reward_fn/errors"] == 0
    assert dumpable(prompt="", completion="", example={}) == 1.0  # this test process is


POOL_OWNER = """
import sys, time
from rljax.rewards import RewardPool
pool = RewardPool([("format", 1.0, {})], num_workers=1)
assert pool.wait_ready()
print(pool._run_dir.path, [w.tmpdir for w in pool._workers], flush=True)
time.sleep(120)
"""


def start_pool_owner() -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    proc = subprocess.Popen([sys.executable, "-c", POOL_OWNER], stdout=subprocess.PIPE, text=True)
    run_dir, worker_dirs = proc.stdout.readline().split(" ", 1)
    worker_dir = pathlib.Path(eval(worker_dirs)[0])
    return proc, pathlib.Path(run_dir), worker_dir


def test_a_killed_trainers_worker_dirs_are_swept_by_the_next_pool_not_a_live_ones():
    killed, killed_dir, killed_worker_dir = start_pool_owner()
    alive, alive_dir, _ = start_pool_owner()
    try:
        assert killed_worker_dir.parent == killed_dir and killed_dir.name.startswith("run-")
        killed.kill()  # SIGKILL: the pool cannot clean up; its workers exit as orphans
        killed.wait()
        assert killed_dir.exists()
        start = time.monotonic()
        with RewardPool([("format", 1.0, {})], num_workers=1) as pool:
            swept_s = time.monotonic() - start
            assert not killed_dir.exists() and alive_dir.exists() and pool._run_dir.path.exists()
            own = pool._run_dir.path
        assert not own.exists()  # close() removes its own
        assert swept_s < 30.0
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait()
