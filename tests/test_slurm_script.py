"""launch/gpu_slurm.sh's plan without a running cluster: node split, task layout, rollout servers and args.

RLJAX_DRY_RUN=1 prints the srun commands instead of running them; `scontrol show hostnames` only needs a
slurm.conf (written by SlurmCluster, not started).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

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
        "RLJAX_PYTHON": sys.executable,  # rljax.rollout.serve --print runs in the dry run
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


def served_commands(out: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment changes, argv) of each vLLM server the dry run's `rljax.rollout.serve --print` showed."""
    servers, env = [], {}
    for line in out.splitlines():
        if line.startswith("rljax-serve: env "):
            key, _, value = line[len("rljax-serve: env ") :].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
        elif line.startswith("rljax-serve: exec "):
            servers.append((env, shlex.split(line[len("rljax-serve: exec ") :])))
            env = {}
    return servers


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


ADDRS = "gpu01=10.1.0.1,gpu02=10.1.0.2,gpu03=10.1.0.3,gpu04=10.1.0.4"


def test_rollout_nodes_split_urls_and_server_command(tmp_path):
    workdir = tmp_path / "run"
    args = ["--config=configs/grpo.py", "--config.trainer.steps=5", f"--workdir={workdir}"]
    proc = dry_run(tmp_path, args, RLJAX_ROLLOUT_NODES="1", RLJAX_PLATFORM="cpu", RLJAX_NODE_ADDRS=ADDRS)
    assert proc.returncode == 0, proc.stderr
    serve, preflight, train = srun_commands(proc.stdout)
    token_file = workdir / "secrets" / "server_token"
    assert os.stat(token_file).st_mode & 0o777 == 0o600 and len(token_file.read_text()) >= 43
    assert os.stat(token_file.parent).st_mode & 0o777 == 0o700
    rollout = [
        "--config.rollout.vllm.urls=('http://10.1.0.4:8000',)",
        f"--config.rollout.vllm.token_file={token_file}",
        "--config.rollout.vllm.allow_remote=true",
        "--config.rollout.weight_sync.transport=tcp",
        "--config.rollout.weight_sync.tcp_host=10.1.0.1,10.1.0.2,10.1.0.3",  # every trainer node serves
    ]
    assert serve[:5] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu04"]
    i = serve.index("rljax.rollout.serve")
    assert serve[i + 1 :] == [
        *["--port", "8000", "--token-file", str(token_file), "--model", "/models/m"],
        *["--host", "10.1.0.4", "--", *args, *rollout],
    ]
    layout = [
        "--kill-on-bad-exit=1",
        "--nodes=3",
        "--nodelist=gpu01,gpu02,gpu03",
        "--ntasks=24",
        "--ntasks-per-node=8",
    ]
    for cmd in (preflight, train):
        assert cmd[1:6] == layout, cmd
    assert preflight[-len(args) - 7 :] == ["-m", "rljax.preflight", *args, *rollout]
    assert train[-len(args) - 7 :] == ["-m", "rljax.main", *args, *rollout]  # the user's args, then ours
    assert f"--output={workdir}/logs/rank-%t.log" in train
    assert "coordinator gpu01:" in proc.stderr and os.path.isdir(workdir / "logs")
    # The server itself, as `rljax.rollout.serve` execs it on gpu04:
    ((env, argv),) = served_commands(proc.stdout)
    assert argv[1:4] == ["-P", "-m", "vllm.entrypoints.openai.api_server"]  # -P: not importing from its cwd
    assert flag(argv, "--model") == "/models/m"
    assert flag(argv, "--host") == "10.1.0.4" and flag(argv, "--port") == "8000"  # the private address only
    assert json.loads(flag(argv, "--weight-transfer-config")) == {"backend": "tcp"}
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--middleware") == "rljax.rollout.auth.BearerTokenMiddleware"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["RLJAX_SERVER_TOKEN_FILE"] == str(token_file)
    assert token_file.read_text() not in proc.stdout + proc.stderr  # on no command line, in no log


def test_two_rollout_nodes_get_one_token_and_their_own_addresses(tmp_path):
    workdir = tmp_path / "run"
    args = ["--config=configs/grpo.py", f"--workdir={workdir}"]
    proc = dry_run(tmp_path, args, RLJAX_ROLLOUT_NODES="2", RLJAX_PLATFORM="cpu", RLJAX_NODE_ADDRS=ADDRS)
    assert proc.returncode == 0, proc.stderr
    serve3, serve4, _, train = srun_commands(proc.stdout)
    assert "--config.rollout.vllm.urls=('http://10.1.0.3:8000','http://10.1.0.4:8000',)" in train
    servers = served_commands(proc.stdout)
    assert [flag(argv, "--host") for _, argv in servers] == ["10.1.0.3", "10.1.0.4"]
    assert {env["RLJAX_SERVER_TOKEN_FILE"] for env, _ in servers} == {
        str(workdir / "secrets" / "server_token")
    }
    assert "--nodelist=gpu03" in serve3 and "--nodelist=gpu04" in serve4


