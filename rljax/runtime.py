"""What every entry point shares, below the CLIs: argv -> Config, one-line user errors, joining the JAX job.

`config_from_args` is the one argv -> Config parser behind `rljax.main`, `rljax.launch --print-config`,
`rljax.preflight` and `launch/selftest.py` (the config file runs once per process). The CLIs import this
module; it imports none of them.
"""

from __future__ import annotations

import os
import sys

from rljax import config as config_lib
from rljax.errors import fail  # the entry points' one-line user errors (also used as `runtime.fail`)

# The integer variables of a job (set by the launchers or the user), with their least valid value: each
# is checked before JAX starts, so a malformed one is one line (exit 2), not a traceback from int().
_INT_VARIABLES = {"RLJAX_CPU_DEVICES": 1, "RLJAX_NUM_PROCESSES": 1, "RLJAX_PROCESS_ID": 0}


def _env_ints(name: str, least: int, *, sep: str | None = None) -> list[int] | None:
    """The integers in variable `name` (one, or a `sep`-separated list), each >= `least`; None when unset
    or empty; fails with one line naming the variable otherwise."""
    raw = os.environ.get(name, "")
    if not raw:
        return None
    try:
        values = [int(part) for part in (raw.split(sep) if sep else [raw])]
    except ValueError:
        values = []
    if not values or min(values) < least:
        what = "a comma-separated list of integers" if sep else "an integer"
        fail(f"{name} must be {what} >= {least}, got {raw!r}")
    return values


def _check_variables() -> None:
    for name, least in _INT_VARIABLES.items():
        _env_ints(name, least)
    _local_device_ids()


def _set_cpu_device_count() -> None:
    """RLJAX_CPU_DEVICES=k gives this process k simulated CPU devices (before the CPU backend starts)."""
    count = _env_ints("RLJAX_CPU_DEVICES", 1)
    if count is None:
        return
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count[0]}"])


def _local_device_ids() -> list[int] | None:
    """RLJAX_LOCAL_DEVICE_IDS="0,1,2,3": the GPUs one process drives (one process per node with K devices)."""
    return _env_ints("RLJAX_LOCAL_DEVICE_IDS", 0, sep=",")


def initialize_jax() -> None:
    """Joins a multi-process JAX job when launched as one (Slurm srun or rljax.launch), else no-op.

    Environment: RLJAX_PLATFORM (cpu/gpu/tpu) pins the JAX platform; RLJAX_CPU_DEVICES simulated CPU
    devices per process; the local launcher sets RLJAX_COORDINATOR, RLJAX_NUM_PROCESSES, RLJAX_PROCESS_ID.
    Under an srun step with more than one task, `jax.distributed.initialize()` reads the Slurm environment
    (RLJAX_COORDINATOR, when set by launch/gpu_slurm.sh, overrides its coordinator address). Every process
    prints `rljax: process i of n, k local devices`. In a multi-process job every process then runs a
    peer watchdog (`rljax.distributed.PeerWatchdog`): when a peer dies, the others exit within
    RLJAX_PEER_TIMEOUT_S (default 30) seconds, naming it, instead of hanging in a collective.
    """
    _check_variables()
    _set_cpu_device_count()
    import jax

    platform = os.environ.get("RLJAX_PLATFORM")
    if platform:
        jax.config.update("jax_platforms", platform)
    coordinator = os.environ.get("RLJAX_COORDINATOR") or None
    if os.environ.get("RLJAX_PROCESS_ID") is not None:
        (num_processes,) = _env_ints("RLJAX_NUM_PROCESSES", 1) or fail(
            "RLJAX_PROCESS_ID is set without RLJAX_NUM_PROCESSES (set both, or neither)"
        )
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=_env_ints("RLJAX_PROCESS_ID", 0)[0],
            local_device_ids=_local_device_ids(),
        )
    elif _slurm_step_tasks() > 1:
        jax.distributed.initialize(coordinator_address=coordinator, local_device_ids=_local_device_ids())
    start_peer_watchdog()
    print(
        f"rljax: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} local devices",
        flush=True,
    )


def start_peer_watchdog() -> None:
    """The dead-peer watchdog of a multi-process job (no-op in one process); RLJAX_PEER_TIMEOUT_S sets its
    timeout (seconds without a peer's heartbeat before this process exits)."""
    from rljax.distributed import start_peer_watchdog as start

    raw = os.environ.get("RLJAX_PEER_TIMEOUT_S", "30")
    try:
        timeout_s = float(raw)
    except ValueError:
        timeout_s = -1.0
    if not timeout_s > 0:
        fail(f"RLJAX_PEER_TIMEOUT_S must be a positive number of seconds, got {raw!r}")
    start(interval_s=min(1.0, timeout_s / 4), timeout_s=timeout_s)


def _slurm_step_tasks() -> int:
    """Tasks in the current srun step (1 outside a step: the batch script itself is not a JAX job)."""
    if os.environ.get("SLURM_STEP_ID") is None:
        return 1
    return int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or "1")


# ------------------------------------------------------------------------------------- argv -> Config
def split_config_args(args: list[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """(`--config` value, [(key, text)] of each `--config.<key>=<text>` or `--config.<key> <text>` in order,
    every other argument). One dash works too (`-config=...`). Raises ConfigError for an override
    without a value (none follows, or the next argument is a `--flag`)."""
    config_arg, overrides, rest, i = None, [], [], 0
    while i < len(args):
        arg = "-" + args[i] if args[i].startswith("-config") else args[i]
        if arg.startswith("--config="):
            config_arg = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(args):
            config_arg, i = args[i + 1], i + 1
        elif arg.startswith("--config."):
            body = arg[len("--config.") :]
            if "=" not in body:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise config_lib.ConfigError(body, "override needs a value: --config.<key>=<value>")
                body, i = f"{body}={args[i + 1]}", i + 1
            overrides.append(tuple(body.split("=", 1)))
        else:
            rest.append(args[i])
        i += 1
    return config_arg, overrides, rest


def config_from_args(args: list[str]) -> config_lib.Config:
    """The validated Config of CLI arguments: `--config=FILE[:preset]`, then each `--config.<key>=<value>`
    parsed by `config.parse_override` (typed, unknown keys named with a suggestion); other arguments
    (`--workdir`, ...) are ignored here. Raises ConfigError (a bad override, a missing or failing file)."""
    config_arg, overrides, _ = split_config_args(args)
    parsed = [(key, config_lib.parse_override(key, text)) for key, text in overrides]
    if config_arg is None:
        raise config_lib.ConfigError("--config", "is required, e.g. --config=configs/grpo.py")
    cd = _load_config_file(*config_arg.partition(":")[::2])
    for key, value in parsed:
        *parents, leaf = key.split(".")
        node = cd
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config_lib.validate(config_lib.from_config_dict(cd))


def _load_config_file(path: str, preset: str):
    """`get_config(preset or None)` of a config file, as a ConfigDict; its own errors (a syntax error, a bad
    import, an unknown preset) become one ConfigError naming the file."""
    import importlib.util

    if not os.path.isfile(path):
        raise config_lib.ConfigError("--config", f"no such config file: {path!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # config files import `configs.*` relative to the repo
    try:
        spec = importlib.util.spec_from_file_location("rljax_user_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config(preset or None)
    except config_lib.ConfigError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's config file: a syntax error, ...
        raise config_lib.ConfigError("--config", f"{path}: {type(e).__name__}: {e}") from None
