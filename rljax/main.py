"""Entry point: `python -m rljax.main --config=configs/grpo.py[:preset] --workdir=DIR [--config.a.b=v ...]`.

The training CLI. `run(argv)` parses `--config` and its `--config.<key>=<value>` overrides from `argv`
with `rljax.runtime.config_from_args` (the parser every CLI shares; `sys.argv` is not consulted when
`argv` is given), hands the other flags (`--workdir`, absl's own) to absl, then starts the run: JAX
distributed init, runtime checks, every user input resolved, preflight, the loop. User errors (bad config,
bad flags, impossible setups) exit 2 with one line on stderr naming the field; they never print a traceback.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from rljax import config as config_lib
from rljax import device_plan, runtime
from rljax.models.fetch import with_model_fetched
from rljax.runtime import fail  # one line on stderr, exit 2: the same for every user error

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: metrics, checkpoints, logs; reused to resume."
)


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


def start(cfg: config_lib.Config, workdir: str) -> None:
    """Validates the config against this machine (config checks, every user input resolved, then
    preflight) and runs the loop. User errors exit 2 with one line before any server starts."""
    try:  # the devices' plan: before JAX starts, which preallocates its share of every GPU it sees
        os.environ.update(device_plan.planned_trainer_env(cfg))
    except config_lib.ConfigError as e:
        fail(f"config: {e}")
    runtime.initialize_jax()
    cfg = with_model_fetched(cfg)
    import jax

    from rljax.loop.inputs import resolve_inputs

    try:
        config_lib.validate_runtime(cfg, jax.device_count(), jax.process_count())
        examples = resolve_inputs(cfg, workdir)
    except config_lib.ConfigError as e:
        fail(f"config: {e}")
    preflight_or_fail(cfg)
    from rljax.checkpoint import CheckpointError, CheckpointMismatchError
    from rljax.loop.train import train
    from rljax.models.hf import CheckpointFormatError
    from rljax.rollout import EngineCrashError, RecoveryExhaustedError

    try:
        train(cfg, workdir, examples=examples)
    except CheckpointFormatError as e:  # found while loading the weights (e.g. a NaN), before any server
        fail(f"config: model.path: {e}")
    except CheckpointMismatchError as e:  # the workdir's checkpoints were saved with another config
        fail(f"checkpoint: {e}")
    except CheckpointError as e:  # not a user error: exit 1, still one line
        fail(f"checkpoint: {e}", code=1)
    except (EngineCrashError, RecoveryExhaustedError) as e:  # the engine, not the user: exit 1, one line
        fail(f"rollout: {e}", code=1)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with a bad flag (e.g. an unknown one) as one line and exit 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"flags: {e}")


def run(argv: list[str] | None = None) -> None:
    """`python -m rljax.main` with `argv` (default `sys.argv`; `argv[0]` is the program name)."""
    argv = list(sys.argv if argv is None else argv)
    flags.FLAGS.unparse_flags()  # a second in-process run starts from the defaults, as a new process does
    try:
        _, _, rest = runtime.split_config_args(argv[1:])
        cfg = runtime.config_from_args(argv[1:])
    except config_lib.ConfigError as e:
        fail(f"config: {e}")

    def main(args: list[str]) -> None:
        logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
        if len(args) > 1:
            fail(f"unexpected arguments {args[1:]!r}; pass options as --config.<key>=<value>")
        if not _WORKDIR.value:
            fail("--workdir is required (a directory for metrics, checkpoints and logs)")
        start(cfg, _WORKDIR.value)

    app.run(main, argv=[argv[0], *rest], flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
