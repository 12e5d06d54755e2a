"""Process start-up between the parsed config and the loop: JAX distributed init, runtime checks.

Kept apart from `rljax.main` (which only reads flags) so launchers and notebooks can call `run(cfg, workdir)`.
"""

from __future__ import annotations

import os
import sys

from rljax import config as config_lib


def fail(message: str, code: int = 2) -> None:
    print(f"rljax: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _set_cpu_device_count() -> None:
    """RLJAX_CPU_DEVICES=k gives this process k simulated CPU devices (before the CPU backend starts)."""
    count = os.environ.get("RLJAX_CPU_DEVICES")
    if not count:
        return
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={int(count)}"])


def _local_device_ids() -> list[int] | None:
    """RLJAX_LOCAL_DEVICE_IDS="0,1,2,3": the GPUs one process drives (one process per node with K devices)."""
    ids = os.environ.get("RLJAX_LOCAL_DEVICE_IDS", "")
    return [int(i) for i in ids.split(",")] if ids else None


def initialize_jax() -> None:
    """Joins a multi-process JAX job when launched as one (Slurm srun or rljax.launch), else no-op.

    Environment: RLJAX_PLATFORM (cpu/gpu/tpu) pins the JAX platform; RLJAX_CPU_DEVICES simulated CPU
    devices per process; the local launcher sets RLJAX_COORDINATOR, RLJAX_NUM_PROCESSES, RLJAX_PROCESS_ID.
    Under an srun step with more than one task, `jax.distributed.initialize()` reads the Slurm environment
    (RLJAX_COORDINATOR, when set by launch/gpu_slurm.sh, overrides its coordinator address). Every process
    prints `rljax: process i of n, k local devices`. In a multi-process job every process then runs a
    peer watchdog (`rljax.loop.distributed.PeerWatchdog`): when a peer dies, the others exit within
    RLJAX_PEER_TIMEOUT_S (default 30) seconds, naming it, instead of hanging in a collective.
    """
    _set_cpu_device_count()
    import jax

    platform = os.environ.get("RLJAX_PLATFORM")
    if platform:
        jax.config.update("jax_platforms", platform)
    coordinator = os.environ.get("RLJAX_COORDINATOR") or None
    if os.environ.get("RLJAX_PROCESS_ID") is not None:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["RLJAX_NUM_PROCESSES"]),
            process_id=int(os.environ["RLJAX_PROCESS_ID"]),
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
    from rljax.loop.distributed import start_peer_watchdog as start

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


def preflight_or_fail(cfg: config_lib.Config) -> None:
    """Runs `rljax.preflight` on this machine before any allocation (it compiles the train step and the
    log-prob passes for the configured shapes and prints their per-device memory); exits 2, all
    failures on one line."""
    import jax

    from rljax import preflight

    failures = preflight.run_preflight(
        cfg,
        num_devices=jax.device_count(),
        num_processes=jax.process_count(),
        device_memory_bytes=preflight.device_memory_bytes(),
        log=lambda line: print(f"rljax: preflight: {line}", flush=True),
    )
    if failures:
        fail("preflight: " + "; ".join(failures))


def run(cfg: config_lib.Config, workdir: str) -> None:
    """Validates the config against this machine (config checks, every user input resolved, then
    preflight) and runs the loop. User errors exit 2 with one line before any server starts."""
    initialize_jax()
    import jax

    from rljax.loop.inputs import resolve_inputs

    try:
        config_lib.validate_runtime(cfg, jax.device_count())
        resolve_inputs(cfg, workdir)
    except config_lib.ConfigError as e:
        fail(f"config: {e}")
    preflight_or_fail(cfg)
    from rljax.checkpoint import CheckpointError, CheckpointMismatchError
    from rljax.loop.train import train

    try:
        train(cfg, workdir)
    except CheckpointMismatchError as e:  # the workdir's checkpoints were saved with another config
        fail(f"checkpoint: {e}")
    except CheckpointError as e:  # not a user error: exit 1, still one line
        fail(f"checkpoint: {e}", code=1)
