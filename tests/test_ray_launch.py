"""rljax.ray_launch on a real 2-node local Ray cluster (`ray.cluster_utils.Cluster`, 1 CPU per node, started
and shut down by this module; never `ray stop`): the smoke job as 2 trainer actors (one per node) gives the
metrics of `rljax.launch --num-processes 2`; a killed actor or a failing rank ends the job; an unplaceable
job is one line, exit 1. Plus the argument building for rollout nodes and the CLI's one-line errors."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import stat
import subprocess
import sys
import time

import pytest

from rljax import launch, process_plan, ray_launch

ray = pytest.importorskip("ray")

REPO = pathlib.Path(__file__).resolve().parents[1]
PEER_TIMEOUT_S = 10
# Every Ray process on 127.0.0.1: otherwise Ray advertises the network address (PLATFORM.md).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Metrics that depend only on the samples and the weights (not on timings): equal across launchers.
DETERMINISTIC_KEYS = ("step", "policy/version", "reward/mean", "reward/std", "loss/total", "loss/policy")


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each, on 127.0.0.1."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        for key, value in RAY_ENV.items():
            mp.setenv(key, value)
        # The dashboard serves `ray job submit` (its job API); port 0: a free one.
        args = {"num_cpus": 1, "include_dashboard": True, "dashboard_port": 0}
        head = Cluster(initialize_head=True, head_node_args=args)
        try:
            head.add_node(num_cpus=1)
            head.wait_for_nodes()
            yield head
        finally:
            head.shutdown()


def job_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", RLJAX_PLATFORM="cpu", **RAY_ENV, **extra)


def start(module: str, flags: list[str], args: list[str], **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", module, *flags, "--", *args]
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen(cmd, cwd=REPO, env=job_env(**env), **out)


def submit_job(cluster, flags: list[str], args: list[str]) -> subprocess.Popen:
    """`ray job submit` of `python -m rljax.launch --backend=ray` (the entrypoint finds the cluster in the
    RAY_ADDRESS Ray sets for it): run from the checkout with the venv's full python path, as docs/launch.md
    says; the job's own environment carries the platform variables."""
    url = "http://" + cluster.head_node.address_info["webui_url"]
    variables = " ".join(
        f"{k}={v}" for k, v in {"JAX_PLATFORMS": "cpu", "RLJAX_PLATFORM": "cpu", **RAY_ENV}.items()
    )
    entry = [sys.executable, "-m", "rljax.launch", "--backend=ray", *flags, "--", *args]
    script = f"cd {shlex.quote(str(REPO))} && env {variables} {shlex.join(entry)}"
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "job",
        "submit",
        "--address",
        url,
        "--",
        "bash",
        "-c",
        script,
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def metrics(workdir: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in DETERMINISTIC_KEYS if k in r} for r in rows]


def smoke_args(workdir: pathlib.Path, server, steps: int) -> list[str]:
    return [
        "--config=configs/grpo.py:smoke",
        f"--workdir={workdir}",
        *server.main_args(),
        f"--config.trainer.steps={steps}",
        "--config.trainer.eval_every=0",
        "--config.checkpoint.every_steps=100",
    ]


