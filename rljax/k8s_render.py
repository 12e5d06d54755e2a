"""The Kubernetes manifests of one rljax job: core kinds only, one file each, and a kustomization over them.

`render(args, job)` -> {file name: [resource]}:
- `trainer-job.yaml`: an indexed `batch/v1` Job, one pod per JAX process (`completions = parallelism =
  num_processes`, `backoffLimit: 0`: one failed pod fails the job and Kubernetes deletes the others), each
  running `python -m rljax.main <args>`. Every pod's environment is the launcher's process plan
  (`rljax.process_plan.process_envs`, as `rljax.launch` runs it) with the coordinator at `<job>-0.<job>`; the
  two values Kubernetes supplies come from the downward API: RLJAX_PROCESS_ID is the pod's completion index,
  and the coordinator binds the pod's own IP (POD_IP, `status.podIP`: the address the coordinator's DNS
  name resolves to, so, like the local launcher, it listens only where the others dial, and needs no DNS
  record of its own to start).
- `trainer-service.yaml`: the headless Service (the pods' `subdomain`) that gives each pod the DNS name
  `<job>-<index>.<job>`, with the coordinator port; it publishes pods before they are ready.
- `token-secret.yaml`, `rollout-job.yaml`, `rollout-service.yaml` (`--rollout-servers R` > 0): R pods of
  `python -m rljax.rollout.serve` (an indexed Job `<job>-rollout`, DNS `<job>-rollout-<i>.<job>-rollout`), the
  job's bearer token (256 random bits) as a Secret mounted as one 0600 file (`subPath`: a regular file, not
  the volume's symlink, which the token reader refuses), and the trainer's overrides for them as in
  launch/gpu_slurm.sh (`rollout.vllm.urls`, `.token_file`, `.allow_remote`, tcp weight sync from each pod's
  IP); trainer pods wait for each server's /health in an init container.
The workdir lives on a ReadWriteMany PVC mounted at the workdir's path in every pod. On GPUs
(`gpus_per_pod` > 0) the device plan (`rljax.device_plan`, one process per pod driving its GPUs) gives
RLJAX_LOCAL_DEVICE_IDS, the memory share (the smallest of the job's: one template serves every pod, as
the Slurm launcher's job-wide share) and each server's GPUs.
"""

from __future__ import annotations

import base64
import dataclasses
import os

from rljax import device_plan, k8s_yaml, process_plan
from rljax.config import ConfigError
from rljax.rollout import auth
from rljax.runtime import config_from_args

INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
SUPPLIED = ("RLJAX_PROCESS_ID", "JAX_COORDINATOR_BIND_ADDRESS")  # per pod, from the downward API
TOKEN_PATH = "/var/run/rljax/server_token"  # the token file in every pod that reads it
ROLLOUT_PORT = 8000  # as launch/gpu_slurm.sh's RLJAX_VLLM_PORT
GRACE_S = 120  # SIGTERM to SIGKILL: a preempted trainer saves first (Slurm's --signal=B:USR1@120)
WAIT_S = 1800  # how long a trainer pod waits for a rollout server's /health


@dataclasses.dataclass(frozen=True)
class K8sJob:
    """What the flags say about the job (`rljax.k8s_launch.parse` checks them)."""

    name: str = "rljax"
    num_processes: int = 1
    devices_per_process: int = 0  # simulated CPU devices per process
    gpus_per_pod: int = 0
    image: str = "rljax"
    pvc: str = "rljax-runs"
    node_selector: tuple[tuple[str, str], ...] = ()
    rollout_servers: int = 0
    port: int = 8476
    python: str = "python"


def workdir_of(args: list[str]) -> str:
    """The --workdir value in rljax.main arguments ("" when absent)."""
    return process_plan.workdir_of(args) or ""


def _labels(job: K8sJob, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rljax",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/component": component,
    }


def _rollout_name(job: K8sJob) -> str:
    return f"{job.name}-rollout"


