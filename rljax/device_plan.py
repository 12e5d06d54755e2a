"""One device plan for a job: which process drives which GPUs, with how much of each, before anything starts.

`make_plan(cfg, Machine(gpus_per_node, nodes, rollout_nodes, process_per))` -> `Plan`, from the config and
the machine alone (no JAX, no device touched). Every launcher uses it: the local one (`rljax.launch --gpus`),
Slurm (`launch/gpu_slurm.sh` reads `rljax.launch --plan-env`), Kubernetes and Ray (`shared_env`), a single
`python -m rljax.main` on a GPU box (`planned_trainer_env` before JAX starts, `owned_server_devices` for the
servers the leader owns).
`python -m rljax.launch --plan --gpus=N [--nodes=M] [--rollout-nodes=K] -- <rljax.main args>` prints it.

Modes (G = gpus_per_node; k = tensor_parallel_size x data_parallel_size, the GPUs of one server):
- cpu (G = 0): nothing placed; a CPU server keeps its eager mode.
- colocated (`rollout.vllm.server_gpus` = 0, owned servers): the leader's `num_servers` servers on node 0,
  server i on GPUs [i k, (i+1) k), never two on one GPU; the trainer on every GPU of every node.
- split (`server_gpus` = S > 0, one node): the last S GPUs serve (S / k servers), the trainer keeps G - S.
- rollout nodes (K > 0): the last K nodes each run one server on their first k GPUs (k divides G; the
  plan lists the GPUs left idle); the trainer on the other nodes.
- external (`rollout.vllm.urls`): the servers run elsewhere; the trainer on every GPU.

Memory: JAX preallocates a fixed share of each device it drives when it starts
(XLA_PYTHON_CLIENT_MEM_FRACTION) and never gives it back, and vLLM takes `gpu_memory_utilization` of its
devices' memory: on a device both use, the two must fit. The trainer's share is `mesh.gpu_memory_fraction`,
or planned: `MAX_DEVICE_SHARE` less the share of a server on the same device, at most
`DEFAULT_TRAINER_SHARE`; a process driving several devices takes the smallest of theirs. A device whose
shares sum over `MAX_DEVICE_SHARE` (CUDA context, NCCL and cuBLAS workspaces live outside both) makes the
plan impossible: a `ConfigError` naming the field, like every other impossible plan.
On a GPU a server runs with CUDA graphs (no `--enforce-eager`): eager decoding is several times slower there.
"""

from __future__ import annotations

import dataclasses
import os

from rljax.config import Config, ConfigError

MAX_DEVICE_SHARE = 0.95  # of one GPU's memory, all processes on it together
DEFAULT_TRAINER_SHARE = 0.90  # a trainer device with no server on it
MIN_TRAINER_SHARE = 0.10  # a planned share below this is an error, not a plan
PROCESS_PER = ("gpu", "node")


@dataclasses.dataclass(frozen=True)
class Machine:
    """The hardware a job gets: `gpus_per_node` (0: CPU), `nodes`, the last `rollout_nodes` of them serving
    only, one trainer process per GPU or per node (`process_per`)."""

    gpus_per_node: int = 0
    nodes: int = 1
    rollout_nodes: int = 0
    process_per: str = "gpu"


@dataclasses.dataclass(frozen=True)
class TrainerProcess:
    """One JAX process: its node, its GPUs (indices on the node) and the share of each it preallocates."""

    node: int
    devices: tuple[int, ...]
    memory_fraction: float | None  # None: CPU

    def env(self) -> dict[str, str]:
        """RLJAX_LOCAL_DEVICE_IDS and XLA_PYTHON_CLIENT_MEM_FRACTION (nothing on CPU)."""
        if self.memory_fraction is None:
            return {}
        return {
            "RLJAX_LOCAL_DEVICE_IDS": ",".join(map(str, self.devices)),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{self.memory_fraction:.2f}",
        }


