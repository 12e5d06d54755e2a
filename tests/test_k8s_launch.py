"""rljax.k8s_launch: manifests that validate against Kubernetes' own schemas, pod environments that are the
launcher's process plan, the `k8s-local` rehearsal running a real 2-process job, one-line flag errors."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import time

import pytest
from jax_env import CACHE_ENV, xla_flags

from rljax import device_plan, k8s_launch, k8s_local, k8s_render, k8s_yaml, process_plan
from rljax.runtime import config_from_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The oldest Kubernetes we render for (indexed Jobs with pod host names are GA since 1.24; 1.30 is the
# oldest schema kubernetes-validate ships that managed clusters still run) and the newest it ships.
K8S_VERSIONS = ("1.30.0", None)
SMOKE = ["--config=configs/grpo.py:smoke", "--workdir=/runs/smoke"]


def rendered(tmp_path, *flags: str, args=SMOKE) -> tuple[str, list[dict]]:
    directory = str(tmp_path / "k8s")
    assert k8s_launch.main(["--render", directory, *flags, "--", *args]) == 0
    return directory, k8s_local.load_dir(directory)


def trainer_job(resources: list[dict]) -> dict:
    (job,) = [r for r in resources if r["kind"] == "Job" and r["metadata"]["name"] == "rljax"]
    return job


GPU_ROLLOUT = (
    "--num-processes",
    "2",
    "--gpus-per-pod",
    "8",
    "--rollout-servers",
    "2",
    "--image",
    "reg/rljax:1",
)
GPU_ROLLOUT += ("--node-selector", "nvidia.com/gpu.product=H100", "--node-selector", "pool=train")


@pytest.mark.parametrize(
    "flags", [("--num-processes", "2", "--devices-per-process", "2"), GPU_ROLLOUT], ids=["cpu", "gpu-rollout"]
)
def test_manifests_validate_strictly_against_kubernetes_schemas(tmp_path, flags):
    pytest.importorskip("kubernetes_validate")
    import yaml

    directory, resources = rendered(tmp_path, *flags)
    files = [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f != "kustomization.yaml"]
    for version in K8S_VERSIONS:
        cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", *(["-k", version] if version else [])]
        out = subprocess.run([*cmd, *files], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("passed for resource") == len(resources), out.stdout
    for name in [*os.listdir(directory)]:  # our YAML is YAML: PyYAML reads what the rehearsal reads
        text = open(os.path.join(directory, name)).read()
        assert list(yaml.safe_load_all(text)) == k8s_yaml.load(text), name
    kinds = sorted(f"{r['apiVersion']}/{r['kind']}" for r in resources)
    expected = ["batch/v1/Job", "v1/Service"] * (2 if "--rollout-servers" in flags else 1)
    assert kinds == sorted(expected + (["v1/Secret"] if "--rollout-servers" in flags else [])), kinds


def test_strict_validation_rejects_an_unknown_field(tmp_path):
    """The check above can fail: a misspelt field in the pod spec does not pass."""
    pytest.importorskip("kubernetes_validate")
    directory, resources = rendered(tmp_path)
    job = trainer_job(resources)
    job["spec"]["template"]["spec"]["subDomain"] = "rljax"
    path = tmp_path / "bad.yaml"
    path.write_text(k8s_yaml.dump([job]))
    out = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", str(path)], capture_output=True
    )
    assert out.returncode != 0


def test_trainer_job_shape(tmp_path):
    directory, resources = rendered(tmp_path, *GPU_ROLLOUT)
    job = trainer_job(resources)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never" and pod["subdomain"] == "rljax"
    (service,) = [r for r in resources if r["kind"] == "Service" and r["metadata"]["name"] == "rljax"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    (trainer,) = pod["containers"]
    assert trainer["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100", "pool": "train"}
    assert {m["mountPath"] for m in trainer["volumeMounts"]} >= {"/runs/smoke", k8s_render.TOKEN_PATH}
    assert trainer["command"][:3] == ["python", "-m", "rljax.main"]
    assert trainer["command"][3:] == [
        *SMOKE,
        *k8s_render.rollout_args(k8s_launch.parse(["--render=d", *GPU_ROLLOUT], SMOKE)[0]),
    ]
    (rollout,) = [r for r in resources if r["metadata"]["name"] == "rljax-rollout" and r["kind"] == "Job"]
    (server,) = rollout["spec"]["template"]["spec"]["containers"]
    assert server["command"][:4] == ["python", "-m", "rljax.rollout.serve", "--host"]
    assert server["resources"] == {"limits": {"nvidia.com/gpu": 1}}  # the smoke config's TP x DP
    assert os.stat(os.path.join(directory, "token-secret.yaml")).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("devices", [0, 2])
def test_each_pod_env_is_the_process_plan_but_for_what_kubernetes_supplies(tmp_path, devices):
    port = 23456
    flags = ("--num-processes", "3", "--devices-per-process", str(devices), "--port", str(port))
    _, resources = rendered(tmp_path, *flags)
    (container,) = trainer_job(resources)["spec"]["template"]["spec"]["containers"]
    plan = process_plan.process_envs(3, devices, port, {"RLJAX_PLATFORM": "cpu"}, host="rljax-0.rljax")
    for index, expected in enumerate(plan):
        env = k8s_local.container_env(container, index)
        assert env.pop("POD_IP") == "127.0.0.1"  # status.podIP in the rehearsal
        assert env.pop("JAX_COORDINATOR_BIND_ADDRESS") == f"127.0.0.1:{port}"  # $(POD_IP):port
        expected.pop("JAX_COORDINATOR_BIND_ADDRESS")
        assert env == expected  # RLJAX_PROCESS_ID from the completion index, the rest as planned


def test_gpu_pods_get_the_device_plan(tmp_path):
    _, resources = rendered(tmp_path, "--num-processes", "2", "--gpus-per-pod", "4")
    (container,) = trainer_job(resources)["spec"]["template"]["spec"]["containers"]
    envs = [k8s_local.container_env(container, i) for i in range(2)]
    # the smallest share of the job: pod 0's, next to the server its leader owns (one template for all)
    share = device_plan.MAX_DEVICE_SHARE - config_from_args(SMOKE).rollout.vllm.gpu_memory_utilization
    assert [e["RLJAX_PROCESS_ID"] for e in envs] == ["0", "1"]
    for env in envs:  # each pod's own GPUs; the trainer's share next to the leader's owned server
        assert env["RLJAX_PLATFORM"] == "gpu" and env["RLJAX_LOCAL_DEVICE_IDS"] == "0,1,2,3"
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{share:.2f}"


def test_rollout_token_is_materialised_privately(tmp_path):
    directory, resources = rendered(tmp_path, "--rollout-servers", "1")
    pod = trainer_job(resources)["spec"]["template"]["spec"]
    secrets = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Secret"}
    root = tmp_path / "secrets"
    root.mkdir(mode=0o700)
    paths = k8s_local.materialise_secrets(pod, pod["containers"][0], secrets, str(root))
    local = paths[k8s_render.TOKEN_PATH]
    assert stat.S_IMODE(os.stat(local).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(local)).st_mode) == 0o700
    (secret,) = secrets.values()
    token = base64.b64decode(secret["data"]["server_token"]).decode()
    assert len(base64.urlsafe_b64decode(token + "=")) == 32  # 256 random bits
    assert open(local).read() == token
    assert k8s_launch.main(["--local", "--rollout-servers", "1", "--", *SMOKE]) == 2


def test_first_failed_pod_ends_the_others():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    t0 = time.monotonic()
    assert process_plan.wait_all([sleeper, failing], grace_s=5.0) == 3
    assert time.monotonic() - t0 < 30 and sleeper.returncode is not None


def metric_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [int(json.loads(line)["step"]) for line in open(path) if line.strip()]


@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_k8s_local_rehearsal_runs_grpo_smoke_in_two_pods(tmp_path, arith_server, monkeypatch):
    """The rendered trainer-only job, run from its files: 2 pods join one JAX job and train 2 steps,
    rolling out on the test run's tiny_arith server (`rollout.vllm.urls`: no server start of its own)."""
    monkeypatch.chdir(REPO)  # the image's working directory: configs/ is relative to it
    workdir = tmp_path / "run"
    args = ["--config=configs/grpo.py:smoke", f"--workdir={workdir}", *arith_server.main_args()]
    args += ["--config.trainer.steps=2", "--config.trainer.eval_every=0"]
    image_env = {k: os.environ[k] for k in k8s_local.IMAGE_ENV if k in os.environ}
    image_env |= {"XLA_FLAGS": xla_flags(), **CACHE_ENV}  # quick compiles, the run's compilation cache
    image_env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    directory = str(tmp_path / "k8s")
    flags = ["--render", directory, "--local", "--num-processes", "2", "--devices-per-process", "1"]
    t0 = time.monotonic()
    code = k8s_launch.main([*flags, "--", *args], image_env=image_env)
    print(f"k8s-local rehearsal: exit {code} in {time.monotonic() - t0:.0f} s")
    logs = {r: open(workdir / "logs" / f"rank-{r}.log").read() for r in range(2)}
    assert code == 0, "\n".join(f"== rank {r}\n{text[-3000:]}" for r, text in logs.items())
    for rank, text in logs.items():
        assert f"rljax: process {rank} of 2, 1 local devices" in text
    assert "finished 2 steps" in logs[0]
    assert max(metric_steps(workdir)) == 2
    assert os.path.exists(os.path.join(directory, "trainer-job.yaml"))  # rendered, then rehearsed


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--num-processes", "0"], "--num-processes"),
        (["--num-processes", "two"], "--num-processes"),
        (["--name", "Bad_Name"], "--name"),
        (["--node-selector", "pool"], "--node-selector"),
        (["--port", "70000"], "--port"),
        (["--gpus-per-pod", "2", "--devices-per-process", "2"], "--devices-per-process"),
        (["--local", "--gpus-per-pod", "1"], "--gpus-per-pod"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, flags, flag):
    assert k8s_launch.main(["--render", str(tmp_path), *flags, "--", *SMOKE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rljax: error: {flag}: "), err
    assert not os.listdir(tmp_path)  # nothing rendered


def test_relative_workdir_and_missing_render_are_refused(capsys):
    assert k8s_launch.main(["--render", "/tmp/x", "--", "--workdir=run"]) == 2
    assert k8s_launch.main(["--", *SMOKE]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[2].strip() for line in lines] == ["--workdir", "--render"], lines
