"""launch/gpu_slurm.sh on a real single-node Slurm cluster (slurmctld + slurmd on localhost).

One cluster serves the whole test run (`slurm_cluster`, tests/support/slurm_cluster.py) and is torn down by
PID at the end, also on failure. The job runs
2 tasks with RLJAX_PLATFORM=cpu, one simulated CPU device each. The self-test entry (launch/selftest.py)
checks the launch path itself: both ranks join one JAX job, preflight runs on all tasks, a USR1 to the
batch script makes the job save, requeue and resume. The `rljax.main` tests run the real training loop
on the smoke config.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from jax_env import xla_flags
from slurm_cluster import SlurmCluster, slurm_installed

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not slurm_installed(),
        reason="slurmctld/slurmd not installed (apt-get install slurmctld slurmd slurm-client)",
    ),
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "gpu_slurm.sh")


@pytest.fixture
def cluster(slurm_cluster) -> SlurmCluster:
    return slurm_cluster


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    code = (
        f"from rljax.models.tiny import build_tiny_checkpoint; build_tiny_checkpoint({str(path)!r}, 'qwen2')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, timeout=300)
    return str(path)


def submit(cluster: SlurmCluster, workdir, args: list[str], **env: str) -> str:
    """sbatch --ntasks=2 launch/gpu_slurm.sh -- args; returns the job id."""
    os.makedirs(workdir, exist_ok=True)  # sbatch's --output file goes there
    job_env = {
        "RLJAX_PLATFORM": "cpu",
        "RLJAX_CPU_DEVICES": "1",
        "RLJAX_PYTHON": sys.executable,
        "XLA_FLAGS": xla_flags(),
        **env,
    }
    out = cluster.run(
        "sbatch",
        "--parsable",
        "--ntasks=2",
        f"--chdir={REPO}",
        f"--output={workdir}/slurm-%j.out",
        SCRIPT,
        "--",
        *args,
        **job_env,
    )
    return out.strip().split(";")[0]


def read(path) -> str:
    return open(path).read() if os.path.exists(path) else f"<missing {path}>"


def diagnostics(workdir) -> str:
    logs = os.path.join(workdir, "logs")
    names = sorted(os.listdir(logs)) if os.path.isdir(logs) else []
    slurm_out = [n for n in os.listdir(workdir) if n.startswith("slurm-")] if os.path.isdir(workdir) else []
    parts = [f"== {n}\n{read(os.path.join(workdir, n))[-3000:]}" for n in slurm_out]
    parts += [f"== logs/{n}\n{read(os.path.join(logs, n))[-3000:]}" for n in names]
    return "\n".join(parts)


def assert_completed(state: str, workdir) -> None:
    """The job's state is COMPLETED; otherwise every log's tail goes to stdout first (pytest shows a failed
    test's captured output whole, while it cuts a long assertion message to a few lines)."""
    if state != "COMPLETED":
        print(diagnostics(workdir))
    assert state == "COMPLETED", state


def assert_joined_one_job(workdir, num_processes: int = 2) -> None:
    """Every rank's log has the start-up line for its own index and the same process count."""
    for rank in range(num_processes):
        log = read(os.path.join(workdir, "logs", f"rank-{rank}.log"))
        assert f"rljax: process {rank} of {num_processes}, 1 local devices" in log, diagnostics(workdir)


def wait_for(predicate, timeout_s: float, what: str, workdir) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{diagnostics(workdir)}")


def smoke_args(workdir, model: str, *extra: str) -> list[str]:
    return ["--config=configs/grpo.py:smoke", f"--config.model.path={model}", f"--workdir={workdir}", *extra]


def selftest_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "selftest_metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path) if line.strip()]


def test_selftest_two_tasks_join_one_jax_job(cluster, tiny_model, tmp_path):
    workdir = tmp_path / "run"
    job = submit(
        cluster,
        workdir,
        smoke_args(workdir, tiny_model),
        RLJAX_ENTRY="launch/selftest.py",
        RLJAX_SELFTEST_STEP_S="0.2",
    )
    state = cluster.wait_job(job, timeout_s=120)
    assert_completed(state, workdir)
    assert cluster.job_field(job, "ExitCode") == "0:0"
    assert_joined_one_job(workdir)
    assert "preflight: ok (2 processes, 2 devices)" in read(workdir / "logs" / "preflight-rank-0.log")
    rows = [json.loads(line) for line in open(workdir / "selftest_metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the smoke preset's trainer.steps
    assert all(r["processes"] == 2 and r["sum"] == 3.0 for r in rows)  # ranks contribute 1 + 2
    assert json.load(open(workdir / "selftest_checkpoint.json")) == {"step": 3}


def test_selftest_preempted_saves_requeues_and_resumes(cluster, tiny_model, tmp_path):
    workdir = tmp_path / "run"
    args = smoke_args(workdir, tiny_model, "--config.trainer.steps=8", "--config.checkpoint.every_steps=100")
    job = submit(
        cluster,
        workdir,
        args,
        RLJAX_ENTRY="launch/selftest.py",
        RLJAX_SELFTEST_STEP_S="1.0",
        RLJAX_PREFLIGHT="0",
    )
    wait_for(lambda: len(selftest_steps(workdir)) >= 2, 90, "two self-test steps", workdir)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    wait_for(lambda: cluster.job_field(job, "Restarts") == "1", 90, "the requeue", workdir)
    saved = json.load(open(workdir / "selftest_checkpoint.json"))["step"]
    assert 2 <= saved < 8
    state = cluster.wait_job(job, timeout_s=120)
    assert_completed(state, workdir)
    batch_log = read(workdir / "logs" / "batch.log")
    assert "received USR1" in batch_log and "requeueing job" in batch_log, diagnostics(workdir)
    rank0 = read(workdir / "logs" / "rank-0.log")
    assert f"preempted; saved step {saved}" in rank0
    assert f"resuming from step {saved}" in rank0
    assert selftest_steps(workdir) == list(range(1, 9))  # every step once: resumed right after the save
    assert json.load(open(workdir / "selftest_checkpoint.json")) == {"step": 8}


def metric_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [int(json.loads(line)["step"]) for line in open(path) if line.strip()]


def checkpoint_steps(workdir) -> list[int]:
    root = os.path.join(workdir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(n) for n in names if re.fullmatch(r"\d+", n))


def test_grpo_smoke_two_tasks(cluster, tiny_model, tmp_path):
    workdir = tmp_path / "run"
    job = submit(cluster, workdir, smoke_args(workdir, tiny_model))
    state = cluster.wait_job(job, timeout_s=240)
    assert_completed(state, workdir)
    assert_joined_one_job(workdir)
    assert "finished 3 steps" in read(workdir / "logs" / "rank-0.log"), diagnostics(workdir)
    assert max(metric_steps(workdir)) == 3
    assert 3 in checkpoint_steps(workdir)


def test_grpo_preempted_resumes_from_saved_step(cluster, arith_server, tmp_path):
    """Rollouts from the test run's tiny_arith server (`rollout.vllm.urls`), so neither start of the job
    spends ~30 s starting its own server; test_grpo_smoke_two_tasks covers the job that owns its server."""
    workdir = tmp_path / "run"
    args = [
        "--config=configs/grpo.py:smoke",
        f"--workdir={workdir}",
        *arith_server.main_args(),
        "--config.trainer.steps=6",
        "--config.checkpoint.every_steps=100",
    ]
    job = submit(cluster, workdir, args, RLJAX_PREFLIGHT="0")
    wait_for(lambda: max(metric_steps(workdir), default=0) >= 1, 180, "the first training step", workdir)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    wait_for(lambda: cluster.job_field(job, "Restarts") == "1", 120, "the requeue", workdir)
    saved = checkpoint_steps(workdir)
    assert saved and saved[-1] < 6, saved
    state = cluster.wait_job(job, timeout_s=240)
    assert_completed(state, workdir)
    steps = metric_steps(workdir)
    assert max(steps) == 6
    assert steps.count(saved[-1] + 1) == 1  # the step after the save ran once: resumed, not restarted
    assert 6 in checkpoint_steps(workdir)


def metric_rows(workdir) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


def test_grpo_with_a_rollout_node_step_syncs_over_tcp(cluster, tiny_model, tmp_path):
    """The rollout-node branch for real: the server is its own Slurm step (`rljax.rollout.serve`, on the
    one node, so RLJAX_ROLLOUT_SHARE_NODES=1), bound to the node's Slurm NodeAddr (127.0.0.1 here), with the
    job's token; the 2-process trainer connects by URL and pushes every version over tcp, each process
    serving its own shards."""
    workdir = tmp_path / "run"
    args = smoke_args(workdir, tiny_model, "--config.trainer.steps=2", "--config.checkpoint.every_steps=100")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RLJAX_ROLLOUT_NODES": "1", "RLJAX_ROLLOUT_SHARE_NODES": "1", "RLJAX_VLLM_PORT": str(port)}
    t0 = time.monotonic()
    job = submit(cluster, workdir, args, **env)
    state = cluster.wait_job(job, timeout_s=600)
    print(f"rollout-node job: {state} in {time.monotonic() - t0:.0f} s")
    assert_completed(state, workdir)
    assert_joined_one_job(workdir)
    assert "finished 2 steps" in read(workdir / "logs" / "rank-0.log"), diagnostics(workdir)
    token_file = workdir / "secrets" / "server_token"
    assert os.stat(token_file).st_mode & 0o777 == 0o600
    batch_log = read(workdir / "logs" / "batch.log")
    assert f"rollout servers healthy: 127.0.0.1 (port {port}, token {token_file})" in batch_log
    server_log = read(workdir / "logs" / "vllm-localhost.log")
    assert "rljax.rollout.auth.BearerTokenMiddleware" in server_log, diagnostics(workdir)
    assert token_file.read_text() not in server_log + batch_log
    rows = [r for r in metric_rows(workdir) if "weight_sync/bytes" in r]
    assert [int(r["step"]) for r in rows] == [1, 2], metric_rows(workdir)
    for r in rows:  # every version pushed over tcp and verified by the canary against the trainer
        assert r["weight_sync/bytes"] > 0
        assert r["weight_sync/canary_logprob_max_abs_diff"] <= 1e-3  # rollout.weight_sync.canary_tolerance
        # each trainer task served its own shards from its own bucket server, all out before the pause
        assert r["weight_sync/sent_before_pause"] == 1.0
        lo, hi = r["weight_sync/staged_bytes_min_process"], r["weight_sync/staged_bytes_max_process"]
        assert lo > 0 and hi <= 0.55 * (lo + hi)
