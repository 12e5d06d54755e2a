"""Ray launcher: the trainer processes of one rljax job (and its rollout servers) as Ray actors.

    python -m rljax.ray_launch [--address auto] --num-processes 2 [--devices-per-process K] \
        [--rollout-nodes R] [--python /venv/bin/python] -- --config=configs/grpo.py --workdir=DIR

One placement group: a bundle per trainer process ({"CPU": 1}; {"CPU": 1, "GPU": K} if RLJAX_PLATFORM=gpu)
and per rollout server, each holding a `ProcessRunner` actor whose subprocess runs `<python> -m rljax.main
ARGS` (or `rljax.rollout.serve`) in the driver's working directory with the environment of
`rljax.process_plan.process_envs` (coordinator: bundle 0's node address, a free port there), output copied
to `<workdir>/logs/rank-<i>.log`. Supervised as by `rljax.launch`: the first non-zero exit or dead actor
ends the others and is the job's code; SIGTERM/SIGUSR1/SIGINT are forwarded. Under `ray job submit` the
address is RAY_ADDRESS. Paths (python, repository, workdir) must be the same on every node, as under Slurm.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from rljax import device_plan
from rljax.config import ConfigError
from rljax.process_plan import (
    FORWARDED_SIGNALS,
    KILL_GRACE_S,
    process_envs,
    rollout_overrides,
    serve_argv,
    wait_healthy,
    workdir_of,
)
from rljax.ray_runner import ProcessRunner
from rljax.rollout import auth
from rljax.runtime import config_from_args

PLACEMENT_TIMEOUT_S = 120.0  # a bundle Ray cannot place within this is a job that cannot start
HEALTH_TIMEOUT_S = 600.0  # a rollout server's start (vLLM loads the model and compiles), as gpu_slurm.sh
POLL_S = 0.5
ACTOR_LOST_EXIT_CODE = 1  # a runner's actor died (ray.kill, its worker or node lost): no exit code to report
# The job's variables, from the driver to every process; each node's environment supplies the rest.
JOB_ENV_PREFIXES = ("RLJAX_", "JAX_", "XLA_", "VLLM_", "HF_", "WANDB_", "TF_CPP_")


class LaunchError(Exception):
    """Bad input: one line `rljax: error: <flag>: <what is valid>`, exit 2."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")


# ------------------------------------------------------------------------------- the plan, as values
def job_env(environ: dict[str, str]) -> dict[str, str]:
    """The driver's variables every process gets (RLJAX_*, JAX_*, XLA_*, ...): the base of the plan."""
    return {k: v for k, v in environ.items() if k.startswith(JOB_ENV_PREFIXES)}


def bundle(devices_per_process: int, gpu: bool) -> dict[str, float]:
    """One process's resources: a CPU, plus its K GPUs on GPU (Ray sets CUDA_VISIBLE_DEVICES to them)."""
    return {"CPU": 1.0, "GPU": float(max(devices_per_process, 1))} if gpu else {"CPU": 1.0}


def placement_strategy(num_processes: int, rollout_nodes: int, num_nodes: int) -> str:
    """STRICT_SPREAD (one process per node, like one Slurm task per node: a process gets a node to itself
    and a lost node costs one) when the cluster has a node per bundle; else PACK (fewest nodes: processes
    that share a node talk over loopback, whole nodes stay free). Rollout servers need nodes of their own."""
    if num_nodes >= num_processes + rollout_nodes:
        return "STRICT_SPREAD"
    if rollout_nodes:
        need = f"{num_processes} trainer + {rollout_nodes} rollout nodes: {num_processes + rollout_nodes}"
        raise LaunchError("--rollout-nodes", f"{need} nodes (a process each); the cluster has {num_nodes}")
    return "PACK"


def trainer_envs(n: int, devices_per_process: int, host: str, port: int, base: dict) -> list[dict[str, str]]:
    """`process_plan.process_envs` with the coordinator at host:port (bundle 0's node). On GPU, Ray gives
    each actor its own GPUs as CUDA_VISIBLE_DEVICES, so a process drives every device it sees."""
    envs = process_envs(n, devices_per_process, port, base, host=host)
    return [{k: v for k, v in env.items() if k != "RLJAX_LOCAL_DEVICE_IDS"} for env in envs]


