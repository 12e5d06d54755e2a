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

import fcntl
import os
import pathlib
import shutil
import tempfile

from rljax import envvars

ALLOWED_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH",
        "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "VIRTUAL_ENV",
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XDG_CACHE_HOME",
    }
)  # fmt: skip
ALLOWED_PREFIXES = ("LC_", "RLJAX_")


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


def _try_lock(path: pathlib.Path) -> int | None:
    """An fd holding an exclusive lock on `path`, or None when someone holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_stale() -> int:
    """Removes run dirs whose pool is gone (their lock is free); returns how many were removed."""
    removed = 0
    for run in _base().glob("run-*"):
        fd = _try_lock(run / "lock")
        if fd is None:
            continue  # a live pool holds it (a dir is only named run-* once its lock is held)
        try:
            shutil.rmtree(run, ignore_errors=True)
            removed += 1
        finally:
            if fd is not None:
                os.close(fd)
    return removed


class RunDir:
    """This pool's locked run dir; `new_worker_dir()` makes a worker's temp dir in it."""

    def __init__(self) -> None:
        sweep_stale()
        new = pathlib.Path(tempfile.mkdtemp(prefix="new-", dir=_base()))
        os.chmod(new, 0o711)
        (new / "lock").touch(mode=0o600)
        self._lock_fd = _try_lock(new / "lock")
        self.path = new.with_name(f"run-{os.getpid()}-{new.name[4:]}")
        new.rename(self.path)  # visible to sweeps only now that it is locked

    def new_worker_dir(self) -> str:
        path = tempfile.mkdtemp(prefix="worker-", dir=self.path)
        os.chmod(path, 0o711)  # traversable by an audit-mode sandbox uid, not listable or readable
        return path

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