@dataclasses.dataclass(frozen=True)
class Server:
    """One vLLM server: its node, its GPUs, parallel sizes, memory share and whether it decodes eagerly."""

    node: int
    devices: tuple[int, ...]
    tensor_parallel_size: int
    data_parallel_size: int
    gpu_memory_utilization: float
    enforce_eager: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    mode: str
    machine: Machine
    trainers: tuple[TrainerProcess, ...]
    servers: tuple[Server, ...]

    def device_shares(self) -> dict[tuple[int, int], float]:
        """{(node, gpu): the memory share of every process on it, summed}."""
        shares: dict[tuple[int, int], float] = {}
        for t in self.trainers:
            for d in t.devices:
                shares[t.node, d] = shares.get((t.node, d), 0.0) + (t.memory_fraction or 0.0)
        for s in self.servers:
            for d in s.devices:
                shares[s.node, d] = shares.get((s.node, d), 0.0) + s.gpu_memory_utilization
        return shares

    def to_json(self) -> dict:
        shares, m = self.device_shares(), self.machine
        every = [(n, d) for n in range(m.nodes) for d in range(m.gpus_per_node)]
        return {
            "mode": self.mode,
            "machine": dataclasses.asdict(self.machine),
            "trainers": [dataclasses.asdict(t) | {"env": t.env()} for t in self.trainers],
            "servers": [dataclasses.asdict(s) for s in self.servers],
            "device_shares": {f"{n}:{d}": round(v, 4) for (n, d), v in sorted(shares.items())},
            "idle": [f"{n}:{d}" for n, d in every if (n, d) not in shares],
        }


def _mode(cfg: Config, m: Machine) -> str:
    vc = cfg.rollout.vllm
    if m.gpus_per_node == 0:
        return "cpu"
    if vc.urls:
        return "external"
    if m.rollout_nodes:
        return "rollout_nodes"
    return "split" if vc.server_gpus else "colocated"


def _check_machine(cfg: Config, m: Machine) -> None:
    if m.process_per not in PROCESS_PER:
        raise ConfigError("--process-per", f"must be one of {', '.join(PROCESS_PER)}, got {m.process_per!r}")
    if m.gpus_per_node < 0 or m.nodes < 1 or not 0 <= m.rollout_nodes < m.nodes:
        raise ConfigError(
            "--rollout-nodes",
            f"{m.rollout_nodes} rollout nodes of {m.nodes} (>= 1) nodes with {m.gpus_per_node} GPUs each: "
            "at least one node must train",
        )
    vc = cfg.rollout.vllm
    if vc.server_gpus and (vc.urls or m.rollout_nodes or m.nodes > 1):
        raise ConfigError(
            "rollout.vllm.server_gpus",
            f"{vc.server_gpus} GPUs for owned servers on one node; with rollout.vllm.urls, rollout nodes or "
            "several nodes, set it to 0 (use rollout nodes to serve from nodes of their own)",
        )


def _servers(cfg: Config, m: Machine, mode: str) -> tuple[Server, ...]:
    vc, g = cfg.rollout.vllm, m.gpus_per_node
    k = vc.tensor_parallel_size * vc.data_parallel_size
    size = f"tensor_parallel_size x data_parallel_size = {k} GPU(s) a server"
    if mode in ("cpu", "external"):
        return ()
    if mode == "rollout_nodes":
        if g % k:
            raise ConfigError(
                "rollout.vllm.tensor_parallel_size", f"{size} does not divide a rollout node's {g} GPUs"
            )
        nodes, first = range(m.nodes - m.rollout_nodes, m.nodes), [0]
    elif mode == "split":
        if vc.server_gpus >= g:
            raise ConfigError(
                "rollout.vllm.server_gpus", f"{vc.server_gpus} of the node's {g} GPUs leaves the trainer none"
            )
        if vc.server_gpus != vc.num_servers * k:
            raise ConfigError(
                "rollout.vllm.num_servers",
                f"{vc.num_servers} server(s) x {size} do not fill rollout.vllm.server_gpus={vc.server_gpus}",
            )
        nodes, first = [0], range(g - vc.server_gpus, g, k)
    else:  # colocated
        if vc.num_servers * k > g:
            raise ConfigError(
                "rollout.vllm.num_servers",
                f"{vc.num_servers} server(s) x {size} need {vc.num_servers * k} GPUs; a node has {g} "
                "(servers never share a GPU)",
            )
        nodes, first = [0], range(0, vc.num_servers * k, k)
    sizes = (vc.tensor_parallel_size, vc.data_parallel_size, vc.gpu_memory_utilization)
    return tuple(Server(n, tuple(range(f, f + k)), *sizes, enforce_eager=False) for n in nodes for f in first)


def _trainer_devices(cfg: Config, m: Machine, mode: str) -> list[tuple[int, tuple[int, ...]]]:
    """(node, devices) of each trainer process, node-major."""
    train_nodes = m.nodes - m.rollout_nodes
    keep = m.gpus_per_node - (cfg.rollout.vllm.server_gpus if mode == "split" else 0)
    if mode == "cpu":
        return [(n, ()) for n in range(train_nodes)]
    if m.process_per == "node":
        return [(n, tuple(range(keep))) for n in range(train_nodes)]
    return [(n, (d,)) for n in range(train_nodes) for d in range(keep)]


