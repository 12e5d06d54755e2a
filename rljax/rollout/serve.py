"""One vLLM server for rljax on a node of its own (launch/gpu_slurm.sh: one Slurm step per rollout node).

    python -m rljax.rollout.serve --host ADDR --port 8000 --token-file FILE [--model PATH] [--print] \
        [--vllm-arg=ARG ...] -- <the trainer's rljax.main args>

The command is the one rljax builds for a server it owns (`server.server_command` / `server.server_env`, with
options from the trainer's own config by `server_options`), so the flags are stated once:
- every route but `GET /health` needs the job's bearer token (`--middleware rljax.rollout.auth...`), read from
  FILE (mode 0600, handed over by path in `RLJAX_SERVER_TOKEN_FILE`, never on the command line);
- `--weight-transfer-config {"backend": <rollout.weight_sync.transport>}` (tcp across nodes),
  `--logprobs-mode processed_logprobs`, `VLLM_SERVER_DEV_MODE=1` (the RL weight-update routes);
- bound to ADDR only: a wildcard is refused, a non-loopback address needs `rollout.vllm.allow_remote=true`.
Then it execs the server (the step's process is vLLM itself); `--print` prints the changed environment and
the argv (shell-quoted) instead. Config errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from rljax import config as config_lib
from rljax.config import is_loopback_host
from rljax.rollout import auth
from rljax.rollout.server import ServerOptions, options_from_config, server_command, server_env
from rljax.runtime import config_from_args
from rljax.weight_sync.staging import STAGING_DIR_ENV

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def server_options(cfg: config_lib.Config, extra_args: tuple[str, ...] = ()) -> ServerOptions:
    """The ServerOptions of a server for the run `cfg`: an owned server's (`server.options_from_config`),
    with `extra_args` (`--vllm-arg`) after the config's own."""
    return options_from_config(cfg, extra_args=tuple(cfg.rollout.vllm.extra_args) + tuple(extra_args))


def check_bind(host: str, allow_remote: bool) -> None:
    """ConfigError unless `host` is one address: never a wildcard; non-loopback only with allow_remote."""
    if host in WILDCARD_HOSTS:
        raise config_lib.ConfigError(
            "--host", f"{host!r} binds every interface; give the node's private address (or 127.0.0.1)"
        )
    if not (allow_remote or is_loopback_host(host)):
        raise config_lib.ConfigError(
            "rollout.vllm.allow_remote",
            f"{host!r} is not a loopback address: set rollout.vllm.allow_remote=true to serve on it",
        )


def build(opts: argparse.Namespace, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the server for `opts` and the trainer's `args`."""
    from rljax.models.fetch import with_model_fetched

    cfg = with_model_fetched(config_from_args(args))  # a fetchable model name: its converted directory
    check_bind(opts.host, cfg.rollout.vllm.allow_remote)
    token_file = os.path.abspath(opts.token_file)
    try:
        auth.read_token_file(token_file)  # fail here, in one line, rather than in vLLM's start-up
    except (OSError, ValueError) as e:
        raise config_lib.ConfigError("--token-file", str(e)) from e
    options = server_options(cfg, tuple(opts.vllm_arg))
    argv = server_command(opts.model or cfg.model.path, opts.host, opts.port, options)
    return argv, server_env(options) | {auth.TOKEN_FILE_ENV: token_file, STAGING_DIR_ENV: options.staging_dir}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m rljax.rollout.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--host", required=True, help="the one address to bind (the node's private one)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-file", required=True, help="0600 file with the job's bearer token")
    parser.add_argument("--model", default="", help="checkpoint to serve (default: the config's model.path)")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one extra vLLM argument")
    parser.add_argument("--print", action="store_true", help="print the command instead of running it")
    opts = parser.parse_args(ours)
    try:
        cmd, env = build(opts, rest)
    except config_lib.ConfigError as e:
        print(f"rljax: error: config: {e}", file=sys.stderr)
        return 2
    if opts.print:  # what differs from this environment, then the argv
        for key in sorted(k for k in env if os.environ.get(k) != env[k]):
            print(f"rljax-serve: env {key}={shlex.quote(env[key])}")
        print("rljax-serve: exec " + shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    sys.exit(main())
