"""One receiver per node for streamed buckets: each rollout node pulls each byte once.

Every vLLM worker on a node (the TP ranks of one server, and the workers of every server there) gets
the same `update_info`s. For a streamed bucket (one with a `source`: `{"transport", "id", ...}`, see
`rljax.weight_sync.transports`), the first worker to claim it downloads it into a file on the node's
staging root (`RLJAX_STAGING_DIR`, /dev/shm); the others wait for that file and map it. So a trainer
host sends each of its buckets once per node, not once per worker.

Layout: `<root>/rljax-rx-<source id>/` (0700, one per trainer source and sync; `.lock` is held shared by
every worker using it) holding `<bucket>` files. Claiming a bucket: create a private temp file, lock it
exclusively, hard-link it to `<bucket>.part` (the link fails if another worker claimed it first);
download into its mapping; rename it to `<bucket>`. A waiter polls a shared lock on the `.part`: once it
gets the lock the receiver is done (the file was renamed) or gone (the `.part` is removed, and the waiter
claims the bucket itself: a receiver that fails or dies costs a retry, not a hang; every download has the
transport's receive timeout). The last worker to release a directory removes it; directories of workers
that were killed are swept (their lock is free) when a later session starts.

`fetch_buckets` pulls a list of buckets with one thread per source (trainer host) in parallel, one
connection per source.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rljax import lockdir
from rljax.weight_sync import staging

RX_PREFIX = "rljax-rx-"
MAX_SOURCES = 8  # threads pulling from different trainer hosts at once
POLL_S = 0.002
_SOURCE_ID = re.compile(r"[0-9a-f]{8,64}")


class NodeDir:
    """This worker's share of one source's receive directory under `root` (see the module docstring)."""

    def __init__(self, root: str, source_id: str):
        if not _SOURCE_ID.fullmatch(source_id):
            raise ValueError(f"weight sync: bad source id {source_id[:80]!r} (expected hex)")
        self.path = os.path.join(root, RX_PREFIX + source_id)
        self.downloaded = 0  # buckets this worker pulled itself (the others it mapped)
        self._lock_fd: int | None = _join(root, self.path)

    def get(self, index: int, expected: int, download: Callable) -> tuple[mmap.mmap | None, int]:
        """Bucket `index` (`expected` bytes) as a mapping of the node's copy, pulled by
        `download(allocate)` (`client.fetch`'s contract) if no other worker on the node has it yet."""
        final = os.path.join(self.path, str(int(index)))
        part = final + ".part"
        while True:
            found = _map_existing(final, expected)
            if found is not False:
                return found, expected
            fd = _claim(self.path, part)
            if fd is not None and os.path.exists(final):  # finished between the check and the claim
                _unlink(part)
                os.close(fd)
            elif fd is not None:
                return self._receive(fd, part, final, expected, download), expected
            _wait_released(part)

    def _receive(self, fd: int, part: str, final: str, expected: int, download) -> mmap.mmap | None:
        try:
            os.ftruncate(fd, expected)
            m = mmap.mmap(fd, expected) if expected else None
            download(lambda n: m if n == expected else _refuse(n, expected))
            os.rename(part, final)
        except BaseException:
            _unlink(part)
            raise
        finally:  # releases the claim (explicitly: the mapping holds a dup of `fd`): waiters map `final`,
            fcntl.flock(fd, fcntl.LOCK_UN)  # or claim the bucket again
            os.close(fd)
        self.downloaded += 1
        return m

    def release(self) -> None:
        """Stops using the directory; the last worker on the node removes it."""
        if self._lock_fd is None:
            return
        os.close(self._lock_fd)
        self._lock_fd = None
        fd = lockdir.try_lock(os.path.join(self.path, lockdir.LOCK_NAME))
        if fd is not None:  # nobody else holds it shared
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(fd)


class NodeDirs:
    """The `NodeDir`s of one update session, by source id (thread-safe); `release()` at finish. `root`:
    the node's staging root (default: `RLJAX_STAGING_DIR`, as set on vLLM servers, else /dev/shm)."""

    def __init__(self, root: str | None = None):
        self.root = root or os.environ.get(staging.STAGING_DIR_ENV) or staging.DEFAULT_STAGING_DIR
        os.makedirs(self.root, exist_ok=True)
        lockdir.sweep_unlocked(self.root, RX_PREFIX)  # leftovers of killed workers pin RAM in /dev/shm
        self._dirs: dict[str, NodeDir] = {}
        self._lock = threading.Lock()

    def get(self, source_id: str) -> NodeDir:
        with self._lock:
            if source_id not in self._dirs:
                self._dirs[source_id] = NodeDir(self.root, source_id)
            return self._dirs[source_id]

    def downloaded(self) -> int:
        return sum(d.downloaded for d in self._dirs.values())

    def release(self) -> None:
        with self._lock:
            for d in self._dirs.values():
                d.release()
            self._dirs = {}


class Puller:
    """A worker's streamed buckets for one update session: `start(items)` pulls them in a background thread
    (prefetch, before the pause), `get(item)` returns one (prefetched, or pulled now), `release()` at
    finish; an item is `(source, bucket index, expected bytes)`. `prefetch_s`/`recv_s`: time spent pulling
    in the background / on the load path."""

    def __init__(self, connect: Callable, root: str | None = None):
        self._connect, self._root = connect, root
        self._nodes: NodeDirs | None = None
        self._thread: threading.Thread | None = None
        self.reset()

    def reset(self) -> None:
        self.join()
        self._done: dict = {}  # (source id, index) -> (buffer, nbytes) or (None, exception)
        self.prefetch_s = self.recv_s = 0.0

    def _pull(self, items: list) -> None:
        self._nodes = self._nodes or NodeDirs(self._root)
        self._done |= fetch_buckets(items, self._nodes, self._connect)

    def start(self, items: list[tuple[dict, int, int]]) -> None:
        self.join()

        def run():
            t0 = time.perf_counter()
            try:
                self._pull(items)
            except BaseException as e:  # noqa: BLE001 - raised by the load call that needs it
                self._done[(str(items[0][0].get("id")), int(items[0][1]))] = (None, e)
            self.prefetch_s += time.perf_counter() - t0

        self._thread = threading.Thread(target=run, daemon=True, name="rljax-ws-prefetch")
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def get(self, item: tuple[dict, int, int]) -> tuple[mmap.mmap | None, int]:
        self.join()
        key = (str(item[0]["id"]), int(item[1]))
        if key not in self._done:
            t0 = time.perf_counter()
            self._pull([item])
            self.recv_s += time.perf_counter() - t0
        buf, size = self._done.pop(key)
        if buf is None:
            raise size
        return buf, size

    def release(self) -> None:
        """Drops this worker's hold on the node's received files (the last worker removes them)."""
        self.join()
        self._done = {}
        if self._nodes is not None:
            self._nodes.release()
            self._nodes = None


def fetch_buckets(items: list[tuple[dict, int, int]], dirs: NodeDirs, connect: Callable) -> dict:
    """Pulls `items` (`(source, bucket index, expected bytes)`) through the node's receive directories,
    one thread per source (at most `MAX_SOURCES` at once), one connection (`connect(source)`) per source,
    opened only if this worker downloads something. Returns `{(source id, index): (buffer, nbytes)}`; a
    source whose pull failed stops there, its failing bucket mapped to `(None, exception)`."""
    groups: dict[str, list] = {}
    for source, index, expected in items:
        groups.setdefault(str(source["id"]), []).append((source, int(index), int(expected)))
    out: dict = {}
    with ThreadPoolExecutor(max_workers=min(MAX_SOURCES, len(groups) or 1)) as pool:
        for part in pool.map(lambda g: _pull(g, dirs, connect), groups.values()):
            out |= part
    return out


def _pull(group: list[tuple[dict, int, int]], dirs: NodeDirs, connect: Callable) -> dict:
    out: dict = {}
    client = None
    try:
        for source, index, expected in group:

            def download(allocate, index=index, expected=expected, source=source):
                nonlocal client
                if client is None:
                    client = connect(source)
                return client.fetch(index, expected, allocate)

            try:
                out[(str(source["id"]), index)] = dirs.get(str(source["id"])).get(index, expected, download)
            except BaseException as e:  # noqa: BLE001 - raised by the load call that needs this bucket
                out[(str(source["id"]), index)] = (None, e)
                break
    finally:
        if client is not None:
            client.close()
    return out


def _join(root: str, path: str) -> int:
    """A descriptor holding `path/.lock` shared, creating the directory (0700) if needed."""
    while True:
        try:
            fd = os.open(os.path.join(path, lockdir.LOCK_NAME), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            tmp = tempfile.mkdtemp(prefix=".init-rx-", dir=root)  # 0700
            fd = os.open(os.path.join(tmp, lockdir.LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.rename(tmp, path)  # fails if another worker made it first (it is not empty)
                return fd
            except OSError:
                os.close(fd)
                shutil.rmtree(tmp, ignore_errors=True)
                continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        st, dst = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if st.st_nlink == 0:  # swept meanwhile
            os.close(fd)
            continue
        if dst.st_uid != os.getuid() or dst.st_mode & 0o077:
            os.close(fd)
            raise ValueError(f"weight sync: receive directory {path} is not private to this user")
        return fd


def _claim(directory: str, part: str) -> int | None:
    """A descriptor of `part`, locked exclusively, if this worker claimed it; None if another did."""
    tmp = os.path.join(directory, f".claim-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        os.link(tmp, part)
        return fd
    except FileExistsError:
        os.close(fd)
        return None
    finally:
        os.unlink(tmp)


def _wait_released(part: str) -> None:
    """Returns once no receiver holds `part` (done: renamed; failed or killed: the file is removed)."""
    try:
        fd = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(POLL_S)
        if os.fstat(fd).st_nlink and os.path.exists(part):  # still `.part`, unlocked: its receiver died
            if os.path.samestat(os.fstat(fd), os.stat(part, follow_symlinks=False)):
                _unlink(part)
    finally:
        os.close(fd)


def _map_existing(final: str, expected: int):
    """A read-only mapping of the complete bucket `final` (None if empty), False if it is not there yet."""
    try:
        fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise ValueError(f"weight sync: the node's copy {final} has {size} bytes, expected {expected}")
        return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)


def _refuse(n: int, expected: int):
    raise ValueError(f"weight sync: asked to allocate {n} bytes for a bucket of {expected}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