def new_token_file(workdir: str) -> str:
    """A fresh bearer token in <workdir>/secrets/server_token (directory 0700, file 0600), as gpu_slurm.sh."""
    directory = os.path.join(workdir, "secrets")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)  # an existing directory too: the token is readable by this user only
    return auth.write_token_file(os.path.join(directory, "server_token"), auth.new_token())


def rollout_args(server_urls: list[str], token_file: str, trainer_ips: list[str]) -> list[str]:
    """The trainer's overrides for servers at `server_urls`, tcp weight sync served on each trainer node's
    address (one per host, in rank order)."""
    return rollout_overrides(server_urls, token_file, ",".join(dict.fromkeys(trainer_ips)))


# ------------------------------------------------------------------------------------------ the driver
def supervise(actors: list, trainers: int, signals: list[int]) -> int:
    """Waits for the first `trainers` actors' processes; the job's exit code. The first non-zero exit, dead
    actor or server exit sends SIGTERM to the others (ray.kill after KILL_GRACE_S) and is the code; when all
    trainers exit 0 the servers are stopped. `signals` (from handlers) are forwarded, SIGINT as SIGTERM."""
    import ray

    codes: dict[int, int] = {}  # actor index -> exit code, in the order the exits were seen
    result, ending_at = 0, None
    while len(codes) < len(actors):
        while signals:
            signum = signals.pop(0)
            _signal_running(actors, codes, signal.SIGTERM if signum == signal.SIGINT else signum)
        codes |= _newly_finished(actors, trainers, codes)
        # a server must outlive the trainers: its exit is a failure (0 counts as 1)
        failures = [code or 1 for i, code in codes.items() if code or i >= trainers]
        if ending_at is None and (failures or all(i in codes for i in range(trainers))):
            result, ending_at = (failures or [0])[0], time.monotonic()
            _signal_running(actors, codes, signal.SIGTERM)
        elif ending_at is not None and time.monotonic() - ending_at > KILL_GRACE_S:
            for i in set(range(len(actors))) - set(codes):
                ray.kill(actors[i])  # its child dies with it (PDEATHSIG)
                codes[i] = 128 + signal.SIGKILL
        time.sleep(POLL_S if len(codes) < len(actors) else 0)
    return result


def _name(i: int, trainers: int) -> str:
    return f"rank {i}" if i < trainers else f"server {i - trainers}"


def _newly_finished(actors: list, trainers: int, codes: dict[int, int]) -> dict[int, int]:
    import ray

    refs = {i: a.poll.remote() for i, a in enumerate(actors) if i not in codes}
    done = {}
    for i, ref in refs.items():
        try:
            code = ray.get(ref, timeout=60.0)  # an unreachable node: Ray reports the actor dead soon after
        except ray.exceptions.GetTimeoutError:
            continue
        except ray.exceptions.RayActorError as e:
            _say(f"{_name(i, trainers)}: its Ray actor died ({type(e).__name__})")
            code = ACTOR_LOST_EXIT_CODE
        if code is not None:
            _say(f"{_name(i, trainers)} exited with {code}")
            done[i] = code
    return done


def _signal_running(actors: list, codes: dict[int, int], signum: int) -> None:
    import ray

    refs = [a.send_signal.remote(int(signum)) for i, a in enumerate(actors) if i not in codes]
    ray.wait(refs, num_returns=len(refs), timeout=10.0)


def _say(line: str) -> None:
    print(f"rljax: {line}", file=sys.stderr, flush=True)


