"""The `k8s-local` rehearsal: a rendered job's trainer pods run as local processes, from the files alone.

`run_local(render_dir)` reads `kustomization.yaml` and the manifests it lists, and for each index of the
trainer Job runs the container's command (`$(VAR)` expanded as the kubelet does) with the environment the
manifest gives that pod, over the image's (`image_env`: by default this machine's PATH, HOME, locale and
TMPDIR). Kubernetes' part is played locally: the downward API's completion index is the pod's index and
its `status.podIP` is 127.0.0.1; the trainer Service's pod DNS names (`<job>-<i>.<service>`) are
127.0.0.1; each Secret volume is materialised in a private 0700 temporary directory as 0600 files and its
mount path rewritten to them; the workdir's PVC is this machine's file system at the same path. Logs go to
`<workdir>/logs/rank-<i>.log`. As with `backoffLimit: 0`, the first pod to fail ends the others (SIGTERM,
SIGKILL after the pod's terminationGracePeriodSeconds) and its exit code is the job's.
Rollout-server pods are not rehearsed: a job rendered with them is refused (exit 2).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import tempfile

from rljax import k8s_yaml, process_plan
from rljax.config import ConfigError

IMAGE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")  # what an image's environment supplies
POD_IP = "127.0.0.1"
FIELDS = {
    "status.podIP": lambda index: POD_IP,
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": str,
}


def load_dir(render_dir: str) -> list[dict]:
    """Every resource of the kustomization in `render_dir`."""
    (kustomization,) = k8s_yaml.load(open(os.path.join(render_dir, "kustomization.yaml")).read())
    resources = []
    for name in kustomization["resources"]:
        resources += k8s_yaml.load(open(os.path.join(render_dir, name)).read())
    return resources


def expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` references to `env` replaced, as Kubernetes does in env values, command and args (`$$`
    escapes a `$`; an unknown reference stays as written)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def container_env(container: dict, index: int) -> dict[str, str]:
    """The environment the manifest gives `container` in the pod of completion index `index`."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            path = var["valueFrom"].get("fieldRef", {}).get("fieldPath")
            if path not in FIELDS:
                raise ConfigError(var["name"], f"the rehearsal supplies only the fields {sorted(FIELDS)}")
            env[var["name"]] = FIELDS[path](index)
        else:
            env[var["name"]] = expand(var.get("value", ""), env)
    return env


def materialise_secrets(pod: dict, container: dict, secrets: dict[str, dict], root: str) -> dict[str, str]:
    """Writes each Secret volume `container` mounts into `root` (0600 files); {mount path: local path}."""
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    paths = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volumes:
            continue
        folder = os.path.join(root, mount["name"])
        os.makedirs(folder, mode=0o700, exist_ok=True)
        for key, value in secrets[volumes[mount["name"]]].get("data", {}).items():
            path = os.path.join(folder, key)
            if not os.path.exists(path):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(base64.b64decode(value))
        sub = mount.get("subPath")
        paths[mount["mountPath"]] = os.path.join(folder, sub) if sub else folder
    return paths


def localise(text: str, names: dict[str, str]) -> str:
    """`text` with each name of `names` (DNS names, mount paths) replaced by its local stand-in."""
    for name in sorted(names, key=len, reverse=True):  # a whole name only: not a prefix of a longer one
        pattern = rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.\w)"
        text = re.sub(pattern, lambda _, new=names[name]: new, text)
    return text


def _pod_dns(job: dict, services: set[str]) -> dict[str, str]:
    """{each trainer pod's DNS name: 127.0.0.1} (`<hostname>.<subdomain>`, short and qualified)."""
    spec = job["spec"]
    subdomain = spec["template"]["spec"].get("subdomain")
    if subdomain not in services:
        return {}
    hosts = [f"{job['metadata']['name']}-{i}.{subdomain}" for i in range(spec["completions"])]
    return {f"{h}{suffix}": POD_IP for h in hosts for suffix in ("", ".svc.cluster.local")}


def pod_commands(resources: list[dict], root: str, image_env: dict[str, str]) -> list[tuple[list, dict]]:
    """(argv, environment) of each trainer pod, in index order, with Secrets written under `root`."""
    jobs = [r for r in resources if r["kind"] == "Job"]
    roles = [j["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") for j in jobs]
    if roles != ["trainer"]:
        raise ConfigError("--rollout-servers", f"the rehearsal runs trainer pods only, got jobs {roles}")
    (job,) = jobs
    services = {r["metadata"]["name"] for r in resources if r["kind"] == "Service"}
    secrets = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Secret"}
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    names = _pod_dns(job, services) | materialise_secrets(pod, container, secrets, root)
    out = []
    for index in range(job["spec"]["completions"]):
        env = {k: localise(v, names) for k, v in container_env(container, index).items()}
        argv = [localise(expand(a, env), names) for a in container["command"] + container.get("args", [])]
        out.append((argv, image_env | env))
    return out


def workdir_of(resources: list[dict]) -> str:
    """The mount path of the trainer pods' PersistentVolumeClaim: the job's workdir."""
    (job,) = [r for r in resources if r["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    claims = {v["name"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    (path,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims]
    return path


def run_local(render_dir: str, image_env: dict[str, str] | None = None, cwd: str | None = None) -> int:
    """Runs the trainer pods of the job rendered in `render_dir` on this machine (see the module doc);
    returns the job's exit code. `image_env`: the image's environment under the pods' (default: IMAGE_ENV
    from this process); `cwd`: the image's working directory (default: this one)."""
    resources = load_dir(render_dir)
    if image_env is None:
        image_env = {k: os.environ[k] for k in IMAGE_ENV if k in os.environ}
    logdir = os.path.join(workdir_of(resources), "logs")
    os.makedirs(logdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="rljax-k8s-secrets-")  # mode 0700
    procs: list[subprocess.Popen] = []
    try:
        commands = pod_commands(resources, root, image_env)
        (job,) = [r for r in resources if r["kind"] == "Job"]
        grace = float(job["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30))
        for rank, (argv, env) in enumerate(commands):
            with open(os.path.join(logdir, f"rank-{rank}.log"), "a") as log:
                procs.append(subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
        code = process_plan.wait_all(procs, grace)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(root, ignore_errors=True)
    where = f"logs: {logdir}/rank-<i>.log"
    print(
        f"rljax: k8s-local job {'succeeded' if code == 0 else f'failed ({code})'}; {where}", file=sys.stderr
    )
    return code