def wait_for(path: pathlib.Path, text: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{text!r} not in {path}"
        time.sleep(0.2)


# --------------------------------------------------------------------------------- real Ray cluster
@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_smoke_job_on_two_ray_nodes_matches_the_local_launcher(cluster, arith_server, tmp_path):
    flags = ["--num-processes", "2", "--devices-per-process", "1"]
    runs = {}
    for name in ("local", "ray"):
        workdir = tmp_path / name
        t0 = time.monotonic()
        args = smoke_args(workdir, arith_server, steps=2)
        proc = submit_job(cluster, flags, args) if name == "ray" else start("rljax.launch", flags, args)
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out[-4000:]
        runs[name] = (workdir, out, time.monotonic() - t0)
    workdir, out, _ = runs["ray"]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", out), out[-3000:]  # through Ray's job API
    assert "STRICT_SPREAD over 2 nodes" in out, out[-3000:]
    assert "rljax: process 1 of 2, 1 local devices" in (workdir / "logs" / "rank-1.log").read_text()
    assert "[rank 0]" in out  # each process's output reaches the driver too
    ours, theirs = metrics(workdir), metrics(runs["local"][0])
    assert [r["step"] for r in ours] == [1, 2] and all(len(r) == len(DETERMINISTIC_KEYS) for r in ours), ours
    # The same 2 x 1-device layout, seeds and samples; Ray's workers may see other thread counts
    # (OMP_NUM_THREADS=1), which may reorder float32 sums: equal to 1e-6 relative, not bitwise.
    assert [r["reward/mean"] for r in ours] == [r["reward/mean"] for r in theirs]
    assert ours == [pytest.approx(r, rel=1e-6) for r in theirs]


@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_a_killed_trainer_actor_ends_the_job_within_the_peer_timeout(cluster, arith_server, tmp_path):
    args = smoke_args(tmp_path, arith_server, steps=200)
    flags = ["--address", cluster.address, "--num-processes", "2", "--devices-per-process", "1"]
    tag = f"RLJAX_TEST_JOB={tmp_path.name}"  # RLJAX_* reaches every process: it finds this job's
    env = {"RLJAX_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S), "RLJAX_TEST_JOB": tmp_path.name}
    proc = start("rljax.ray_launch", flags, args, **env)
    for rank in range(2):
        wait_for(tmp_path / "logs" / f"rank-{rank}.log", f"rljax: process {rank} of 2", proc)
    trainer = pid_with_env(tag, "RLJAX_PROCESS_ID=1")
    actor = parent_of(trainer)
    os.kill(actor, signal.SIGKILL)  # the actor's worker process, as a lost worker or node would
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=PEER_TIMEOUT_S + 60)
    elapsed = time.monotonic() - killed
    assert proc.returncode not in (0, None), out[-3000:]
    assert elapsed < PEER_TIMEOUT_S + 20, (elapsed, out[-3000:])
    assert "rank 1: its Ray actor died" in out, out[-3000:]
    time.sleep(1)
    assert not alive(trainer), "the trainer outlived its actor"


@pytest.mark.multiprocess
def test_a_failing_rank_is_the_jobs_exit_code(cluster, tmp_path):
    args = ["--config=configs/grpo.py:no-such-preset", f"--workdir={tmp_path}"]
    proc = start("rljax.ray_launch", ["--address", cluster.address, "--num-processes", "2"], args)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-3000:]  # rljax.main's one-line config error
    assert "unknown preset" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_an_unplaceable_job_fails_in_one_line(cluster, tmp_path):
    code = (
        "import sys; from rljax import ray_launch; "
        f"sys.exit(ray_launch.run(['--config=x'], {cluster.address!r}, 3, placement_timeout_s=3))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rljax: error: ray: cannot place 3 bundles of {'CPU': 1.0} (PACK) in 3 s" in proc.stderr
    assert "the cluster has 2 nodes, 2 CPUs" in proc.stderr


def pid_with_env(*needles: str) -> int:
    """The one process whose environment holds every `NAME=value` of `needles`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if all(n in env for n in needles):
            found.append(int(pid))
    assert len(found) == 1, found
    return found[0]


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------------------- argument building
def test_rollout_nodes_get_private_addresses_a_token_and_tcp_weight_sync(tmp_path):
    token = ray_launch.new_token_file(str(tmp_path))
    assert token == str(tmp_path / "secrets" / "server_token")
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "secrets").st_mode) == 0o700
    assert len(open(token).read()) >= 32 and ray_launch.new_token_file(str(tmp_path)) == token
    urls = ["http://10.0.0.3:8000", "http://10.0.0.4:8001"]
    extra = ray_launch.rollout_args(urls, token, ["10.0.0.1", "10.0.0.2", "10.0.0.2"])
    assert extra == [
        "--config.rollout.vllm.urls=('http://10.0.0.3:8000','http://10.0.0.4:8001',)",
        f"--config.rollout.vllm.token_file={token}",
        "--config.rollout.vllm.allow_remote=true",
        "--config.rollout.weight_sync.transport=tcp",
        "--config.rollout.weight_sync.tcp_host=10.0.0.1,10.0.0.2",  # one per trainer host, in rank order
    ]
    base = ["--config=configs/grpo.py", "--workdir=/w"]
    cfg = launch.config_from_args([*base, *extra])  # the trainer's config accepts them
    assert cfg.rollout.vllm.urls == tuple(urls) and cfg.rollout.weight_sync.transport == "tcp"
    argv = process_plan.serve_argv("/venv/bin/python", "10.0.0.3", 8000, token, [*base, *extra])
    assert argv[:9] == ["/venv/bin/python", "-m", "rljax.rollout.serve", "--host", "10.0.0.3"] + [
        "--port",
        "8000",
        "--token-file",
        token,
    ]
    assert argv[9] == "--" and argv[10:] == [*base, *extra]


def test_placement_and_process_plan():
    assert ray_launch.placement_strategy(2, 0, 2) == "STRICT_SPREAD"
    assert ray_launch.placement_strategy(4, 0, 2) == "PACK"
    assert ray_launch.placement_strategy(2, 1, 3) == "STRICT_SPREAD"
    with pytest.raises(ray_launch.LaunchError, match="--rollout-nodes: 2 trainer \\+ 1 rollout nodes: 3"):
        ray_launch.placement_strategy(2, 1, 2)
    assert ray_launch.bundle(0, gpu=False) == {"CPU": 1.0}
    assert ray_launch.bundle(4, gpu=True) == {"CPU": 1.0, "GPU": 4.0}
    envs = ray_launch.trainer_envs(2, 2, "10.0.0.1", 1234, {"RLJAX_PLATFORM": "gpu", "JAX_X": "1"})
    assert envs[1]["RLJAX_COORDINATOR"] == "10.0.0.1:1234" and envs[1]["RLJAX_PROCESS_ID"] == "1"
    assert "RLJAX_LOCAL_DEVICE_IDS" not in envs[1]  # Ray's CUDA_VISIBLE_DEVICES holds each actor's GPUs
    assert ray_launch.job_env({"RLJAX_A": "1", "XLA_FLAGS": "f", "PATH": "/bin", "HOME": "/h"}) == {
        "RLJAX_A": "1",
        "XLA_FLAGS": "f",
    }


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--num-processes", "x", "--", "a"], "--num-processes: an integer >= 0, got 'x'"),
        (["--num-processes", "0", "--", "a"], "--num-processes: an integer >= 1, got 0"),
        (["--num-process", "2", "--", "a"], "--num-process: unknown flag; valid: --address, --num-processes"),
        (["--num-processes", "2"], "--: give the rljax.main arguments after --"),
        (["--num-processes", "2", "--python", "/nope", "--", "a"], "--python: an executable Python"),
        (["--num-processes", "1", "--rollout-nodes", "1", "--", "a"], "--rollout-nodes: needs --workdir"),
        (["--num-processes", "1", "--address"], "--address: expected one argument"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv, line, capsys):
    assert ray_launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rljax: error: {line}") and err.count("\n") == 1, err


@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_rollout_node_serves_the_trainer_over_tcp(cluster, tmp_path):
    """`--rollout-nodes 1`: a vLLM server as an actor on the second node (rljax.rollout.serve, the node's
    address, the job's 0600 token), the trainer on the first pushing every version over tcp, verified."""
    args = [
        "--config=configs/grpo.py:smoke",
        f"--workdir={tmp_path}",
        "--config.trainer.steps=2",
        "--config.trainer.eval_every=0",
        "--config.checkpoint.every_steps=100",
    ]
    flags = ["--backend=ray", "--address", cluster.address, "--num-processes", "1", "--rollout-nodes", "1"]
    proc = start("rljax.launch", flags, args)
    out, _ = proc.communicate(timeout=540)
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "weight_sync/bytes" in r]
    assert [int(r["step"]) for r in synced] == [1, 2], rows
    assert all(r["weight_sync/canary_logprob_max_abs_diff"] <= 1e-3 for r in synced)  # float32 tolerance
    token = tmp_path / "secrets" / "server_token"
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    server_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("vllm-*.log"))
    assert "rljax.rollout.auth.BearerTokenMiddleware" in server_logs and token.read_text() not in server_logs


