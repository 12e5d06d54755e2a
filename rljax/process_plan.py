"""The process plan every launcher uses: each JAX process's environment (coordinator, rank, devices).

`process_envs(n, devices_per_process, port, base, host)` is what the local launcher (`rljax.launch`), the
Kubernetes manifests (`rljax.k8s_render`) and the Ray actors (`rljax.ray_launch`) give their processes, so
the three start the same job; Slurm's script sets the same variables itself (`launch/gpu_slurm.sh`). A
rollout server on a node of its own is `serve_argv`, and the trainer's overrides for such servers are
`rollout_overrides` (gpu_slurm.sh's ROLLOUT_ARGS), for Ray and Kubernetes alike.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # to every process of a job
KILL_GRACE_S = 30.0  # after a failure, time the others get to exit on SIGTERM before SIGKILL


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` (default loopback) that was free a moment ago (bound to port 0, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def process_envs(
    num_processes: int, devices_per_process: int, port: int, base: dict, host: str = "127.0.0.1"
) -> list[dict]:
    """The environment of each process: coordinator, rank, and its devices. The one process plan every
    launcher uses (local, Ray, Kubernetes): `host` is the coordinator's address (process 0's node)."""
    platform = base.get("RLJAX_PLATFORM", "cpu")
    envs = []
    for rank in range(num_processes):
        env = dict(
            base,
            RLJAX_COORDINATOR=f"{host}:{port}",
            # JAX's coordinator binds every interface ([::]:port) unless told otherwise; it needs only the
            # address the others dial, and nothing else on the network should reach the job's key-value store.
            JAX_COORDINATOR_BIND_ADDRESS=f"{host}:{port}",
            RLJAX_NUM_PROCESSES=str(num_processes),
            RLJAX_PROCESS_ID=str(rank),
            RLJAX_PLATFORM=platform,
            PYTHONUNBUFFERED="1",
        )
        for key in ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"):  # not a Slurm step
            env.pop(key, None)
        if devices_per_process and platform == "cpu":
            env["RLJAX_CPU_DEVICES"] = str(devices_per_process)
        elif devices_per_process:
            first = rank * devices_per_process
            env["RLJAX_LOCAL_DEVICE_IDS"] = ",".join(
                str(i) for i in range(first, first + devices_per_process)
            )
        envs.append(env)
    return envs


def workdir_of(args: list[str]) -> str | None:
    """The --workdir value in rljax.main arguments, if any."""
    for i, arg in enumerate(args):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(args):
            return args[i + 1]
    return None


def serve_argv(
    python: str, host: str, port: int | str, token_file: str, trainer_args: list[str]
) -> list[str]:
    """A rollout server for the trainer's args on `host` (a node's private address, never a wildcard)."""
    serve = [python, "-m", "rljax.rollout.serve", "--host", host, "--port", str(port)]
    return [*serve, "--token-file", token_file, "--", *trainer_args]


def rollout_overrides(server_urls: list[str], token_file: str, tcp_host: str) -> list[str]:
    """The trainer's overrides for servers at `server_urls`: their token file, remote servers allowed, tcp
    weight sync served on `tcp_host` (each trainer host's address, comma-separated)."""
    return [
        f"--config.rollout.vllm.urls=({''.join(repr(u) + ',' for u in server_urls)})",
        f"--config.rollout.vllm.token_file={token_file}",
        "--config.rollout.vllm.allow_remote=true",
        "--config.rollout.weight_sync.transport=tcp",
        f"--config.rollout.weight_sync.tcp_host={tcp_host}",
    ]


def wait_healthy(url: str, timeout_s: float, poll_s: float = 2.0) -> bool:
    """Polls `GET url` (a server's /health) until it answers 2xx or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=min(2.0, timeout_s)) as resp:
                if 200 <= resp.status < 300:
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() + poll_s > deadline:
            return False
        time.sleep(poll_s)


def wait_all(procs: list[subprocess.Popen], grace_s: float) -> int:
    """Waits for every process; on the first failure terminates the others (SIGTERM, then SIGKILL after
    `grace_s`: srun's --kill-on-bad-exit, a Job's backoffLimit 0) and returns that first failure's code,
    else 0."""
    first_bad, failed_at = None, None
    while True:
        codes = [p.poll() for p in procs]
        if first_bad is None and any(c not in (None, 0) for c in codes):
            first_bad, failed_at = next(c for c in codes if c not in (None, 0)), time.monotonic()
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if all(c is not None for c in codes):
            return first_bad or 0
        time.sleep(0.1)
