"""Local launcher: N JAX processes on one machine, the same code path as Slurm (for debugging).

    python -m rljax.launch --num-processes 2 [--devices-per-process 4] -- \
        --config=configs/grpo.py:smoke --workdir=/tmp/run

Each process runs `python -m rljax.main <args after -->` (or `--entry`) with RLJAX_COORDINATOR,
RLJAX_NUM_PROCESSES and RLJAX_PROCESS_ID set, which `rljax.runtime.initialize_jax` turns into
`jax.distributed.initialize(...)`. `--devices-per-process K` gives each process K simulated CPU devices
(RLJAX_CPU_DEVICES) or, on GPU (RLJAX_PLATFORM=gpu), GPUs i*K..i*K+K-1 (RLJAX_LOCAL_DEVICE_IDS). Output
lines are prefixed `[rank i]`, and copied to <workdir>/logs/rank-<i>.log when --workdir is given. Like
`srun --kill-on-bad-exit=1`, the first process to fail ends the others; SIGTERM/SIGUSR1/SIGINT are
forwarded to every process (they save and exit 143); the launcher exits with the first non-zero code.

On a GPU node, `--gpus N` replaces both: the device plan (`rljax.device_plan`) decides the processes, the
GPUs and memory share of each, and the GPUs of the servers the leader starts.

    python -m rljax.launch --plan --gpus 8 [--nodes M] [--rollout-nodes K] [--process-per gpu|node] -- ARGS

prints that plan as JSON (each server's command line and devices too; ports 8000 + i stand for the free
ports owned servers take), starting nothing; an impossible plan is one line naming the field, exit 2.

Other launchers, the same process plan (`rljax.process_plan`): `--backend=k8s --render=DIR` writes
Kubernetes manifests (`rljax.k8s_launch`), `--backend=k8s-local` runs them here as local processes,
`--backend=ray --address=ADDR` runs the job on a Ray cluster (`rljax.ray_launch`); docs/launch.md.

Helpers used by launch/gpu_slurm.sh:
    python -m rljax.launch --print-config model.path [KEY ...] -- <rljax.main args>
    python -m rljax.launch --plan-env --gpus G --nodes M --rollout-nodes K -- ARGS  (KEY=VALUE lines)
    python -m rljax.launch --wait-url http://node:8000/health --timeout 600
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading

from rljax import config as config_lib
from rljax import device_plan
from rljax.process_plan import (
    FORWARDED_SIGNALS,
    KILL_GRACE_S,
    free_port,
    process_envs,
    wait_all,
    wait_healthy,
    workdir_of,
)
from rljax.runtime import config_from_args


def lookup(cfg: config_lib.Config, key: str):
    """The value of dotted field `key` (e.g. "model.path"); ConfigError naming the valid keys otherwise."""
    if key not in config_lib.field_types():
        raise config_lib.ConfigError(
            key, f"unknown config key{config_lib.suggest(key, sorted(config_lib.field_types()))}"
        )
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _pump(proc: subprocess.Popen, rank: int, log_path: str | None) -> None:
    log = open(log_path, "a") if log_path else None
    for line in proc.stdout:
        sys.stdout.write(f"[rank {rank}] {line}")
        sys.stdout.flush()
        if log:
            log.write(line)
            log.flush()
    if log:
        log.close()


def plan_json(cfg: config_lib.Config, plan: device_plan.Plan) -> dict:
    """`plan` (of `cfg`) with each server's argv and environment (ports 8000 + i stand for the ones they
    take)."""
    from rljax.rollout.server import options_from_config, server_command

    out = plan.to_json()
    for i, (entry, server) in enumerate(zip(out["servers"], plan.servers, strict=True)):
        options = options_from_config(cfg, devices=server.devices, cpu_build=plan.mode == "cpu")
        entry["argv"] = server_command(cfg.model.path, cfg.rollout.vllm.host, 8000 + i, options)
        entry["env"] = {"CUDA_VISIBLE_DEVICES": device_plan.visible_devices(server.devices, {})}
    return out


def launch(
    args: list[str],
    num_processes: int,
    devices_per_process: int = 0,
    entry: str = "rljax.main",
    planned: list[dict] | None = None,
) -> int:
    """Runs `num_processes` copies of `entry` with `args` as one JAX job; returns the job's exit code.
    `planned`: each process's environment from the device plan (`TrainerProcess.env`)."""
    cmd = [sys.executable, entry] if entry.endswith(".py") else [sys.executable, "-m", entry]
    workdir = workdir_of(args)
    logdir = os.path.join(workdir, "logs") if workdir else None
    if logdir:
        os.makedirs(logdir, exist_ok=True)
    envs = process_envs(num_processes, devices_per_process, free_port(), dict(os.environ))
    envs = [env | own for env, own in zip(envs, planned or [{}] * num_processes, strict=True)]
    procs = [
        subprocess.Popen([*cmd, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in envs
    ]
    pumps = [
        threading.Thread(
            target=_pump, args=(p, r, logdir and os.path.join(logdir, f"rank-{r}.log")), daemon=True
        )
        for r, p in enumerate(procs)
    ]
    for t in pumps:
        t.start()
    previous = {s: signal.signal(s, lambda signum, _: _forward(procs, signum)) for s in FORWARDED_SIGNALS}
    try:
        code = wait_all(procs, KILL_GRACE_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in pumps:
            t.join(timeout=5)
    return code


def _forward(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)


def wait_url(url: str, timeout_s: float) -> bool:
    """Polls `url` (its `/health` when it does not end in it) until it answers 2xx or `timeout_s` passes."""
    health = url if url.endswith("/health") else url.rstrip("/") + "/health"
    return wait_healthy(health, timeout_s)


BACKENDS = ("local", "k8s", "k8s-local", "ray")


def _backend(ours: list[str]) -> tuple[str, list[str]]:
    """(`--backend` value, the other flags): the backend's own flags go to its `main`."""
    for i, arg in enumerate(ours):
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1], ours[:i] + ours[i + 1 :]
        if arg == "--backend" and i + 1 < len(ours):
            return ours[i + 1], ours[:i] + ours[i + 2 :]
    return "local", ours


def _other_backend(backend: str, ours: list[str], rest: list[str]) -> int:
    """Kubernetes (`rljax.k8s_launch`: manifests; `k8s-local` runs them here) or Ray (`rljax.ray_launch`)."""
    if backend in ("k8s", "k8s-local"):
        from rljax import k8s_launch

        return k8s_launch.main([*(["--local"] if backend == "k8s-local" else []), *ours, "--", *rest])
    if backend == "ray":
        from rljax import ray_launch

        return ray_launch.main([*ours, "--", *rest])
    print(f"rljax: error: --backend: must be one of {', '.join(BACKENDS)}, got {backend!r}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    backend, ours = _backend(ours)
    if backend != "local":
        return _other_backend(backend, ours, rest)
    parser = argparse.ArgumentParser(prog="python -m rljax.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--num-processes", type=int, default=0)
    parser.add_argument("--devices-per-process", type=int, default=0)
    parser.add_argument("--entry", default="rljax.main", help="module or .py file (default rljax.main)")
    parser.add_argument("--print-config", nargs="+", metavar="KEY", help="print resolved config values")
    parser.add_argument("--wait-url", help="wait until this URL answers 2xx")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node: the device plan places them")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--rollout-nodes", type=int, default=0)
    parser.add_argument("--process-per", default="gpu", help="gpu (default) or node")
    parser.add_argument("--plan", action="store_true", help="print the device plan as JSON, run nothing")
    parser.add_argument("--plan-env", action="store_true", help="print the job-wide trainer environment")
    opts = parser.parse_args(ours)
    if opts.wait_url:
        return 0 if wait_url(opts.wait_url, opts.timeout) else 1
    if opts.plan or opts.plan_env or opts.gpus:
        return _planned(opts, rest)
    if opts.print_config:
        try:
            cfg = config_from_args(rest)
            values = [lookup(cfg, key) for key in opts.print_config]
        except config_lib.ConfigError as e:
            print(f"rljax: error: config: {e}", file=sys.stderr)
            return 2
        print("\n".join(str(v) for v in values))
        return 0
    if opts.num_processes < 1:
        parser.error("--num-processes N (>= 1) is required")
    return launch(rest, opts.num_processes, opts.devices_per_process, opts.entry)


def _planned(opts: argparse.Namespace, rest: list[str]) -> int:
    """--plan, --plan-env, or the local launcher on `--gpus` GPUs of this node by the device plan."""
    machine = device_plan.Machine(opts.gpus, opts.nodes, opts.rollout_nodes, opts.process_per)
    try:
        cfg = config_from_args(rest)
        plan = device_plan.make_plan(cfg, machine)
    except config_lib.ConfigError as e:
        print(f"rljax: error: config: {e}", file=sys.stderr)
        return 2
    if opts.plan:
        print(json.dumps(plan_json(cfg, plan), indent=1))
        return 0
    if opts.plan_env:
        print("\n".join(f"{k}={v}" for k, v in device_plan.shared_env(plan).items()))
        return 0
    if opts.nodes != 1 or opts.rollout_nodes:
        print("rljax: error: --nodes/--rollout-nodes: the local launcher runs one node", file=sys.stderr)
        return 2
    common = {"RLJAX_PLATFORM": "gpu", device_plan.GPUS_ENV: str(opts.gpus)}
    planned = [t.env() | common for t in plan.trainers]
    return launch(rest, len(planned), entry=opts.entry, planned=planned)


if __name__ == "__main__":
    sys.exit(main())
