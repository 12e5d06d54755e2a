"""The control plane as an attacker meets it: vLLM routes, the bearer token, binds, files and processes.

Without a server: the token middleware's decisions, token files, redaction, the bind checks, the
loopback JAX coordinator of rljax.launch (two real JAX processes) and index file names. With a real vLLM
server (`vllm`): unauthenticated RL routes are refused while the trainer's own sync passes the canary,
the token is on no command line, a token holder still cannot make the worker map a file outside its
staging root or switch validation off; and a SIGKILLed trainer (a real `rljax.main` with its own server)
leaves no vLLM process and no bucket file behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import requests
from jax_env import child_env
from vllm_server import assert_serves_reference, perturbed

from rljax import config as C
from rljax import launch
from rljax.rollout import auth
from rljax.rollout import server as server_lib
from rljax.rollout.server import ServerError, VLLMServer
from rljax.weight_sync import staging

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RL_ROUTES = [
    "/update_weights",
    "/collective_rpc",
    "/pause",
    "/resume",
    "/start_weight_update",
    "/finish_weight_update",
    "/init_weight_transfer_engine",
    "/v1/completions",
]


def _call(mw: auth.BearerTokenMiddleware, method: str, path: str, headers=()) -> tuple[int | None, bool]:
    """(status sent by the middleware or None, whether the app ran)."""
    ran, sent = [], []

    async def app(scope, receive, send):
        ran.append(scope["path"])

    async def send(msg):
        sent.append(msg)

    mw.app = app
    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    asyncio.run(mw(scope, None, send))
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, bool(ran)


def test_middleware_needs_the_token_on_every_route_but_health(tmp_path, monkeypatch):
    path = auth.write_token_file(tmp_path / "token", "s3cret")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, path)
    mw = auth.BearerTokenMiddleware(None)
    good = [(b"authorization", b"Bearer s3cret")]
    for route in RL_ROUTES + ["/metrics", "/v1/models", "/health/", "//health"]:
        assert _call(mw, "POST", route) == (401, False), route
        assert _call(mw, "POST", route, [(b"authorization", b"Bearer s3cre")]) == (401, False)
        assert _call(mw, "POST", route, [(b"authorization", b"Basic s3cret")]) == (401, False)
        assert _call(mw, "POST", route, good) == (None, True)
    assert _call(mw, "GET", "/health") == (None, True)  # the liveness probe stays open
    assert _call(mw, "POST", "/health") == (401, False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV)
    with pytest.raises(RuntimeError, match=auth.TOKEN_FILE_ENV):  # fail closed: no token, no server
        auth.BearerTokenMiddleware(None)


def test_token_files_are_private_and_secrets_redacted(tmp_path):
    path = auth.write_token_file(tmp_path / "token", "abc")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and auth.read_token_file(path) == "abc"
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="mode 0600"):
        auth.read_token_file(path)
    os.symlink(path, tmp_path / "link")
    with pytest.raises(OSError):
        auth.read_token_file(tmp_path / "link")
    argv = ["vllm", "--api-key", "k1", "--api-key=k2", "--port", "1"]
    assert auth.redact_argv(argv) == ["vllm", "--api-key", "***", "--api-key=***", "--port", "1"]


def test_non_loopback_bind_needs_allow_remote(tmp_path):
    with pytest.raises(ServerError, match="refusing to bind"):
        VLLMServer(tmp_path, tmp_path, host="0.0.0.0", port=1)
    cd = C.default_config_dict()
    cd.rollout.vllm.host = "0.0.0.0"
    with pytest.raises(C.ConfigError, match="rollout.vllm.host.*allow_remote"):
        C.validate(C.from_config_dict(cd))
    cd.rollout.vllm.allow_remote = True
    C.validate(C.from_config_dict(cd))
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert C.is_loopback_host(host)
    for host in ("0.0.0.0", "10.0.0.1", "::", "node07"):
        assert not C.is_loopback_host(host)
    token = tmp_path / "tok"
    token.write_text("x")
    token.chmod(0o644)
    cd = C.default_config_dict()
    cd.rollout.vllm.token_file = str(token)
    with pytest.raises(C.ConfigError, match="rollout.vllm.token_file"):
        C.validate(C.from_config_dict(cd))


def test_index_file_names_cannot_leave_the_checkpoint(tmp_path):
    from rljax.models.hf import _TensorSource

    for name in ("../outside.safetensors", "/etc/passwd", "a/../../b.safetensors"):
        index = {"metadata": {}, "weight_map": {"w": name}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="outside the checkpoint directory"):
            _TensorSource(tmp_path)


_COORDINATOR_CHECK = r"""
import os
from rljax import runtime
runtime.initialize_jax()
import jax
if jax.process_index() == 0:
    port = int(os.environ["RLJAX_COORDINATOR"].rsplit(":", 1)[1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                listening.append(local.rsplit(":", 1)[0])
    print("COORDINATOR_LISTENS", ",".join(listening), flush=True)
"""


@pytest.mark.multiprocess
def test_local_launch_coordinator_listens_on_loopback_only(tmp_path):
    assert all(
        e["JAX_COORDINATOR_BIND_ADDRESS"] == e["RLJAX_COORDINATOR"] == "127.0.0.1:99"
        for e in launch.process_envs(2, 1, 99, {})
    )
    entry = tmp_path / "check.py"
    entry.write_text(_COORDINATOR_CHECK)
    env = dict(os.environ, JAX_PLATFORMS="cpu", RLJAX_PLATFORM="cpu")
    cmd = [sys.executable, "-m", "rljax.launch", "--num-processes", "2", "--entry", str(entry), "--"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "COORDINATOR_LISTENS" in ln]
    addresses = line.split("COORDINATOR_LISTENS", 1)[1].strip().split(",")
    # /proc/net/tcp spells 127.0.0.1 as 0100007F, tcp6 the IPv4-mapped ::ffff:127.0.0.1 as below and ::1
    # as 0...01000000; every interface would be 00000000 or 0...0 (what JAX binds by default).
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert addresses and set(addresses) <= loopback, addresses


# ------------------------------------------------------------------------------------- real vLLM server


def _process_tree(pid: int) -> dict[int, str]:
    """{pid: start time} of `pid` and all its descendants (from /proc)."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            out[p] = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[19]
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{tid}/children").read().split()]
        except OSError:
            continue
    return out


def _alive(pid: int, start: str) -> bool:
    """True while `pid` is the same process (same start time) and not a zombie."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == start


@pytest.mark.vllm
def test_unauthenticated_rl_routes_are_refused_and_the_sync_still_verifies(served_qwen2):
    engine, version = served_qwen2.engine, served_qwen2.engine.version
    (url,) = engine.urls
    for route in RL_ROUTES:
        r = requests.post(url + route, json={}, timeout=30)
        assert r.status_code == 401, (route, r.status_code, r.text[:200])
        wrong = {"Authorization": "Bearer " + "x" * 43}
        assert requests.post(url + route, json={}, headers=wrong, timeout=30).status_code == 401
    assert requests.get(url + "/health", timeout=30).status_code == 200
    metrics = served_qwen2.push(perturbed(served_qwen2.ref.state(), seed=41), version + 1)
    assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= 1e-3
    assert_serves_reference(served_qwen2, version + 1)
    # The token is on no command line of the server's processes, and in none of their environments
    # (they hold only the path of its 0600 file).
    server = served_qwen2.server
    for pid in _process_tree(server.pid):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        assert engine.token.encode() not in cmdline and engine.token.encode() not in environ
    assert engine.token not in server.log_tail(10**7)
    assert stat.S_IMODE(os.stat(server.token_file).st_mode) == 0o600


def _update(url, headers, info, timeout=60):
    return requests.post(
        url + "/update_weights", json={"update_info": info}, headers=headers, timeout=timeout
    )


@pytest.mark.vllm
def test_token_holder_cannot_point_the_worker_outside_its_staging_root(served_qwen2, tmp_path):
    engine, version = served_qwen2.engine, served_qwen2.engine.version
    (url,) = engine.urls
    headers = engine.syncer.headers
    # validate is no longer an init_info field: a caller cannot switch the checks off.
    r = requests.post(
        url + "/init_weight_transfer_engine",
        json={"init_info": {"validate": False}},
        headers=headers,
        timeout=60,
    )
    assert r.status_code != 200 and "validate" in r.text
    name = "model.norm.weight"
    tensor = [[name, "float32", [128], 0, 512, None]]
    run = staging.RunDir(staging.DEFAULT_STAGING_DIR)
    try:
        secret = tmp_path / "secret.bin"
        secret.write_bytes(np.ones(128, np.float32).tobytes())
        os.symlink(secret, os.path.join(run.path, "bucket-link"))
        paths = {
            str(secret): "not a bucket file",
            f"{run.path}/../../../{secret}": "not a bucket file",
            os.path.join(run.path, "bucket-link"): "symbolic links",
        }
        requests.post(url + "/pause", params={"mode": "wait"}, headers=headers, timeout=60).raise_for_status()
        for path, pattern in paths.items():
            requests.post(url + "/start_weight_update", headers=headers, timeout=60).raise_for_status()
            r = _update(url, headers, {"path": path, "tensors": tensor})
            assert r.status_code != 200 and pattern in r.text, (path, r.status_code, r.text[:300])
        # A size the tensor list does not imply is refused before anything is received or mapped.
        requests.post(url + "/start_weight_update", headers=headers, timeout=60).raise_for_status()
        bad = [[name, "float32", [128], 4096, 512, None]]
        r = _update(
            url, headers, {"tcp": {"host": "127.0.0.1", "port": 9, "token": "00" * 32}, "tensors": bad}
        )
        assert r.status_code != 200 and "bad byte range" in r.text, r.text[:300]
    finally:
        run.close()
        requests.post(url + "/resume", headers=headers, timeout=60)
    engine.gate.broken = "attack test: re-push"  # the fixture's next user gets a full push
    served_qwen2.push(perturbed(served_qwen2.ref.state(), seed=43), version + 1)
    assert_serves_reference(served_qwen2, version + 1)


@pytest.mark.vllm
@pytest.mark.slow
def test_sigkilled_trainer_leaves_no_server_process_bucket_file_or_socket(tmp_path):
    workdir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rljax.main",
        "--config=configs/grpo.py:smoke",
        f"--workdir={workdir}",
        "--config.trainer.steps=1000",
        "--config.rollout.vllm.gpu_memory_utilization=0.08",
    ]
    # vLLM's default process layout (conftest runs the suite's engines in one process): API server, engine
    # core and its model worker, so the clean-up covers a worker that is not the API server's child.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    pattern = os.path.join(staging.DEFAULT_STAGING_DIR, f"{staging.RUN_PREFIX}{proc.pid}-*", "bucket-*")
    try:
        deadline = time.monotonic() + 600
        while not glob.glob(pattern):  # kill it mid-sync, while bucket files exist
            assert proc.poll() is None, f"rljax.main exited with {proc.returncode}"
            assert time.monotonic() < deadline, "no weight sync within 600 s"
            time.sleep(0.002)
        tree = _process_tree(proc.pid)
        assert len(tree) >= 4, tree  # the trainer, the vLLM API server, its engine core, the worker
        # vLLM's IPC sockets are in the server's private TMPDIR, not in the host's temp dir
        server_tmp = os.path.join(server_lib._tmp_root(), f"{server_lib.TMP_PREFIX}{proc.pid}-*")
        (tmpdir,) = glob.glob(server_tmp)
        assert any(stat.S_ISSOCK(os.stat(p).st_mode) for p in glob.glob(os.path.join(tmpdir, "*"))), tmpdir
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = time.monotonic()
    deadline = killed_at + 120
    while time.monotonic() < deadline:
        alive = {p for p, start in tree.items() if _alive(p, start)}
        left = glob.glob(os.path.join(staging.DEFAULT_STAGING_DIR, f"{staging.RUN_PREFIX}{proc.pid}-*"))
        left += glob.glob(server_tmp)
        if not alive and not left:
            break
        time.sleep(0.1)
    assert not alive, f"processes left after the trainer's SIGKILL: {sorted(alive)}"
    assert not left, f"bucket or server temp directories left: {left}"
    print(f"clean-up after SIGKILL took {time.monotonic() - killed_at:.1f} s for {len(tree)} processes")


def test_server_env_drops_the_trainers_credentials(monkeypatch):
    """The vLLM child gets the trainer's environment less credential-like names (a model's remote code
    or a plugin must not read them); what vLLM needs passes, and extra_env is passed as given."""
    from rljax.rollout.server import ServerOptions, server_env

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("WANDB_API_KEY", "wb_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    env = server_env(ServerOptions(extra_env=(("MY_KEY", "given"),)))
    assert not {"HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert "secret" not in " ".join(env.values())
    assert env["PYTHONPATH"] == "/some/where" and env["PATH"] == os.environ["PATH"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["MY_KEY"] == "given"


def test_owned_and_rollout_node_servers_take_one_set_of_options():
    """`rljax.rollout.serve` (a rollout node's server) and the loop's owned servers derive their options
    from the config through one function: serving dtype, parallelism, backend and binds agree."""
    from rljax.rollout import serve
    from rljax.rollout.server import options_from_config

    cfg = C.from_config_dict(
        {
            "rollout": {
                "vllm": {"tensor_parallel_size": 2, "data_parallel_size": 2, "extra_args": ("--a",)},
                "weight_sync": {"dtype": "bfloat16", "transport": "tcp"},
            }
        }
    )
    owned, node = options_from_config(cfg), serve.server_options(cfg, ("--b",))
    assert owned.dtype == node.dtype == "bfloat16"
    assert (
        (owned.tensor_parallel_size, owned.data_parallel_size)
        == (2, 2)
        == (
            node.tensor_parallel_size,
            node.data_parallel_size,
        )
    )
    assert owned.weight_transfer_backend == node.weight_transfer_backend == "tcp"
    assert owned.extra_args == ("--a",) and node.extra_args == ("--a", "--b")
    assert owned == dataclasses.replace(node, extra_args=owned.extra_args)


@pytest.mark.vllm
@pytest.mark.slow
def test_rollout_node_server_refuses_unauthenticated_rl_routes(tmp_path):
    """A rollout node's server (`python -m rljax.rollout.serve`, what launch/gpu_slurm.sh runs as a step)
    answers 401 on every RL route without the job's token, and serves with it."""
    from rljax.rollout.server import free_port

    token_file = tmp_path / "secrets" / "server_token"
    token_file.parent.mkdir(mode=0o700)
    token = auth.new_token()
    auth.write_token_file(token_file, token)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "rljax.rollout.serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--token-file", str(token_file), "--", "--config=configs/grpo.py", f"--workdir={tmp_path}/w"]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        for route in RL_ROUTES:
            assert requests.post(url + route, json={}, timeout=30).status_code == 401, route
        good = auth.bearer_headers(token)
        assert requests.get(url + "/v1/models", headers=good, timeout=30).status_code == 200
        assert requests.get(url + "/v1/models", timeout=30).status_code == 401
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
