"""rljax.launch: N local JAX processes as one job, kill-on-bad-exit, signal forwarding, config helpers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rljax import config as config_lib
from rljax import launch, runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launcher(*args: str, **env: str) -> subprocess.Popen:
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", RLJAX_PLATFORM="cpu", **env)
    return subprocess.Popen(
        [sys.executable, "-m", "rljax.launch", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_process_envs_cpu_and_gpu():
    cpu = launch.process_envs(2, 4, 1234, {"RLJAX_PLATFORM": "cpu", "SLURM_STEP_ID": "0"})
    assert [e["RLJAX_PROCESS_ID"] for e in cpu] == ["0", "1"]
    assert all(e["RLJAX_COORDINATOR"] == "127.0.0.1:1234" and e["RLJAX_NUM_PROCESSES"] == "2" for e in cpu)
    assert all(e["RLJAX_CPU_DEVICES"] == "4" and "SLURM_STEP_ID" not in e for e in cpu)
    gpu = launch.process_envs(2, 2, 1, {"RLJAX_PLATFORM": "gpu"})
    assert [e["RLJAX_LOCAL_DEVICE_IDS"] for e in gpu] == ["0,1", "2,3"]


def test_two_processes_join_one_jax_job(tmp_path):
    workdir = tmp_path / "run"
    proc = launcher(
        "--num-processes",
        "2",
        "--devices-per-process",
        "2",
        "--entry",
        "launch/selftest.py",
        "--",
        "--config=configs/grpo.py:smoke",
        f"--workdir={workdir}",
        RLJAX_SELFTEST_STEP_S="0",
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "[rank 0] rljax: process 0 of 2, 2 local devices" in out
    assert "[rank 1] rljax: process 1 of 2, 2 local devices" in out
    rows = [json.loads(line) for line in open(workdir / "selftest_metrics.jsonl")]
    assert [r["sum"] for r in rows] == [6.0, 6.0, 6.0]  # (1 + 2) per process x 2 devices, all 3 steps
    assert "rljax: process 1 of 2" in open(workdir / "logs" / "rank-1.log").read()


STUB = """
import os, signal, sys, time
rank = int(os.environ["RLJAX_PROCESS_ID"])
out = sys.argv[1]
def on_signal(signum, frame):
    open(os.path.join(out, f"signal-{rank}"), "w").write(signal.Signals(signum).name)
    sys.exit(143)
signal.signal(signal.SIGUSR1, on_signal)
open(os.path.join(out, f"started-{rank}"), "w").close()
if rank == 1 and os.environ.get("STUB_FAIL"):
    sys.exit(3)
time.sleep(60)
"""


def wait_files(paths, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, paths
        time.sleep(0.05)


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "stub.py"
    path.write_text(STUB)
    return str(path)


def test_first_failure_ends_the_others(stub, tmp_path):
    proc = launcher("--num-processes", "2", "--entry", stub, "--", str(tmp_path), STUB_FAIL="1")
    out, _ = proc.communicate(timeout=60)  # rank 0 would sleep 60 s if it were not terminated
    assert proc.returncode == 3, out


def test_signal_is_forwarded_and_143_returned(stub, tmp_path):
    proc = launcher("--num-processes", "2", "--entry", stub, "--", str(tmp_path))
    wait_files([tmp_path / "started-0", tmp_path / "started-1"])
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert [open(tmp_path / f"signal-{r}").read() for r in range(2)] == ["SIGUSR1", "SIGUSR1"]


def test_print_config_resolves_preset_and_overrides():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljax.launch",
            "--print-config",
            "trainer.steps",
            "model.path",
            "--",
            "--config=configs/grpo.py:smoke",
            "--config.model.path=/models/x",
            "--workdir=/tmp/unused",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "/models/x"]  # smoke preset: 3 steps


def test_config_from_args_reads_the_file_then_each_override():
    """The one argv -> Config parser (`rljax.runtime.config_from_args`, behind main, launch and preflight)."""
    args = [
        "--config=configs/grpo.py:smoke",
        "--config.algo.beta=0.05",
        "--config.rollout.vllm.urls",
        "('http://a:1', 'http://b:2')",
        "-config.model.remat=full",
        "--workdir=/tmp/unused",
    ]
    cfg = launch.config_from_args(args)
    assert cfg.trainer.steps == 3  # the smoke preset
    assert cfg.rollout.vllm.urls == ("http://a:1", "http://b:2") and cfg.algo.beta == 0.05
    assert cfg.model.remat == "full"
    assert runtime.split_config_args(args)[2] == ["--workdir=/tmp/unused"]
    with pytest.raises(config_lib.ConfigError, match="override needs a value"):
        runtime.split_config_args(["--config=configs/grpo.py", "--config.algo.beta", "--workdir=x"])


def test_backends_take_their_own_flags_and_unknown_ones_are_one_line(capsys):
    """--backend picks the launcher; its flags and the rljax.main args go through to it unchanged."""
    assert launch.main(["--backend=nope", "--", "--config=configs/grpo.py"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rljax: error: --backend: must be one of local, k8s, k8s-local, ray, got 'nope'"
    )
    assert launch.main(["--backend", "k8s", "--num-processes", "0", "--", "--workdir=/runs/x"]) == 2
    assert capsys.readouterr().err.startswith("rljax: error: --num-processes")
    assert launch.main(["--backend=ray", "--num-processes", "0", "--", "--workdir=/runs/x"]) == 2
    assert capsys.readouterr().err.startswith("rljax: error: --num-processes")
