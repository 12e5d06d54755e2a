"""A vLLM OpenAI-compatible server owned by rljax: command line, process lifecycle, health check.

`VLLMServer(model_path, workdir).start()` runs `python -m vllm.entrypoints.openai.api_server` as a child
process in its own process group, with:

- a per-run bearer token on every route but `GET /health` (`rljax.rollout.auth`: vLLM's `--api-key`
  does not cover the RL routes that `VLLM_SERVER_DEV_MODE=1` adds); the token is written to
  `<workdir>/server_token` (0600) and handed over by path in the environment, never on the command line;
- loopback only, unless `ServerOptions.allow_remote` (a non-loopback host is refused otherwise);
- `--weight-transfer-config {"backend": "shm"}`: rljax's host-staged backend, registered inside vLLM by
  the `vllm.general_plugins` entry point `rljax.weight_sync.worker.plugin:register`;
- `--logprobs-mode processed_logprobs`: the log-prob convention of `rljax.rollout.client`;
- a KV block of 32 tokens (vLLM's CPU default is 128; the canary's prompt spans 2 blocks);
- with `model.lora_rank > 0`, runtime LoRA loading (`weight_sync.adapters.lora_server_args`);
- float32 weights, eager mode on the CPU build (CUDA graphs on a GPU), the GPUs of its plan
  (`ServerOptions.devices`, `rljax.device_plan`), its log in `<workdir>/vllm_server.log` (appended across
  restarts).

`stop()` sends SIGTERM to the group and SIGKILL after a grace period; `restart()` keeps host, port and token.
Each start gets a private TMPDIR, `<tmp>/rljax-vllm-<pid>-<random>/` (0700; vLLM's IPC sockets and its
distributed-init file land there: 8 entries a start that vLLM leaves in /tmp), removed by `stop()`, or by a
reaper process when the trainer is SIGKILLed (`rljax.lockdir.ReapedDir`).
The child gets SIGTERM when the process that started it dies, even by SIGKILL (`child_exec.py` execs it).
`launch_servers` starts several at once (one token, one port each); `served_model_name` reads the id a
server serves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from rljax import device_plan, envvars, lockdir
from rljax.config import (
    DEFAULTS,
    FP8_SERVING,
    Config,
    is_loopback_host,
    serving_dtype,
    vllm_is_cpu_build,
)
from rljax.process_plan import free_port
from rljax.rollout import auth, placement
from rljax.rollout.crashes import crash_cause, prefill_args
from rljax.weight_sync.adapters import lora_server_args
from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, STAGING_DIR_ENV


class ServerError(RuntimeError):
    """The vLLM server failed to start, died, or did not become healthy in time."""


_VLLM = DEFAULTS.rollout.vllm  # the config's defaults: each field the config sets has its default there


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Command-line and environment settings of an owned vLLM server. A field the config sets defaults to
    the config's default (`options_from_config(DEFAULTS) == ServerOptions()`); the rest have theirs here."""

    dtype: str = serving_dtype(DEFAULTS)
    max_model_len: int = _VLLM.max_model_len
    block_size: int | None = _VLLM.block_size or None  # --block-size; None: vLLM's default (128 on CPU)
    gpu_memory_utilization: float = _VLLM.gpu_memory_utilization  # on the CPU build: share of host RAM
    kvcache_space_gib: int = _VLLM.kvcache_space_gib  # VLLM_CPU_KVCACHE_SPACE (CPU build only)
    weight_transfer_backend: str = DEFAULTS.rollout.weight_sync.transport
    logprobs_mode: str = "processed_logprobs"
    max_logprobs: int = 20
    seed: int = DEFAULTS.trainer.seed
    tensor_parallel_size: int = _VLLM.tensor_parallel_size
    data_parallel_size: int = _VLLM.data_parallel_size
    enforce_eager: bool | None = None  # None: on the CPU build only (CUDA graphs decode faster on a GPU)
    # The node's GPUs the servers run on (rljax.device_plan; CUDA_VISIBLE_DEVICES): `launch_servers` gives
    # replica i the i-th equal slice; (): every GPU the trainer sees.
    devices: tuple[int, ...] = ()
    startup_timeout_s: float = _VLLM.startup_timeout_s
    stop_grace_s: float = 10.0
    extra_args: tuple[str, ...] = _VLLM.extra_args
    extra_env: tuple[tuple[str, str], ...] = ()
    allow_remote: bool = _VLLM.allow_remote  # True: a non-loopback host (the token still guards every route)
    staging_dir: str = DEFAULT_STAGING_DIR  # shm transport: the only directory the workers map buckets from
    # Thread placement (`rljax.rollout.placement`): the worker's OpenMP cores (() = vLLM's own binding) and
    # how long an idle worker busy-polls before sleeping (vLLM's own is 1 s, a core taken from the trainer).
    cpus: tuple[int, ...] = ()
    idle_spin_s: float = _VLLM.idle_spin_s
    # None: from the installed vLLM (`vllm_is_cpu_build`); decides `prefill_args`.
    cpu_build: bool | None = None


