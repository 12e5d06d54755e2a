"""The wire format of rljax's host-staged weight transfer, shared by the trainer and vLLM's workers.

A bucket is one file (in `/dev/shm` when trainer and server share a host) holding raw C-order tensor
bytes back to back, each at a 64-byte-aligned offset. Its `update_info` (JSON, never pickle) is::

    {"path": str, "bucket": int, "copy": bool,
     "tensors": [[name, dtype, shape, offset, nbytes, crc32 | None], ...]}

`dtype` is a name from `DTYPES`; `crc32` (zlib) is set when checksums are on; `copy` asks the worker
to copy tensors out of the mapping so the trainer may reuse the file once the call returns.
The expected names and shapes come from the checkpoint the server loaded (`read_checkpoint_spec`).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np

ALIGN = 64
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")  # fp8: `rljax.weight_sync.fp8`
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
_ST_TO_NAME = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn"}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor sits in a bucket file (`offset`, `nbytes` in bytes)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int | None = None
    # sharded staging: this entry is the block `((start, stop), ...)` of the full tensor `name`
    # (`shape` is the block's); None: the whole tensor
    index: tuple[tuple[int, int], ...] | None = None

    def to_wire(self) -> list:
        item = [self.name, self.dtype, list(self.shape), self.offset, self.nbytes, self.crc32]
        return item if self.index is None else item + [[list(r) for r in self.index]]

    @staticmethod
    def from_wire(item: list) -> TensorEntry:
        name, dtype, shape, offset, nbytes, crc, *rest = item
        if len(rest) > 1:
            raise ValueError(f"weight sync: tensor entry {str(name)!r} has {len(item)} fields, expected 6-7")
        index = None if not rest or rest[0] is None else tuple((int(a), int(b)) for a, b in rest[0])
        return TensorEntry(
            str(name),
            str(dtype),
            tuple(int(s) for s in shape),
            int(offset),
            int(nbytes),
            None if crc is None else int(crc),
            index,
        )


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def itemsize(dtype: str) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"unsupported wire dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return _ITEMSIZE[dtype]


def update_info(path: str, bucket: int, entries: list[TensorEntry], *, copy: bool) -> dict:
    """The JSON `update_info` of one bucket file."""
    return {
        "path": str(path),
        "bucket": int(bucket),
        "copy": bool(copy),
        "tensors": [e.to_wire() for e in entries],
    }


def read_safetensors_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{name: (shape, dtype name)}` from one .safetensors file's JSON header (reads no tensor data)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {k: (tuple(v["shape"]), _ST_TO_NAME.get(v["dtype"], v["dtype"])) for k, v in header.items()}


def read_checkpoint_spec(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{hf_name: (shape, dtype name)}` of every tensor in a local Hugging Face checkpoint directory."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    spec: dict = {}
    for f in files:
        spec |= read_safetensors_header(f)
    return spec


def check_entries(
    entries: list[TensorEntry], spec: dict, seen: set[str], file_size: int | None = None
) -> None:
    """Raises ValueError naming the first tensor that is unknown to `spec`, has the wrong shape, a bad
    dtype or byte range, or was already pushed in this update (`seen`, updated in place on success)."""
    names = set()
    for e in entries:
        if e.name not in spec:
            raise ValueError(f"weight sync: unknown tensor {e.name!r} (not in the served checkpoint)")
        shape, _ = spec[e.name]
        if e.index is not None:
            shape = slice_shape(e.index, tuple(shape))
        if tuple(e.shape) != tuple(shape):
            raise ValueError(
                f"weight sync: tensor {e.name!r} has shape {tuple(e.shape)}, expected {tuple(shape)}"
            )
        size = itemsize(e.dtype)
        count = 1
        for s in e.shape:
            count *= s
        if (
            e.nbytes != count * size
            or e.offset < 0
            or (file_size is not None and e.offset + e.nbytes > file_size)
        ):
            raise ValueError(f"weight sync: tensor {e.name!r} has a bad byte range ({e.offset}, {e.nbytes})")
        key = e.name if e.index is None else (e.name, e.index)  # overlapping slices: the assembler's check
        if key in seen or key in names:
            raise ValueError(f"weight sync: tensor {e.name!r} pushed twice in one update")
        names.add(key)
    seen |= names


def bucket_extent(entries: list[TensorEntry]) -> int:
    """The byte size of a bucket holding `entries` laid out as `staging` writes them (each tensor at the
    aligned end of the previous one, nothing after the last); ValueError naming the first tensor that is
    elsewhere, has a bad dtype or a byte count that does not match its shape. Checked before a receiver
    allocates anything, so a sender cannot make it allocate more than the tensors need."""
    end = 0
    for e in entries:
        count = 1
        for s in e.shape:
            if s < 0:
                raise ValueError(f"weight sync: tensor {e.name!r} has a negative dimension in {e.shape}")
            count *= s
        if e.nbytes != count * itemsize(e.dtype) or e.offset != aligned(end):
            raise ValueError(f"weight sync: tensor {e.name!r} has a bad byte range ({e.offset}, {e.nbytes})")
        end = e.offset + e.nbytes
    return end


def missing_names(spec: dict, seen: set[str], optional: frozenset[str] = frozenset()) -> list[str]:
    """Names in `spec` (minus `optional`) that an update did not push, sorted."""
    return sorted(set(spec) - seen - optional)


def slice_shape(index: tuple[tuple[int, int], ...], full_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the block `index` (`((start, stop), ...)` per dimension) of a tensor of `full_shape`;
    ValueError if the block is not inside it."""
    if len(index) != len(full_shape) or any(
        not 0 <= a <= b <= n for (a, b), n in zip(index, full_shape, strict=False)
    ):
        raise ValueError(f"weight sync: slice {index} is not inside a tensor of shape {tuple(full_shape)}")
    return tuple(b - a for a, b in index)


class SliceAssembler:
    """Builds full tensors from slices staged by several trainer processes (sharded staging), on the
    receiving side, before `load_weights`: `add(name, index, block)` copies a block into the tensor's
    buffer (allocated at the first slice, shape and dtype from `spec`/the block) and returns the full
    numpy array once every element was written exactly once, else None. A slice outside the tensor or
    overlapping one already received raises ValueError naming the tensor."""

    def __init__(self, spec: dict):
        self._spec = spec
        self._parts: dict[str, tuple] = {}  # name -> (buffer, written mask, elements left)

    def add(self, name: str, index: tuple[tuple[int, int], ...], block):
        if name not in self._spec:
            raise ValueError(f"weight sync: unknown tensor {name!r} (not in the served checkpoint)")
        full_shape = tuple(self._spec[name][0])
        if tuple(block.shape) != slice_shape(index, full_shape):
            raise ValueError(f"weight sync: slice {index} of {name!r} has shape {tuple(block.shape)}")
        if name not in self._parts:
            count = 1
            for n in full_shape:
                count *= n
            self._parts[name] = (np.empty(full_shape, block.dtype), np.zeros(full_shape, bool), count)
        buf, seen, left = self._parts[name]
        where = tuple(slice(a, b) for a, b in index)
        if seen[where].any():
            raise ValueError(f"weight sync: slice {index} of {name!r} overlaps one already received")
        buf[where], seen[where] = block, True
        left -= block.size
        if left:
            self._parts[name] = (buf, seen, left)
            return None
        del self._parts[name]
        return buf

    def incomplete(self) -> list[str]:
        """Names with some but not all of their elements received, sorted."""
        return sorted(self._parts)
