"""Entry point: `python -m rljax.main --config=configs/grpo.py[:preset] --workdir=DIR [--config.a.b=v ...]`.

The only module that reads flags. User errors (bad config, bad flags, impossible setups) exit non-zero
with one line on stderr naming the field; they never print a traceback.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from rljax import config as config_lib
from rljax.runtime import fail  # one line on stderr, exit 2: the same for every user error

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/grpo.py or configs/grpo.py:smoke.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: metrics, checkpoints, logs; reused to resume."
)


def check_argv(argv: list[str]) -> None:
    """Rejects unknown/ill-typed `--config.*` overrides and a missing config file before absl parses."""
    config_arg = None
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("--config.") or arg.startswith("-config."):
            body = arg.split("config.", 1)[1]
            if "=" not in body:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if nxt is None or nxt.startswith("-"):
                    raise config_lib.ConfigError(body, "override needs a value: --config.<key>=<value>")
                key, text = body, nxt
            else:
                key, text = body.split("=", 1)
            config_lib.parse_override(key, text)
        elif arg.startswith("--config=") or arg.startswith("-config="):
            config_arg = arg.split("=", 1)[1]
        elif arg in ("--config", "-config") and i + 1 < len(argv):
            config_arg = argv[i + 1]
    if config_arg is None:
        raise config_lib.ConfigError("--config", "is required, e.g. --config=configs/grpo.py")
    path, _, preset = config_arg.partition(":")
    if not os.path.isfile(path):
        raise config_lib.ConfigError("--config", f"no such config file: {path!r}")
    _load_config_file(path, preset or None)


def _load_config_file(path: str, preset: str | None) -> None:
    """Runs the config file's get_config once, so its own errors (e.g. an unknown preset) read clearly."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.spec_from_file_location("rljax_user_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cd = module.get_config(preset)
    except config_lib.ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's config file: a syntax error, a bad import, ...
        raise config_lib.ConfigError("--config", f"{path}: {type(e).__name__}: {e}") from None
    config_lib.from_config_dict(cd)


def load_config() -> config_lib.Config:
    """The typed, validated config from the parsed flags."""
    return config_lib.validate(config_lib.from_config_dict(_CONFIG.value))


def _main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)  # orbax and JAX log every save at INFO
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]!r}; pass options as --config.<key>=<value>")
    try:
        cfg = load_config()
    except config_lib.ConfigError as e:
        fail(f"config: {e}")
    if not _WORKDIR.value:
        fail("--workdir is required (a directory for metrics, checkpoints and logs)")
    from rljax import runtime

    runtime.run(cfg, _WORKDIR.value)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with a bad flag (e.g. an unknown one) as one line and exit 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"flags: {e}")


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    try:
        check_argv(argv)
    except config_lib.ConfigError as e:
        fail(f"config: {e}")
    try:
        app.run(_main, argv=argv, flags_parser=_parse_flags)
    except config_lib.ConfigError as e:  # raised by a config file's get_config (e.g. unknown preset)
        fail(f"config: {e}")


if __name__ == "__main__":
    run()
