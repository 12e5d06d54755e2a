"""The reward workers' per-run directory and environment.

Every RewardPool keeps its workers' temp dirs (and so every sandbox dir) under one directory,
`<tmp>/rljax-rewards/run-<pid>-<random>`, which it holds an exclusive `flock` on for its lifetime. A pool
starting up removes the directories of pools that are gone (their lock is free: the kernel drops it with a
killed trainer's file descriptor), so a trainer SIGKILLed mid-run leaks nothing past the next start. The
lock, not a PID, decides: a PID may be reused or belong to another PID namespace.

Workers get an allow-listed environment: what Python, locales and BLAS need, PYTHONPATH, and rljax's
own `RLJAX_*` settings; nothing named like a token, key, secret or password, even when allow-listed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from rljax import envvars, lockdir

ALLOWED_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH",
        "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "VIRTUAL_ENV",
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XDG_CACHE_HOME",
    }
)  # fmt: skip
ALLOWED_PREFIXES = ("LC_", "RLJAX_")
RUN_PREFIX = "run-"  # <tmp>/rljax-rewards/run-<pid>-<random>


def worker_env(environ: dict[str, str] | os._Environ, tmpdir: str) -> dict[str, str]:
    """The allow-listed subset of `environ`, with TMPDIR set to the worker's own dir."""
    env = {
        name: value
        for name, value in environ.items()
        if (name in ALLOWED_ENV or name.startswith(ALLOWED_PREFIXES)) and not envvars.is_secret(name)
    }
    env["TMPDIR"] = tmpdir
    return env


def _base() -> pathlib.Path:
    base = pathlib.Path(tempfile.gettempdir(), "rljax-rewards")
    base.mkdir(mode=0o711, exist_ok=True)  # 0711: audit-mode sandboxes traverse down to their workdir
    return base


def sweep_stale() -> int:
    """Removes run dirs whose pool is gone (their lock is free); returns how many were removed."""
    return len(lockdir.sweep_unlocked(_base(), RUN_PREFIX))


class RunDir:
    """This pool's locked run dir; `new_worker_dir()` makes a worker's temp dir in it."""

    def __init__(self) -> None:
        sweep_stale()
        # 0711: audit-mode sandboxes (other uids) traverse it to their workdir, but cannot list it
        self.path, self._lock_fd = lockdir.make_locked_dir(_base(), RUN_PREFIX, 0o711)
        self.path = pathlib.Path(self.path)

    def new_worker_dir(self) -> str:
        path = tempfile.mkdtemp(prefix="worker-", dir=self.path)
        os.chmod(path, 0o711)  # traversable by an audit-mode sandbox uid, not listable or readable
        return path

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