def _place(bundles: list[dict[str, float]], strategy: str, timeout_s: float):
    """The placement group of `bundles`, ready; None (and one line) when Ray cannot place it in time."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    if pg.wait(timeout_seconds=timeout_s):
        return pg
    remove_placement_group(pg)
    have = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    cpus, gpus = (sum(r.get(k, 0) for r in have) for k in ("CPU", "GPU"))
    what = f"{len(bundles)} bundles of {bundles[0]} ({strategy}) in {timeout_s:.0f} s"
    _say(f"error: ray: cannot place {what}; the cluster has {len(have)} nodes, {cpus:g} CPUs, {gpus:g} GPUs")


def _actors(pg, bundles: list[dict[str, float]], trainers: int) -> list:
    """A ProcessRunner on each bundle of `pg`, holding the bundle's resources."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actors, remote = [], ray.remote(ProcessRunner)
    for i, b in enumerate(bundles):
        on = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        options = {"num_cpus": b["CPU"], "num_gpus": b.get("GPU", 0), "max_restarts": 0}
        actors.append(remote.options(**options, scheduling_strategy=on).remote(_name(i, trainers)))
    return actors


def _start_servers(servers: list, ips: list[str], python: str, workdir: str, args: list[str]) -> list[str]:
    """A rollout server on each of `servers`' nodes (the last of `ips`), healthy; the trainer's overrides."""
    import ray

    token_file, server_ips = new_token_file(workdir), ips[-len(servers) :]
    ports = ray.get([s.free_port.remote() for s in servers])
    urls = [f"http://{ip}:{port}" for ip, port in zip(server_ips, ports, strict=True)]
    extra = rollout_args(urls, token_file, ips[: -len(servers)])
    for j, (server, ip, port) in enumerate(zip(servers, server_ips, ports, strict=True)):
        argv = serve_argv(python, ip, port, token_file, [*args, *extra])
        log = os.path.join(workdir, "logs", f"vllm-{j}.log")
        ray.get(server.start.remote(argv, job_env(dict(os.environ)), os.getcwd(), log))
    for j, (server, url) in enumerate(zip(servers, urls, strict=True)):
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not wait_healthy(f"{url}/health", 10.0):
            if ray.get(server.poll.remote()) is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rollout server {j} at {url} not healthy: see its logs/vllm-{j}.log")
    _say(f"rollout servers healthy: {', '.join(urls)}")
    return extra


def _run_actors(actors: list, args: list[str], opts: argparse.Namespace) -> int:
    """Servers first (the trainers need their URLs), then the trainers; supervises them all."""
    import ray

    n, workdir = opts.num_processes, workdir_of(args)
    ips = ray.get([a.node_ip.remote() for a in actors])
    try:
        extra = _start_servers(actors[n:], ips, opts.python, workdir, args) if opts.rollout_nodes else []
    except RuntimeError as e:
        _say(f"error: {e}")
        return 1
    port = ray.get(actors[0].free_port.remote())
    envs = trainer_envs(n, opts.devices_per_process, ips[0], port, job_env(dict(os.environ)) | opts.gpu_env)
    for i, (actor, env) in enumerate(zip(actors[:n], envs, strict=True)):
        log = os.path.join(workdir, "logs", f"rank-{i}.log") if workdir else None
        ray.get(actor.start.remote([opts.python, "-m", "rljax.main", *args, *extra], env, os.getcwd(), log))
    _say(f"{n} trainer processes on {', '.join(ips[:n])} (coordinator {ips[0]}:{port})")
    signals: list[int] = []
    main_thread = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    previous = {s: signal.signal(s, lambda n, _: signals.append(n)) for s in FORWARDED_SIGNALS if main_thread}
    try:
        return supervise(actors, n, signals)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_job(args: list[str], opts: argparse.Namespace) -> int:
    import ray
    from ray.util.placement_group import remove_placement_group

    gpu = os.environ.get("RLJAX_PLATFORM", "cpu") == "gpu"
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    strategy = placement_strategy(opts.num_processes, opts.rollout_nodes, nodes)
    bundles = [bundle(opts.devices_per_process, gpu)] * (opts.num_processes + opts.rollout_nodes)
    _say(f"ray: {len(bundles)} bundles of {bundles[0]}, {strategy} over {nodes} nodes")
    pg = _place(bundles, strategy, opts.placement_timeout_s)
    if pg is None:
        return 1
    actors = _actors(pg, bundles, opts.num_processes)
    try:
        return _run_actors(actors, args, opts)
    finally:
        for actor in actors:
            ray.kill(actor)  # a runner's child dies with it (PDEATHSIG): nothing outlives the job
        remove_placement_group(pg)