def rollout_urls(job: K8sJob) -> list[str]:
    svc = _rollout_name(job)
    return [f"http://{svc}-{i}.{svc}:{ROLLOUT_PORT}" for i in range(job.rollout_servers)]


def rollout_args(job: K8sJob) -> list[str]:
    """The trainer's overrides for the job's rollout servers (launch/gpu_slurm.sh's ROLLOUT_ARGS); tcp
    weight sync served on `$(POD_IP)`, which Kubernetes expands to each pod's own IP."""
    if not job.rollout_servers:
        return []
    return process_plan.rollout_overrides(rollout_urls(job), TOKEN_PATH, "$(POD_IP)")


def make_plan(args: list[str], job: K8sJob) -> device_plan.Plan | None:
    """The device plan (one pod a node, the rollout pods the last nodes); None on CPU. ConfigError."""
    if not job.gpus_per_pod:
        return None
    machine = device_plan.Machine(
        job.gpus_per_pod, job.num_processes + job.rollout_servers, job.rollout_servers, "node"
    )
    return device_plan.make_plan(config_from_args(args), machine)


def trainer_env(job: K8sJob, plan: device_plan.Plan | None) -> list[dict]:
    """The trainer container's env list: the process plan's variables shared by every pod, then the
    per-pod ones from the downward API."""
    base = {"RLJAX_PLATFORM": "cpu"}
    if plan is not None:
        smallest = min(plan.trainers, key=lambda t: t.memory_fraction)
        base = {"RLJAX_PLATFORM": "gpu", device_plan.GPUS_ENV: str(job.gpus_per_pod)} | smallest.env()
    devices = 0 if plan is not None else job.devices_per_process  # a pod's GPUs are its own 0..G-1
    host = f"{job.name}-0.{job.name}"
    envs = [
        {k: v for k, v in env.items() if k not in SUPPLIED}
        for env in process_plan.process_envs(job.num_processes, devices, job.port, base, host=host)
    ]
    if any(env != envs[0] for env in envs):
        raise ValueError("the process plan differs between pods beyond the process id: one pod template")
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RLJAX_PROCESS_ID", "valueFrom": {"fieldRef": {"fieldPath": INDEX_FIELD}}},
        {"name": "JAX_COORDINATOR_BIND_ADDRESS", "value": f"$(POD_IP):{job.port}"},
        *({"name": k, "value": v} for k, v in sorted(envs[0].items())),
    ]


def _volumes(job: K8sJob, workdir: str) -> tuple[list[dict], list[dict]]:
    """(volumes, volume mounts) of a pod: the workdir's PVC, a memory /dev/shm, the token if any."""
    volumes = [
        {"name": "workdir", "persistentVolumeClaim": {"claimName": job.pvc}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # the runtime's 64 MiB is too small for NCCL
    ]
    mounts = [{"name": "workdir", "mountPath": workdir}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if job.rollout_servers:
        secret = {"secretName": f"{job.name}-token", "defaultMode": 0o600}
        volumes.append({"name": "token", "secret": secret})
        name = os.path.basename(TOKEN_PATH)
        mounts.append({"name": "token", "mountPath": TOKEN_PATH, "subPath": name, "readOnly": True})
    return volumes, mounts


def _container(job: K8sJob, name: str, command: list[str], env: list[dict], gpus: int, mounts) -> dict:
    container = {"name": name, "image": job.image, "command": command, "env": env}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return container | {"volumeMounts": mounts}


def _indexed_job(job: K8sJob, name: str, component: str, count: int, pod: dict) -> dict:
    labels = _labels(job, component)
    spec = {"restartPolicy": "Never", "subdomain": name, "terminationGracePeriodSeconds": GRACE_S} | pod
    if job.node_selector:
        spec["nodeSelector"] = dict(job.node_selector)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": count,
            "parallelism": count,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


def _headless_service(job: K8sJob, name: str, component: str, port: int, port_name: str) -> dict:
    labels = _labels(job, component)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # DNS before readiness: the coordinator is dialled at start
            "selector": labels,
            "ports": [{"name": port_name, "port": port, "targetPort": port}],
        },
    }


