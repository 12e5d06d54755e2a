"""A distinct unprivileged uid per concurrently running sandbox (when rljax runs as root).

Slot k is uid/gid `UID_BASE + k`, a number with no account on the machine. A slot is held by an exclusive
`flock` on `<LOCK_DIR>/slot-<k>.lock` for the length of one run, so concurrent sandboxes (threads, reward
workers, several trainers on one machine) never share a uid: one cannot signal, ptrace or read the files
of another, and RLIMIT_NPROC (counted per uid) is not shared. A crashed holder's lock is released by the
kernel with its file descriptor.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
from collections.abc import Iterator

UID_BASE = 1_900_000_000  # far above distributions' user ranges and the usual subuid ranges (100000+)
NUM_SLOTS = 1024
LOCK_DIR = pathlib.Path("/run/rljax-sandbox-slots" if os.path.isdir("/run") else "/tmp/rljax-sandbox-slots")


def _lock_dir() -> pathlib.Path:
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    info = LOCK_DIR.stat()
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(f"sandbox slot dir {LOCK_DIR} must be owned by uid {os.geteuid()}, mode 0700")
    return LOCK_DIR


@contextlib.contextmanager
def hold_slot() -> Iterator[int]:
    """Yields a uid no other running sandbox holds; raises RuntimeError when all NUM_SLOTS are taken."""
    directory = _lock_dir()
    start = (os.getpid() * 7919 + id(object())) % NUM_SLOTS  # spread concurrent callers over the range
    for k in range(NUM_SLOTS):
        slot = (start + k) % NUM_SLOTS
        fd = os.open(directory / f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield UID_BASE + slot
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"all {NUM_SLOTS} sandbox uid slots are in use")