def run(
    args: list[str],
    address: str = "auto",
    num_processes: int = 1,
    devices_per_process: int = 0,
    rollout_nodes: int = 0,
    python: str | None = None,
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
) -> int:
    """Runs `python -m rljax.main ARGS` as `num_processes` processes of one JAX job on the Ray cluster at
    `address` ("auto": RAY_ADDRESS, or the cluster of this node), with `rollout_nodes` rollout servers on
    nodes of their own; returns the job's exit code. Raises LaunchError for bad input."""
    import ray

    opts = argparse.Namespace(num_processes=num_processes, devices_per_process=devices_per_process)
    opts.rollout_nodes, opts.placement_timeout_s = rollout_nodes, placement_timeout_s
    opts.python = python or sys.executable
    _check(args, opts)
    opts.gpu_env = _planned(args, opts)
    try:
        ray.init(address=address, log_to_driver=True)
    except (ConnectionError, ValueError) as e:
        raise LaunchError("--address", f"no Ray cluster at {address!r} (host:port, or auto): {e}") from None
    try:
        return _run_job(args, opts)
    finally:
        ray.shutdown()


def _check(args: list[str], opts: argparse.Namespace) -> None:
    if opts.num_processes < 1:
        raise LaunchError("--num-processes", f"an integer >= 1, got {opts.num_processes}")
    if min(opts.devices_per_process, opts.rollout_nodes) < 0:
        raise LaunchError("--devices-per-process/--rollout-nodes", "integers >= 0")
    if not (os.path.isfile(opts.python) and os.access(opts.python, os.X_OK)):
        raise LaunchError("--python", f"an executable Python on every node, got {opts.python!r}")
    if not args:
        raise LaunchError("--", "give the rljax.main arguments after --, e.g. -- --config=configs/grpo.py")
    if opts.rollout_nodes and not workdir_of(args):
        raise LaunchError("--rollout-nodes", "needs --workdir in the rljax.main arguments (the token's home)")


def _planned(args: list[str], opts: argparse.Namespace) -> dict[str, str]:
    """On GPU, the device plan's trainer share (`rljax.device_plan`; a process per bundle of K GPUs, rollout
    servers on nodes of their own), unless set: what Slurm and the Kubernetes pods get for the same job."""
    if os.environ.get("RLJAX_PLATFORM") != "gpu" or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return {}
    n, r = opts.num_processes, opts.rollout_nodes
    try:
        plan = device_plan.make_plan(
            config_from_args(args), device_plan.Machine(opts.devices_per_process or 1, n + r, r, "node")
        )
    except ConfigError as e:
        raise LaunchError(f"config: {e.args[0] if e.args else e}", "no device plan fits") from None
    return device_plan.shared_env(plan)


# ------------------------------------------------------------------------------------------------ CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage + message
        flag, _, what = message.removeprefix("argument ").partition(": ")
        raise LaunchError(flag, what)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {text!r}")
    return int(text)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our flags, the rljax.main arguments after `--`). Raises LaunchError."""
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = _Parser(prog="python -m rljax.ray_launch", allow_abbrev=False)
    parser.add_argument("--address", default="auto", help="the Ray cluster: host:port, or auto (RAY_ADDRESS)")
    parser.add_argument("--num-processes", type=_count, default=0, help="trainer processes (>= 1)")
    parser.add_argument("--devices-per-process", type=_count, default=0)
    parser.add_argument("--rollout-nodes", type=_count, default=0)
    parser.add_argument("--python", default=sys.executable, help="the Python of every node (default: this)")
    opts, unknown = parser.parse_known_args(ours)
    if unknown:
        valid = "--address, --num-processes, --devices-per-process, --rollout-nodes, --python"
        raise LaunchError(unknown[0], f"unknown flag; valid: {valid} (rljax.main arguments go after --)")
    return opts, rest


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module doc); bad input is one line `rljax: error: <flag>: <what is valid>`, exit 2."""
    try:
        opts, rest = parse(list(sys.argv[1:] if argv is None else argv))
        return run(rest, **vars(opts))  # address, num_processes, devices_per_process, rollout_nodes, python
    except LaunchError as e:
        print(f"rljax: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
