"""Per-run directories whose liveness is a lock, not a PID.

A process that owns a run directory holds an exclusive `flock` on `<dir>/.lock` while it lives; the kernel
drops the lock with the process's file descriptors, even after a SIGKILL. A sweep removes only directories
whose lock it can take, so a live owner's directory is never touched, whatever PID namespace it runs in
(PIDs are reused and differ across namespaces; the PID in a name is only a label).
Used by the weight-sync bucket directories (`rljax.weight_sync.staging`) and the reward workers' temp
directories (`rljax.rewards._workdirs`). Standard library only.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import uuid

LOCK_NAME = ".lock"


def try_lock(path: str | os.PathLike) -> int | None:
    """A descriptor holding an exclusive lock on the existing file `path`, or None when someone else holds
    it (or it cannot be opened: not ours, a symlink, gone)."""
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


def make_locked_dir(root: str | os.PathLike, prefix: str, mode: int) -> tuple[str, int]:
    """Creates `<root>/<prefix><pid>-<random>` with `mode` and returns (its path, the descriptor holding its
    lock). It gets that name only once locked, so a sweep never sees it unlocked."""
    root = os.fspath(root)
    tmp = tempfile.mkdtemp(prefix=f".init-{prefix}", dir=root)
    os.chmod(tmp, mode)
    fd = os.open(
        os.path.join(tmp, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    path = os.path.join(root, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.rename(tmp, path)
    return path, fd


def sweep_unlocked(root: str | os.PathLike, prefix: str) -> list[str]:
    """Removes the `<root>/<prefix>*` directories whose lock is free (their owner is gone); returns them."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(os.fspath(root), name)
        fd = try_lock(os.path.join(path, LOCK_NAME))
        if fd is None:  # held by a live owner, or not a run directory of ours
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        removed.append(path)
    return removed