def _trainer_share(cfg: Config, node: int, devices: tuple[int, ...], servers: tuple[Server, ...]) -> float:
    if cfg.mesh.gpu_memory_fraction:
        return cfg.mesh.gpu_memory_fraction
    shared = [s.gpu_memory_utilization for s in servers if s.node == node and set(s.devices) & set(devices)]
    share = min([DEFAULT_TRAINER_SHARE, *(MAX_DEVICE_SHARE - u for u in shared)])
    if share < MIN_TRAINER_SHARE:
        raise ConfigError(
            "rollout.vllm.gpu_memory_utilization",
            f"{max(shared)} of a GPU the trainer shares leaves it {share:.2f} (< {MIN_TRAINER_SHARE}); "
            f"lower it, or give the servers GPUs of their own (rollout.vllm.server_gpus)",
        )
    return round(share, 4)


def make_plan(cfg: Config, machine: Machine) -> Plan:
    """The plan for `cfg` on `machine`; ConfigError (field, what would be valid) when none fits."""
    _check_machine(cfg, machine)
    mode = _mode(cfg, machine)
    servers = _servers(cfg, machine, mode)
    trainers = tuple(
        TrainerProcess(n, devs, None if mode == "cpu" else _trainer_share(cfg, n, devs, servers))
        for n, devs in _trainer_devices(cfg, machine, mode)
    )
    plan = Plan(mode, machine, trainers, servers)
    for (node, gpu), share in plan.device_shares().items():
        if share > MAX_DEVICE_SHARE + 1e-9:
            raise ConfigError(
                "mesh.gpu_memory_fraction",
                f"GPU {gpu} of node {node}: the trainer's {cfg.mesh.gpu_memory_fraction} and the server's "
                f"{cfg.rollout.vllm.gpu_memory_utilization} sum to {share:.2f} > {MAX_DEVICE_SHARE}",
            )
    return plan


GPUS_ENV = "RLJAX_GPUS_PER_NODE"


def detect_gpus(environ=os.environ) -> int:
    """GPUs this node gives the job: RLJAX_GPUS_PER_NODE, else CUDA_VISIBLE_DEVICES' count, else the NVIDIA
    driver's (/proc/driver/nvidia/gpus), else 0. Reads no device: safe before JAX starts."""
    if environ.get(GPUS_ENV):
        return int(environ[GPUS_ENV])
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    root = "/proc/driver/nvidia/gpus"
    return len(os.listdir(root)) if os.path.isdir(root) else 0


def visible_devices(devices: tuple[int, ...], environ=os.environ) -> str:
    """CUDA_VISIBLE_DEVICES for a child that should see the node's GPUs `devices` (indices among those this
    process sees: through its own CUDA_VISIBLE_DEVICES when it has one)."""
    parent = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(parent[d] if parent else str(d) for d in devices)


def local_plan(cfg: Config, environ=os.environ) -> Plan:
    """The plan of a job on this one node (`detect_gpus`): what a single `python -m rljax.main`, or the
    leader starting its own servers, follows."""
    return make_plan(cfg, Machine(gpus_per_node=detect_gpus(environ)))


def shared_env(plan: Plan) -> dict[str, str]:
    """What every trainer process gets where a launcher cannot give each its own environment (Slurm's
    script, one pod template, Ray): the smallest planned share. Empty on CPU."""
    shares = [t.memory_fraction for t in plan.trainers if t.memory_fraction is not None]
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{min(shares):.2f}"} if shares else {}


def owned_server_devices(plan: Plan) -> tuple[int, ...]:
    """The GPUs of node 0's servers in order (`ServerOptions.devices`); () on CPU or for servers elsewhere."""
    if plan.mode not in ("colocated", "split"):
        return ()
    return tuple(d for s in plan.servers for d in s.devices)


def planned_trainer_env(cfg: Config, environ=os.environ) -> dict[str, str]:
    """XLA_PYTHON_CLIENT_MEM_FRACTION for a single process started by hand on a GPU node, unless set: a
    launcher sets it for each process it starts. Empty on CPU. ConfigError when no plan fits this node."""
    plan = local_plan(cfg, environ)
    launched = "XLA_PYTHON_CLIENT_MEM_FRACTION" in environ or environ.get("RLJAX_PROCESS_ID") is not None
    return {} if launched else shared_env(plan)