def test_gpu_jobs_get_the_device_plans_share_as_on_the_other_launchers(monkeypatch):
    """On GPUs every Ray trainer gets the trainer share the device plan gives the same job on Slurm and
    Kubernetes (a process per bundle of K GPUs, rollout servers on nodes of their own)."""
    import argparse

    from rljax import device_plan
    from rljax.runtime import config_from_args

    args = ["--config=configs/grpo.py", "--config.rollout.vllm.tensor_parallel_size=8"]
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("RLJAX_PLATFORM", "gpu")
    for rollout_nodes, share in ((0, "0.80"), (1, "0.90")):
        opts = argparse.Namespace(num_processes=2, devices_per_process=8, rollout_nodes=rollout_nodes)
        machine = device_plan.Machine(8, 2 + rollout_nodes, rollout_nodes, "node")
        expected = device_plan.shared_env(device_plan.make_plan(config_from_args(args), machine))
        assert ray_launch._planned(args, opts) == expected == {"XLA_PYTHON_CLIENT_MEM_FRACTION": share}
    bad = [*args, "--config.rollout.vllm.gpu_memory_utilization=0.9"]
    with pytest.raises(ray_launch.LaunchError, match="config: rollout.vllm.gpu_memory_utilization"):
        ray_launch._planned(bad, argparse.Namespace(num_processes=1, devices_per_process=8, rollout_nodes=0))
    monkeypatch.setenv("RLJAX_PLATFORM", "cpu")
    assert (
        ray_launch._planned(bad, argparse.Namespace(num_processes=1, devices_per_process=8, rollout_nodes=0))
        == {}
    )