def trainer_job(args: list[str], job: K8sJob, env: list[dict], gpus: int) -> dict:
    volumes, mounts = _volumes(job, workdir_of(args))
    command = [job.python, "-m", "rljax.main", *args]
    trainer = _container(job, "trainer", command, env, gpus, mounts)
    trainer["ports"] = [{"name": "coordinator", "containerPort": job.port}]
    pod = {"containers": [trainer], "volumes": volumes}
    if job.rollout_servers:  # rljax.launch --wait-url: what launch/gpu_slurm.sh waits with
        pod["initContainers"] = [
            {
                "name": f"wait-rollout-{i}",
                "image": job.image,
                "command": [job.python, "-m", "rljax.launch", "--wait-url", f"{url}/health"]
                + ["--timeout", str(WAIT_S)],
            }
            for i, url in enumerate(rollout_urls(job))
        ]
    return _indexed_job(job, job.name, "trainer", job.num_processes, pod)


def rollout_job(args: list[str], job: K8sJob, gpus: int) -> dict:
    volumes, mounts = _volumes(job, workdir_of(args))
    command = process_plan.serve_argv(job.python, "$(POD_IP)", ROLLOUT_PORT, TOKEN_PATH, args)
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    server = _container(job, "server", command, env, gpus, mounts)
    server["ports"] = [{"name": "http", "containerPort": ROLLOUT_PORT}]
    server["readinessProbe"] = {"httpGet": {"path": "/health", "port": ROLLOUT_PORT}, "periodSeconds": 10}
    pod = {"containers": [server], "volumes": volumes}
    return _indexed_job(job, _rollout_name(job), "rollout", job.rollout_servers, pod)


def token_secret(job: K8sJob) -> dict:
    token = auth.new_token()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{job.name}-token", "labels": _labels(job, "token")},
        "type": "Opaque",
        "data": {os.path.basename(TOKEN_PATH): base64.b64encode(token.encode()).decode()},
    }


def render(args: list[str], job: K8sJob) -> dict[str, list[dict]]:
    """{file name: [resource]} of the job that runs `python -m rljax.main <args>` as `job` says, each
    pod's environment from `rljax.process_plan.process_envs`. ConfigError when no device plan
    fits the GPUs."""
    plan = make_plan(args, job)
    trainer_args = [*args, *rollout_args(job)]
    env = trainer_env(job, plan)
    gpus = len(plan.trainers[0].devices) if plan else 0
    out = {
        "trainer-job.yaml": [trainer_job(trainer_args, job, env, gpus)],
        "trainer-service.yaml": [_headless_service(job, job.name, "trainer", job.port, "coordinator")],
    }
    if job.rollout_servers:
        if plan is not None and not plan.servers:
            raise ConfigError("--rollout-servers", "the servers of rollout.vllm.urls run elsewhere: use 0")
        server_gpus = len(plan.servers[0].devices) if plan else 0
        out["token-secret.yaml"] = [token_secret(job)]
        out["rollout-job.yaml"] = [rollout_job(trainer_args, job, server_gpus)]
        name = _rollout_name(job)
        out["rollout-service.yaml"] = [_headless_service(job, name, "rollout", ROLLOUT_PORT, "http")]
    return out


HEADER = "Rendered by rljax.k8s_launch (docs/launch.md, Kubernetes); apply with: kubectl apply -k <this dir>"


def write(manifests: dict[str, list[dict]], directory: str) -> list[str]:
    """Writes each file (the token's with mode 0600) and `kustomization.yaml` listing them; the paths."""
    os.makedirs(directory, exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(manifests),
    }
    paths = []
    for name, documents in {**manifests, "kustomization.yaml": [kustomization]}.items():
        path = os.path.join(directory, name)
        mode = 0o600 if any(d.get("kind") == "Secret" for d in documents) else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.fchmod(fd, mode)  # a file left by an earlier render keeps its mode otherwise
        with os.fdopen(fd, "w") as f:
            f.write(k8s_yaml.dump(documents, HEADER))
        paths.append(path)
    return paths
