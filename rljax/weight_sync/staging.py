"""Host staging: a stream of `(hf_name, array)` -> bucket files of at most `bucket_bytes` each.

Tensors are written to the current bucket file as they arrive (one tensor in process memory at a
time, straight from `rljax.models.iter_hf_tensors`'s device->host copy), so the trainer's extra host
memory is one tensor plus the bucket files, all staged before the pause (`WeightSyncer`: the files are
the copy of the model on its way to the engine, and are unlinked when the sync ends).
A tensor larger than `bucket_bytes` gets a bucket of its own.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from rljax import lockdir
from rljax.weight_sync import wire

DEFAULT_STAGING_DIR = "/dev/shm"
STAGING_DIR_ENV = "RLJAX_STAGING_DIR"  # set on vLLM servers: the root their workers may map buckets from
RUN_PREFIX = "rljax-ws-"  # per-run directories: <root>/rljax-ws-<pid>-<random>/ (the pid only names it)


class RunDir(lockdir.ReapedDir):
    """A private directory (0700) for one trainer's bucket files under `root`, removed on `close()`.

    Liveness is a lock, not a PID (PIDs are reused and differ across PID namespaces): the trainer holds an
    exclusive `flock` on `<dir>/.lock` while it lives, and `sweep_stale_run_dirs` removes only directories
    whose lock it can take. A SIGKILL skips every cleanup, so a small reaper process (`lockdir.ReapedDir`)
    removes the directory as soon as the trainer is gone; a later trainer's sweep covers a reaper that died
    too.
    """

    def __init__(self, root: str | os.PathLike = DEFAULT_STAGING_DIR):
        super().__init__(root, RUN_PREFIX, 0o700)


def sweep_stale_run_dirs(root: str | os.PathLike = DEFAULT_STAGING_DIR) -> list[str]:
    """Removes run directories under `root` whose owner is gone (their lock is free); returns their paths.
    A live trainer's directory is never touched, whatever PID namespace it runs in."""
    return lockdir.sweep_unlocked(root, RUN_PREFIX)


def open_bucket(path: str, root: str | os.PathLike) -> int:
    """An O_RDONLY descriptor of the bucket file `path`, which must be `<root>/rljax-ws-*/<file>`: no `..`,
    no symlink in the run directory or the file (O_NOFOLLOW), a regular file in a directory owned by this
    user with no group/other access. The worker-side confinement of the shm transport."""
    root = os.fspath(root)
    run, name = os.path.split(str(path))
    parent, run_name = os.path.split(run)
    if (
        os.path.normpath(str(path)) != str(path)
        or os.path.normpath(parent) != os.path.normpath(root)
        or not run_name.startswith(RUN_PREFIX)
        or not name
        or name.startswith(".")
    ):
        raise ValueError(
            f"weight sync: bucket path {path!r} is not a bucket file in a run directory of {root}"
        )
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        run_fd = os.open(run_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(run_fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"weight sync: run directory {run} is not private to this user")
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=run_fd)  # a FIFO: no hang
    finally:
        os.close(run_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"weight sync: bucket path {path!r} is not a regular file")
    return fd


@dataclasses.dataclass
class Bucket:
    """One staged file: its path, index in the sync, tensor entries and size in bytes."""

    path: str
    index: int
    entries: list[wire.TensorEntry]
    nbytes: int
    owned: bool = True  # False: another process staged it (sharded staging) and removes it itself
    source: dict | None = None  # the bucket server of the process that staged it (tcp/zmq), if it serves it

    def update_info(self, *, copy: bool) -> dict:
        return wire.update_info(self.path, self.index, self.entries, copy=copy)

    def unlink(self) -> None:
        if not self.owned:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def descriptor(self) -> dict:
        """JSON-able metadata (no tensor bytes) another process pushes this bucket with: path, index, size,
        entries (name, dtype, block shape, offset, nbytes, crc32, slice of the full tensor)."""
        return {
            "path": self.path,
            "index": self.index,
            "nbytes": self.nbytes,
            "tensors": [e.to_wire() for e in self.entries],
            "source": self.source,
        }

    @staticmethod
    def from_descriptor(d: dict) -> Bucket:
        entries = [wire.TensorEntry.from_wire(t) for t in d["tensors"]]
        return Bucket(
            str(d["path"]), int(d["index"]), entries, int(d["nbytes"]), owned=False, source=d.get("source")
        )


@dataclasses.dataclass(frozen=True)
class StagedBuckets:
    """Buckets already staged by every process of a job (sharded staging): `WeightSyncer.push_staged` pushes
    them as they are, and their files are left to the processes that wrote them (`Bucket.owned` False).
    `per_process` is each process's staged tensor bytes."""

    buckets: list[Bucket]
    per_process: tuple[int, ...] = ()
    # Buckets with a `source` are served by the processes that staged them: `wait_sent(copies, timeout_s)`
    # blocks until each was sent `copies` times (once per rollout host), True when all were.
    wait_sent: Callable[[int, float], bool] | None = None


