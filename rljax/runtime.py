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


def initialize_jax() -> None:
    """Joins a multi-process JAX job when launched as one (Slurm srun or rljax.launch.local), else no-op.

    RLJAX_PLATFORM (cpu/gpu/tpu) pins the JAX platform; under Slurm `jax.distributed.initialize()` detects
    the coordinator itself; the local launcher sets RLJAX_COORDINATOR, RLJAX_NUM_PROCESSES, RLJAX_PROCESS_ID.
    """
    import jax

    platform = os.environ.get("RLJAX_PLATFORM")
    if platform:
        jax.config.update("jax_platforms", platform)
    if os.environ.get("RLJAX_COORDINATOR"):
        jax.distributed.initialize(
            coordinator_address=os.environ["RLJAX_COORDINATOR"],
            num_processes=int(os.environ["RLJAX_NUM_PROCESSES"]),
            process_id=int(os.environ["RLJAX_PROCESS_ID"]),
        )
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 and os.environ.get("SLURM_STEP_ID") is not None:
        jax.distributed.initialize()
    print(
        f"rljax: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} local devices",
        flush=True,
    )


def run(cfg: config_lib.Config, workdir: str) -> None:
    """Validates the config against this machine and runs the training loop."""
    initialize_jax()
    import jax

    try:
        config_lib.validate_runtime(cfg, jax.device_count())
    except config_lib.ConfigError as e:
        fail(f"config: {e}")
    try:
        from rljax import loop
    except ImportError as e:
        fail(f"config is valid, but the training loop is not available in this build ({e})", code=3)
    loop.train(cfg, workdir)