def test_rollout_node_without_an_address_is_a_clear_error(tmp_path):
    # gpu04 has no entry and its name does not resolve (no running slurmctld to ask for its NodeAddr)
    args = ["--config=configs/grpo.py", f"--workdir={tmp_path}/run"]
    proc = dry_run(tmp_path, args, RLJAX_ROLLOUT_NODES="1", RLJAX_NODE_ADDRS="gpu01=10.1.0.1")
    assert proc.returncode == 2
    assert "no private address for node gpu04 (set RLJAX_NODE_ADDRS=gpu04=ADDR)" in proc.stderr


def test_wildcard_address_is_refused(tmp_path):
    args = ["--config=configs/grpo.py", f"--workdir={tmp_path}/run"]
    env = {"RLJAX_ROLLOUT_NODES": "1", "RLJAX_NODE_ADDRS": "gpu01=10.1.0.1,gpu04=0.0.0.0"}
    proc = dry_run(tmp_path, args, **env)
    assert proc.returncode == 2 and "no private address for node gpu04" in proc.stderr


def test_rollout_servers_may_share_the_trainer_nodes(tmp_path):
    args = ["--config=configs/grpo.py", f"--workdir={tmp_path}/run"]
    env = {"RLJAX_ROLLOUT_NODES": "1", "RLJAX_ROLLOUT_SHARE_NODES": "1", "RLJAX_NODE_ADDRS": ADDRS}
    proc = dry_run(tmp_path, args, RLJAX_PLATFORM="cpu", **env)
    assert proc.returncode == 0, proc.stderr
    serve, _, train = srun_commands(proc.stdout)
    assert "--nodelist=gpu04" in serve and "--nodelist=gpu01,gpu02,gpu03,gpu04" in train


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


def planned(out: str) -> dict:
    (line,) = [x for x in out.splitlines() if x.startswith("rljax-slurm: plan ")]
    return json.loads(line[len("rljax-slurm: plan ") :])


@pytest.mark.parametrize(
    "env,flags,share",
    [  # 4 nodes of 8 GPUs: colocated (a server on node 0's GPU 0), and the last node serving on its own
        ({}, ["--rollout-nodes", "0"], "0.80"),
        ({"RLJAX_ROLLOUT_NODES": "1", "RLJAX_NODE_ADDRS": ADDRS}, ["--rollout-nodes", "1"], "0.90"),
    ],
    ids=["colocated", "rollout-node"],
)
def test_the_slurm_plan_is_the_local_launchers_plan(tmp_path, env, flags, share):
    args = [
        "--config=configs/grpo.py",
        f"--workdir={tmp_path}/run",
        "--config.rollout.vllm.tensor_parallel_size=4",
    ]
    proc = dry_run(tmp_path, args, RLJAX_PREFLIGHT="0", **env)
    assert proc.returncode == 0, proc.stderr
    local = subprocess.run(
        [sys.executable, "-m", "rljax.launch", "--plan", "--gpus", "8", "--nodes", "4", *flags, "--", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert local.returncode == 0, local.stderr
    assert planned(proc.stdout) == json.loads(local.stdout)
    assert f"rljax-slurm: trainer memory share: XLA_PYTHON_CLIENT_MEM_FRACTION={share}" in proc.stderr


def test_a_job_no_plan_fits_stops_before_any_step(tmp_path):
    args = ["--config=configs/grpo.py", f"--workdir={tmp_path}/run", "--config.rollout.vllm.num_servers=9"]
    proc = dry_run(tmp_path, args)
    assert proc.returncode == 2 and "no device plan fits this job" in proc.stderr
    assert "rljax: error: config: rollout.vllm.num_servers: 9 server(s)" in proc.stderr
    assert srun_commands(proc.stdout) == []


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


def test_serve_refuses_a_wildcard_or_an_unallowed_remote_bind(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 43)
    token.chmod(0o600)
    base = [
        sys.executable,
        "-m",
        "rljax.rollout.serve",
        "--port",
        "8000",
        "--token-file",
        str(token),
        "--print",
    ]
    cases = [
        (["--host", "0.0.0.0"], ["--config.rollout.vllm.allow_remote=true"], "binds every interface"),
        (["--host", "10.1.0.4"], [], "set rollout.vllm.allow_remote=true"),
    ]
    for host, overrides, message in cases:
        cmd = [*base, *host, "--", "--config=configs/grpo.py", *overrides]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1  # one line, no traceback
    token.chmod(0o644)
    cmd = [*base, "--host", "127.0.0.1", "--", "--config=configs/grpo.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "must be a regular file with mode 0600" in proc.stderr, proc.stderr