class ShardStager:
    """One process's bucket writer for sharded staging: `stage(items, first_index)` writes `(hf_name,
    array, hf_index)` items (`rljax.models.iter_owned_hf_slices`) into bucket files in this process's own
    run directory under `staging_dir` and returns them, numbered from `first_index` (distinct per
    process, so one update can list every process's buckets). `close()` removes the directory."""

    def __init__(self, staging_dir: str, *, bucket_bytes: int, checksums: bool, spec: dict | None):
        self.staging_dir, self.bucket_bytes, self.checksums, self.spec = (
            staging_dir,
            bucket_bytes,
            checksums,
            spec,
        )
        sweep_stale_run_dirs(staging_dir)
        self._run_dir: RunDir | None = None
        self.staged_bytes = 0

    def stage(self, items: Iterable[tuple], first_index: int) -> list[Bucket]:
        if self._run_dir is None:
            self._run_dir = RunDir(self.staging_dir)
        out: list[Bucket] = []
        gen = stage_buckets(
            items,
            bucket_bytes=self.bucket_bytes,
            directory=self._run_dir.path,
            checksums=self.checksums,
            spec=self.spec,
            first_index=first_index,
        )
        try:
            out.extend(gen)
        except BaseException:
            for b in out:
                b.unlink()
            raise
        self.staged_bytes = sum(e.nbytes for b in out for e in b.entries)  # tensor bytes, last stage()
        return out

    def close(self) -> None:
        if self._run_dir is not None:
            self._run_dir.close()
            self._run_dir = None


def wire_dtype(array: np.ndarray) -> str:
    """The wire name of `array`'s dtype (float32, bfloat16 from ml_dtypes, float16)."""
    name = str(array.dtype)
    if name not in wire.DTYPES:
        raise ValueError(f"unsupported dtype {name} for weight sync; valid: {', '.join(wire.DTYPES)}")
    return name


class _BucketFile:
    def __init__(self, path: str, index: int):
        self.path, self.index, self.entries, self.size = path, index, [], 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._f = open(fd, "wb", buffering=0)

    def append(self, name: str, array: np.ndarray, checksum: bool, index=None) -> None:
        array = np.ascontiguousarray(array).reshape(np.shape(array))  # a scalar (a weight_scale) stays 0-d
        data = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
        pad = wire.aligned(self.size) - self.size
        if pad:
            self._f.write(b"\0" * pad)
        offset = self.size + pad
        self._f.write(data)
        crc = zlib.crc32(data) if checksum else None
        self.entries.append(
            wire.TensorEntry(name, wire_dtype(array), tuple(array.shape), offset, data.nbytes, crc, index)
        )
        self.size = offset + data.nbytes

    def close(self) -> Bucket:
        self._f.close()
        return Bucket(self.path, self.index, self.entries, self.size)


def stage_buckets(
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    bucket_bytes: int,
    directory: str | os.PathLike = DEFAULT_STAGING_DIR,
    prefix: str | None = None,
    checksums: bool = False,
    spec: dict | None = None,
    first_index: int = 0,
) -> Iterator[Bucket]:
    """Writes `tensors` into bucket files under `directory` and yields each `Bucket` once it is closed.

    An item is `(hf_name, array)`, or `(hf_name, array, index)` for a block of the full tensor (sharded
    staging: `index` is `((start, stop), ...)` per dimension, e.g. from `owned_shards`).

    With `spec` (`{hf_name: (shape, dtype)}` of the served checkpoint), an unknown name, a wrong shape or
    a duplicate raises ValueError naming it before that tensor is written. On any error the bucket being
    written is removed; buckets already yielded belong to the caller. Buckets are numbered from
    `first_index`.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    prefix = prefix or f"bucket-{uuid.uuid4().hex[:8]}"
    seen: set[str] = set()
    current: _BucketFile | None = None
    index = first_index
    try:
        for item in tensors:
            name, array, block = (*item, None)[:3]
            array = np.asarray(array)
            if spec is not None:
                nbytes = array.size * array.dtype.itemsize
                entry = wire.TensorEntry(name, wire_dtype(array), tuple(array.shape), 0, nbytes, None, block)
                wire.check_entries([entry], spec, seen)
            if (
                current is not None
                and current.entries
                and (wire.aligned(current.size) + array.nbytes > bucket_bytes)
            ):
                yield current.close()
                current, index = None, index + 1
            if current is None:
                current = _BucketFile(str(Path(directory) / f"{prefix}-{index:05d}"), index)
            current.append(name, array, checksums, block)
        if current is not None:
            done, current = current.close(), None
            yield done
    finally:
        if current is not None:
            current.close().unlink()


def owned_shards(array) -> list[tuple[tuple[slice, ...], np.ndarray]]:
    """This process's part of a (possibly sharded, multi-process) jax array: `[(index, data)]`, one entry
    per addressable shard whose `replica_id == 0`, `index` the shard's slices of the full tensor (ints
    resolved: `slice(start, stop)` per dimension), `data` its host copy. Across every process of a job
    each element is covered exactly once, and no shard is moved off its device before the host copy
    (no all-gather). The building block of sharded staging: a bucket entry is (name, index, dtype, crc).
    """
    out = []
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, array.shape, strict=True))
        out.append((index, np.asarray(shard.data)))
    return out
