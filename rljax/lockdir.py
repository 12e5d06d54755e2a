"""Per-run directories whose liveness is a lock, not a PID.

A process that owns a run directory holds an exclusive `flock` on `<dir>/.lock` while it lives; the kernel
drops the lock with the process's file descriptors, even after a SIGKILL. A sweep removes only directories
whose lock it can take, so a live owner's directory is never touched, whatever PID namespace it runs in
(PIDs are reused and differ across namespaces; the PID in a name is only a label).
Used by the weight-sync bucket directories (`rljax.weight_sync.staging`), the vLLM servers' temp
directories (`rljax.rollout.server`) and the reward workers' temp directories (`rljax.rewards._workdirs`).
Standard library only.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

LOCK_NAME = ".lock"
# Runs in a child of the owner (`python -I -S -c`): waits for the owner to exit (stdin reaches EOF, even
# after a SIGKILL), then removes the directory once its lock is free (a live owner still holds it).
_REAPER = """
import fcntl, os, shutil, sys
sys.stdin.buffer.read()
try:
    fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_NOFOLLOW)
    fcntl.flock(fd, fcntl.LOCK_EX)
except OSError:
    sys.exit(0)
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


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


class ReapedDir:
    """A private locked directory `<root>/<prefix><pid>-<random>` (mode `mode`), removed on `close()`.

    A SIGKILL of its owner skips every clean-up, so a small reaper process (started here, in its own session)
    removes the directory as soon as the owner is gone; `sweep_unlocked` by a later owner covers a reaper
    that died too.
    """

    def __init__(self, root: str | os.PathLike, prefix: str, mode: int = 0o700):
        os.makedirs(root, exist_ok=True)
        self.path, self._lock_fd = make_locked_dir(root, prefix, mode)
        self._reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # outlives a kill of the owner's process group
        )

    def close(self) -> None:
        """Removes the directory and everything in it, releases the lock, ends the reaper."""
        if self._lock_fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        self._reaper.stdin.close()  # EOF: the reaper finds nothing left and exits
        try:
            self._reaper.wait(5)
        except subprocess.TimeoutExpired:
            self._reaper.kill()
