"""launch/gpu_slurm.sh's plan without a running cluster: node split, task layout, rollout URLs, args.

RLJAX_DRY_RUN=1 prints the srun commands instead of running them; `scontrol show hostnames` only needs a
slurm.conf (written by SlurmCluster, not started).
"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from slurm_cluster import SlurmCluster, slurm_installed

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not slurm_installed(), reason="Slurm client commands not installed (slurm-client)"),
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "gpu_slurm.sh")


def dry_run(tmp_path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    cluster = SlurmCluster(str(tmp_path / "conf"))
    cluster.write_conf()
    job_env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_NTASKS_PER_NODE": "8",
        "RLJAX_DRY_RUN": "1",
        "RLJAX_VLLM_MODEL": "/models/m",
        **env,
    }
    return subprocess.run(
        ["bash", SCRIPT, "--", *args],
        cwd=REPO,
        env=cluster.env(**job_env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def srun_commands(out: str) -> list[list[str]]:
    """The srun command lines the dry run printed, as argv lists."""
    prefix = "rljax-slurm: would run: "
    return [shlex.split(line[len(prefix) :]) for line in out.splitlines() if line.startswith(prefix + "srun")]


def test_rollout_nodes_split_and_urls(tmp_path):
    workdir = tmp_path / "run"
    args = ["--config=configs/grpo.py", "--config.trainer.steps=5", f"--workdir={workdir}"]
    proc = dry_run(tmp_path, args, RLJAX_ROLLOUT_NODES="1", RLJAX_PLATFORM="cpu")
    assert proc.returncode == 0, proc.stderr
    vllm, preflight, train = srun_commands(proc.stdout)
    assert "--nodelist=gpu04" in vllm
    assert vllm[-7:] == ["vllm", "serve", "/models/m", "--host", "0.0.0.0", "--port", "8000"]
    urls = "--config.rollout.vllm.urls=('http://gpu04:8000',)"
    layout = [
        "--kill-on-bad-exit=1",
        "--nodes=3",
        "--nodelist=gpu01,gpu02,gpu03",
        "--ntasks=24",
        "--ntasks-per-node=8",
    ]
    for cmd in (preflight, train):
        assert cmd[1:6] == layout, cmd
    assert preflight[-5:] == ["-m", "rljax.preflight", *args, urls][-5:]
    assert train[-6:] == ["-m", "rljax.main", *args, urls]  # the user's args unchanged, then the URLs
    assert f"--output={workdir}/logs/rank-%t.log" in train
    assert "coordinator gpu01:" in proc.stderr and os.path.isdir(workdir / "logs")


def test_one_process_per_node_drives_all_gpus(tmp_path):
    args = [f"--workdir={tmp_path}/run", "--config=configs/grpo.py"]
    proc = dry_run(
        tmp_path,
        args,
        RLJAX_PROCESS_PER="node",
        SLURM_GPUS_ON_NODE="8",
        RLJAX_PREFLIGHT="0",
        XLA_PYTHON_CLIENT_MEM_FRACTION="0.5",
    )
    assert proc.returncode == 0, proc.stderr
    (train,) = srun_commands(proc.stdout)
    assert train[1:6] == [
        "--kill-on-bad-exit=1",
        "--nodes=4",
        "--nodelist=gpu01,gpu02,gpu03,gpu04",
        "--ntasks=4",
        "--ntasks-per-node=1",
    ]


def test_missing_workdir_is_a_clear_error(tmp_path):
    proc = dry_run(tmp_path, ["--config=configs/grpo.py"])
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "rljax-slurm: error: pass --workdir=DIR after -- (metrics, checkpoints and logs go there)"
    )


def test_all_nodes_for_rollout_is_rejected(tmp_path):
    proc = dry_run(tmp_path, [f"--workdir={tmp_path}/run"], RLJAX_ROLLOUT_NODES="4", RLJAX_PLATFORM="cpu")
    assert proc.returncode == 2 and "needs at least one trainer node among 4 nodes" in proc.stderr