def options_from_config(cfg: Config, **overrides) -> ServerOptions:
    """The ServerOptions of a server for the run `cfg`, owned (`loop.engine.make_engine`) or on a rollout
    node of its own (`rljax.rollout.serve`): every engine option derives from the config here, once.
    `overrides` set what only the caller knows (cores, extra args)."""
    vc = cfg.rollout.vllm
    options = ServerOptions(
        idle_spin_s=vc.idle_spin_s,
        dtype=serving_dtype(cfg),
        max_model_len=vc.max_model_len,
        block_size=vc.block_size or None,
        gpu_memory_utilization=vc.gpu_memory_utilization,
        kvcache_space_gib=vc.kvcache_space_gib,
        seed=cfg.trainer.seed,
        tensor_parallel_size=vc.tensor_parallel_size,
        data_parallel_size=vc.data_parallel_size,
        startup_timeout_s=vc.startup_timeout_s,
        extra_args=tuple(vc.extra_args),
        allow_remote=vc.allow_remote,
        weight_transfer_backend=cfg.rollout.weight_sync.transport,
    )
    if cfg.model.lora_rank:  # each policy version is a runtime-loaded adapter (weight_sync.adapters)
        args, env = lora_server_args(cfg.model.lora_rank)
        options = dataclasses.replace(options, extra_args=(*options.extra_args, *args), extra_env=env)
    return dataclasses.replace(options, **overrides)


_CHILD_EXEC = Path(__file__).with_name("child_exec.py")  # no preexec_fn: see its docstring
TMP_PREFIX = "rljax-vllm-"  # a server's private TMPDIR: <tmp>/rljax-vllm-<pid>-<random>/
_MAX_TMP_ROOT = 48  # vLLM's IPC sockets are <TMPDIR>/<uuid4> and a unix socket path holds 107 bytes


def _tmp_root() -> str:
    root = tempfile.gettempdir()
    return root if len(root) <= _MAX_TMP_ROOT else "/tmp"


def server_command(model_path: str, host: str, port: int, options: ServerOptions) -> list[str]:
    """The argv that starts vLLM's OpenAI server for `model_path` on `host:port`."""
    cmd = [
        sys.executable,
        # -P: the working directory is not on the server's import path (the trainer's may be a checkout,
        # whose top-level `kernels/` shadows Hugging Face's `kernels` and pulls JAX into each vLLM process)
        "-P",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "bfloat16" if options.dtype == FP8_SERVING else options.dtype,
        "--max-model-len",
        str(options.max_model_len),
        "--gpu-memory-utilization",
        str(options.gpu_memory_utilization),
        "--seed",
        str(options.seed),
        "--tensor-parallel-size",
        str(options.tensor_parallel_size),
        "--data-parallel-size",
        str(options.data_parallel_size),
        "--max-logprobs",
        str(options.max_logprobs),
        "--logprobs-mode",
        options.logprobs_mode,
        "--weight-transfer-config",
        json.dumps({"backend": options.weight_transfer_backend}),
        "--disable-uvicorn-access-log",
        "--middleware",
        auth.MIDDLEWARE,
    ]
    if options.block_size is not None:
        cmd += ["--block-size", str(options.block_size)]
    if options.dtype == FP8_SERVING:  # fp8 projections with their scales (rljax.weight_sync.fp8), rest bf16
        cmd += ["--quantization", "fp8"]
    cpu_build = vllm_is_cpu_build() if options.cpu_build is None else options.cpu_build
    cmd += prefill_args(options.max_model_len, cpu_build=cpu_build)
    if cpu_build if options.enforce_eager is None else options.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(options.extra_args)


def server_env(options: ServerOptions) -> dict[str, str]:
    """The child's environment: the trainer's less its credentials (`envvars.without_secrets`), dev-mode RL
    endpoints on, CPU KV cache bounded, no JAX device flags, the worker's cores and idle spin
    (`rljax.rollout.placement`). `options.extra_env` is passed as given."""
    env = envvars.without_secrets(os.environ)
    env.pop("XLA_FLAGS", None)  # the parent's simulated JAX devices mean nothing to vLLM
    env |= {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(options.kvcache_space_gib),
        "TOKENIZERS_PARALLELISM": "false",
    }
    env |= placement.server_thread_env(placement.Placement(server_cpus=options.cpus), options.idle_spin_s)
    if options.devices:
        env["CUDA_VISIBLE_DEVICES"] = device_plan.visible_devices(options.devices)
    return env | dict(options.extra_env)


