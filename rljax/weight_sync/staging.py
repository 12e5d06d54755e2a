"""Host staging: a stream of `(hf_name, array)` -> bucket files of at most `bucket_bytes` each.

Tensors are written to the current bucket file as they arrive (one tensor in process memory at a
time, straight from `rljax.models.iter_hf_tensors`'s device->host copy), so the trainer's extra host
memory is one tensor plus the bucket files that exist at once: all of them when staging runs before
the pause (`WeightSyncer` with `prestage=True`: the files are the copy of the model on its way to the
engine, and are unlinked when the sync ends), or at most two when staging is pipelined with loading.
A tensor larger than `bucket_bytes` gets a bucket of its own.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from rljax.weight_sync import wire

DEFAULT_STAGING_DIR = "/dev/shm"
PREFIX = "rljax-ws-"  # bucket files are named rljax-ws-<pid>-<sync token>-<index>


def sweep_stale_buckets(directory: str | os.PathLike = DEFAULT_STAGING_DIR) -> list[str]:
    """Removes bucket files left by trainer processes that no longer exist (a SIGKILL skips every cleanup,
    and /dev/shm is RAM); returns the removed paths. Files of live processes are never touched."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if not (name.startswith(PREFIX) and pid.isdigit()) or _alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another sweeper got it first, or not ours to remove
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@dataclasses.dataclass
class Bucket:
    """One staged file: its path, index in the sync, tensor entries and size in bytes."""

    path: str
    index: int
    entries: list[wire.TensorEntry]
    nbytes: int

    def update_info(self, *, copy: bool) -> dict:
        return wire.update_info(self.path, self.index, self.entries, copy=copy)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def wire_dtype(array: np.ndarray) -> str:
    """The wire name of `array`'s dtype (float32, bfloat16 from ml_dtypes, float16)."""
    name = str(array.dtype)
    if name not in wire.DTYPES:
        raise ValueError(f"unsupported dtype {name} for weight sync; valid: {', '.join(wire.DTYPES)}")
    return name


class _BucketFile:
    def __init__(self, path: str, index: int):
        self.path, self.index, self.entries, self.size = path, index, [], 0
        self._f = open(path, "wb", buffering=0)

    def append(self, name: str, array: np.ndarray, checksum: bool) -> None:
        array = np.ascontiguousarray(array)
        data = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
        pad = wire.aligned(self.size) - self.size
        if pad:
            self._f.write(b"\0" * pad)
        offset = self.size + pad
        self._f.write(data)
        crc = zlib.crc32(data) if checksum else None
        self.entries.append(
            wire.TensorEntry(name, wire_dtype(array), tuple(array.shape), offset, data.nbytes, crc)
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
) -> Iterator[Bucket]:
    """Writes `tensors` into bucket files under `directory` and yields each `Bucket` once it is closed.

    With `spec` (`{hf_name: (shape, dtype)}` of the served checkpoint), an unknown name, a wrong shape or
    a duplicate raises ValueError naming it before that tensor is written. On any error the bucket being
    written is removed; buckets already yielded belong to the caller.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    prefix = prefix or f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    seen: set[str] = set()
    current: _BucketFile | None = None
    index = 0
    try:
        for name, array in tensors:
            array = np.asarray(array)
            if spec is not None:
                nbytes = array.size * array.dtype.itemsize
                entry = wire.TensorEntry(name, wire_dtype(array), tuple(array.shape), 0, nbytes)
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
            current.append(name, array, checksums)
        if current is not None:
            done, current = current.close(), None
            yield done
    finally:
        if current is not None:
            current.close().unlink()
