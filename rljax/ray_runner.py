"""The Ray actor of `rljax.ray_launch`: one command on one node, its output to the driver and a log file.

Importing this module does not import Ray (`ray.remote(ProcessRunner)` happens in the launcher).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading


def _die_with_parent() -> None:
    """In the child: SIGKILL when the actor's process dies (ray.kill, SIGKILL): none outlives its actor."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)


class ProcessRunner:
    """One command on one node, a Ray actor (`ray.remote(ProcessRunner)`). Every method returns at once,
    so the actor runs them in turn on its main thread (whose death the child's PDEATHSIG watches)."""

    def __init__(self, name: str):
        self._name = name
        self._proc: subprocess.Popen | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((self.node_ip(), 0))
            return s.getsockname()[1]

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str | None) -> int:
        """Starts `argv` with this node's environment updated by `env`; returns its pid."""
        env, out = (
            {**os.environ, **env},
            {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True},
        )
        self._proc = subprocess.Popen(argv, cwd=cwd, env=env, preexec_fn=_die_with_parent, **out)
        threading.Thread(target=self._pump, args=(log_path,), daemon=True).start()
        return self._proc.pid

    def _pump(self, log_path: str | None) -> None:
        if log_path:
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path or os.devnull, "a", buffering=1) as log:
            for line in self._proc.stdout:
                print(f"[{self._name}] {line}", end="", flush=True)  # Ray forwards it to the driver
                log.write(line)

    def poll(self) -> int | None:
        """The exit code (128 + N for signal N), or None while it runs."""
        code = self._proc.poll()
        return code if code is None or code >= 0 else 128 - code

    def send_signal(self, signum: int) -> None:
        self._proc.send_signal(signum)  # nothing once it has exited (Popen polls first)