class VLLMServer:
    """One vLLM server child process. Use `start()` (or as a context manager), `url`, `stop()`."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        workdir: str | os.PathLike,
        *,
        host: str = _VLLM.host,
        port: int = 0,
        options: ServerOptions = ServerOptions(),
        token: str | None = None,
    ):
        if not (is_loopback_host(host) or options.allow_remote):
            raise ServerError(
                f"refusing to bind the vLLM server to {host!r}: its weight-update routes would be reachable "
                "from other hosts; use loopback or set allow_remote (rollout.vllm.allow_remote=true)"
            )
        self.token = token or auth.new_token()  # every route but /health needs it (rljax.rollout.auth)
        self.model_path = str(model_path)
        self.workdir = Path(workdir)
        self.host = host
        self.port = port or free_port(host)
        self.options = options
        self.log_path = self.workdir / "vllm_server.log"
        self.token_file = self.workdir / "server_token"
        self._proc: subprocess.Popen | None = None
        self._tmp: lockdir.ReapedDir | None = None
        self._log_start = 0  # the log's size when the running child started: its own part follows

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def tmpdir(self) -> str | None:
        """The running child's private TMPDIR (None when not started)."""
        return None if self._tmp is None else self._tmp.path

    def alive(self) -> bool:
        """True while the child process runs (it may not be healthy yet)."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> VLLMServer:
        """Starts the child and blocks until `/health` answers 200; raises ServerError with the log tail."""
        self.spawn()
        self.wait_healthy(self.options.startup_timeout_s)
        return self

    def spawn(self) -> VLLMServer:
        """Starts the child without waiting (start several servers at once, then `wait_healthy` each)."""
        if self.alive():
            raise ServerError(f"server on {self.url} is already running (pid {self.pid})")
        self.workdir.mkdir(parents=True, exist_ok=True)
        auth.write_token_file(self.token_file, self.token)
        cmd = server_command(self.model_path, self.host, self.port, self.options)
        self._close_tmp()  # a child that exited by itself
        root = _tmp_root()
        lockdir.sweep_unlocked(root, TMP_PREFIX)  # those of trainers killed along with their reaper
        self._tmp = lockdir.ReapedDir(root, TMP_PREFIX)
        env = server_env(self.options) | {
            auth.TOKEN_FILE_ENV: str(self.token_file.resolve()),
            STAGING_DIR_ENV: self.options.staging_dir,
            "TMPDIR": dict(self.options.extra_env).get("TMPDIR", self._tmp.path),
        }
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            log.write(f"\n=== rljax: starting {' '.join(auth.redact_argv(cmd))}\n".encode())
            self._proc = subprocess.Popen(
                [sys.executable, "-I", str(_CHILD_EXEC), str(os.getpid()), *cmd],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Polls `/health` until 200; raises ServerError if the child exits or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"vLLM server exited with code {self._proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"vLLM server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the whole process group (API server + engine core), SIGKILL after the grace period;
        then the child's TMPDIR goes."""
        if self._proc is None:
            self._close_tmp()
            return
        if self._proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(self.options.stop_grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self._proc.wait(30)
        self._signal(signal.SIGKILL)  # engine-core children can outlive a clean API-server exit
        self._proc = None
        self._close_tmp()

    def _close_tmp(self) -> None:
        if self._tmp is not None:
            self._tmp.close()
            self._tmp = None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """True if the child runs and `/health` answers 200 within `timeout_s`."""
        try:
            return self.alive() and requests.get(self.url + "/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def kill(self) -> None:
        """SIGKILL to the group, not waiting (fault injection, callable from any thread); `stop()` reaps."""
        if self._proc is not None:
            self._signal(signal.SIGKILL)

    def restart(self) -> VLLMServer:
        """Stops (if needed) and starts again on the same host and port; the weights are the checkpoint's."""
        self.stop()
        return self.start()

    def crash_cause(self) -> str | None:
        """The root-cause line of the latest start's crash in its log (`crash_cause`), or None."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return crash_cause(log.read().decode(errors="replace"))
        except OSError:
            return None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def served_model_name(url: str, timeout_s: float = 10.0, headers: dict | None = None) -> str:
    """The id of the (single) model a server serves, from `/v1/models`."""
    r = requests.get(url + "/v1/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def launch_servers(
    model_path: str | os.PathLike,
    workdir: str | os.PathLike,
    *,
    replicas: int = 1,
    host: str = "127.0.0.1",
    options: ServerOptions = ServerOptions(),
) -> list[VLLMServer]:
    """Starts `replicas` servers at once, each on its own port (logs in `workdir/replica_<i>/`, one fresh
    bearer token for all, replica i on the i-th slice of `options.devices`), and waits until every one
    answers `/health`."""
    servers, token = [], auth.new_token()
    if len(options.devices) % replicas:
        raise ValueError(f"{len(options.devices)} GPUs do not split among {replicas} servers")
    k = len(options.devices) // replicas
    try:
        for i in range(replicas):
            path = Path(workdir) / f"replica_{i}"
            own = dataclasses.replace(options, devices=options.devices[i * k : (i + 1) * k])
            servers.append(VLLMServer(model_path, path, host=host, options=own, token=token))
            servers[-1].spawn()
        for s in servers:
            s.wait_healthy(options.startup_timeout_s)
        return servers
    except BaseException:
        for s in servers:
            s.stop()
        raise
