"""Hugging Face checkpoints: load (optionally straight into shardings), save, weight iteration, tokenizer.

Every direction goes through the one table in `rljax.models.params` (`ParamEntry.to_hf` /
`from_hf`), so checkpoint load, checkpoint save and weight sync cannot disagree on a name or layout.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import SafetensorError, safe_open

from rljax.hf_config import read_hf_config
from rljax.models.config import ModelConfig
from rljax.models.model import param_entries, param_logical_axes
from rljax.models.params import ParamEntry, get_path, hf_blocks, nest_paths
from rljax.sharding import logical_to_sharding

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)
_DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


def _hf_names(config: ModelConfig) -> Iterator[tuple[str, ParamEntry, int | None]]:
    """(hf_name, entry, layer) for every HF tensor, in Hugging Face state-dict order."""
    entries = param_entries(config)
    first = next((i for i, e in enumerate(entries) if e.per_layer), len(entries))
    for e in entries[:first]:
        yield e.hf_name, e, None
    for layer in range(config.num_layers):
        for e in entries:
            if e.per_layer:
                yield e.hf_name.format(layer), e, layer
    for e in entries[first:]:
        if not e.per_layer:
            yield e.hf_name, e, None


def hf_tensor_specs(config: ModelConfig, dtype: Any = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """The expected Hugging Face state: `{hf_name: (shape, dtype name)}` in state-dict order (tied
    embeddings have no `lm_head.weight`); dtype defaults to `config.param_dtype`."""
    name = jnp.dtype(dtype or config.param_dtype).name
    return {hf: (e.hf_shape, name) for hf, e, _ in _hf_names(config)}


def iter_hf_tensors(config: ModelConfig, params: dict, dtype: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """Lazily yields `(hf_name, array)` in HF layout and dtype (default `config.param_dtype`), one tensor
    at a time (one device->host transfer per tensor), every weight exactly once, in state-dict order.

    Params must be fully addressable from this process (single-process or replicated shards).
    """
    np_dtype = jnp.dtype(dtype or config.param_dtype)
    for hf, e, layer in _hf_names(config):
        x = get_path(params, e.path)
        # on the host: a view of the stacked tensor, sliced in numpy (no per-layer device op);
        # on an accelerator: only this layer's slice (this tensor's part of it) crosses to the host
        x = np.asarray(x) if _in_host_memory(x) else x
        part = e.take_part(x if layer is None else x[layer])
        yield hf, e.part_to_hf(np.asarray(part)).astype(np_dtype, copy=False)


def iter_owned_hf_slices(
    config: ModelConfig, params: dict, dtype: Any = None
) -> Iterator[tuple[str, np.ndarray, tuple[tuple[int, int], ...] | None]]:
    """Sharded staging: `(hf_name, array, hf_index)` for the shards of `params` that this process owns,
    in HF layout and `dtype` (default `config.param_dtype`; cast on device first, e.g. with
    `rljax.distributed.cast_params`, so only serving-dtype bytes leave the device).

    A shard is owned by the device holding its replica 0 (`replica_id == 0`), so across every process of
    a job each element of every HF tensor is yielded exactly once. `hf_index` is the piece's
    `((start, stop), ...)` in the full HF tensor, None when the piece is the whole tensor. Each shard is
    copied from its own device to the host on its own (no all-gather, no other device involved); a
    stacked layer shard `[l0:l1, ...]` gives per-layer pieces `model.layers.{l}....`.
    """
    np_dtype = jnp.dtype(dtype or config.param_dtype)
    by_path: dict[tuple, list[ParamEntry]] = {}
    for e in param_entries(config):
        by_path.setdefault(e.path, []).append(e)
    for path, entries in by_path.items():
        for index, data in _owned_blocks(get_path(params, path)):
            layers = [(None, index, data)]
            if entries[0].per_layer:
                l0, l1 = index[0].start, index[0].stop
                layers = [(i, index[1:], data[i - l0]) for i in range(l0, l1)]
            for layer, idx, block in layers:
                for e in entries:
                    name = e.hf_name if layer is None else e.hf_name.format(layer)
                    for hf_index, piece in hf_blocks(e, idx, block):
                        whole = all(a == 0 and b == n for (a, b), n in zip(hf_index, e.hf_shape, strict=True))
                        yield name, piece.astype(np_dtype, copy=False), None if whole else hf_index


def _owned_blocks(x: Any) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
    """`(index, host data)` of each addressable shard of `x` whose `replica_id` is 0 (a numpy array: one
    block, the whole array)."""
    if isinstance(x, np.ndarray):
        yield tuple(slice(0, n) for n in x.shape), x
        return
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            yield (
                tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, x.shape, strict=True)),
                np.asarray(shard.data),
            )


def _in_host_memory(x: Any) -> bool:
    """A numpy array, or a jax array on CPU devices: `np.asarray` of it is a view, not a copy, so the
    stacked layers are sliced on the host (no per-layer device op)."""
    if isinstance(x, np.ndarray):
        return True
    try:
        return all(d.platform == "cpu" for d in x.devices())
    except AttributeError:
        return False


def _shard_name(index: Path, name: str) -> str:
    """A shard file name from `index`'s weight_map, normalised; ValueError if it is absolute or leaves the
    checkpoint directory (`..`), so an index cannot make the loader open files elsewhere."""
    norm = os.path.normpath(str(name))
    if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep) or norm == ".":
        raise ValueError(f"{index}: weight_map names {name!r}, a file outside the checkpoint directory")
    return norm


class CheckpointFormatError(ValueError):
    """A file of a local Hugging Face checkpoint cannot be read (truncated, not JSON, ...); names the file."""


class _TensorSource:
    """Name -> safetensors slice over one or more files (memory-mapped; reads only what is asked).

    Opening reads every file's header only; a truncated or damaged file raises CheckpointFormatError."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({_shard_name(index, f) for f in weight_map.values()})
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointFormatError(
                    f"{index}: not a safetensors index ({type(e).__name__}: {e})"
                ) from e
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        self._handles = {f: _open_safetensors(path / f) for f in files}
        self.file_of = {k: f for f, h in self._handles.items() for k in h.keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:  # safetensors' name: F32, BF16, I64, ...
        return self._handles[self.file_of[name]].get_slice(name).get_dtype()

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self._handles[self.file_of[name]].get_slice(name)[index]


def _open_safetensors(file: Path) -> Any:
    """safe_open's handle (it checks the header and that the file covers every tensor's bytes)."""
    try:
        return safe_open(str(file), framework="np")
    except (SafetensorError, OSError) as e:
        raise CheckpointFormatError(f"{file}: not a readable safetensors file ({e})") from e


def read_model_config(path: str | Path, **kwargs: Any) -> ModelConfig:
    """The `ModelConfig` (shapes only, no weights) of the checkpoint directory `path`; `kwargs` go to
    `ModelConfig.from_hf_dict` (dtypes, `decoder`); its `config.json` read by `rljax.hf_config`."""
    return ModelConfig.from_hf_dict(read_hf_config(path), **kwargs)


def check_hf_checkpoint(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local checkpoint dir after reading config.json and every safetensors header
    (no tensor data) and checking each tensor's name and shape against the config; raises
    CheckpointFormatError (or FileNotFoundError / ValueError) naming the file otherwise."""
    path = Path(path)
    try:
        config = read_model_config(path)
    except (ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as e:
        raise CheckpointFormatError(f"{path / 'config.json'}: {type(e).__name__}: {e}") from e
    _check_tensors(config, _TensorSource(path), path)
    return config


def _check_tensors(config: ModelConfig, source: _TensorSource, path: Path) -> None:
    """Raises naming the first missing, extra or wrong-shaped tensor (and the expected shape)."""
    specs = hf_tensor_specs(config)
    for name, (shape, _) in specs.items():
        if name not in source.file_of:
            raise ValueError(f"{path}: missing tensor {name!r} (expected shape {shape})")
        if source.shape(name) != shape:
            raise ValueError(
                f"{path}: tensor {name!r} has shape {source.shape(name)}, expected {shape} from the config"
            )
        if source.dtype(name) not in ("F32", "F16", "BF16", "F64"):
            raise ValueError(f"{path}: tensor {name!r} is {source.dtype(name)}, not floating-point")
    # A tied checkpoint may still store lm_head.weight (transformers ignores it); anything else is an error.
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(set(source.file_of) - set(specs) - ignorable)
    if extra:
        raise ValueError(
            f"{path}: unexpected tensor {extra[0]!r} (shape {source.shape(extra[0])})"
            f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}; not in a {config.family} model"
        )


def _read_block(source: _TensorSource, e: ParamEntry, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """Param block `index` (over `e.shape`) read from HF tensor `name`, touching only the rows it needs.

    In each merged HF dim only the outer param dim's range is cut when reading; inner dims are cut after.
    """
    t_shape, t_index = e.transposed_shape, [index[p] for p in e.perm]
    hf_index, block_shape, pos = [], [], 0
    for g in e.groups:
        inner = int(np.prod(t_shape[pos + 1 : pos + g], dtype=np.int64))
        s = t_index[pos]
        hf_index.append(slice(s.start * inner, s.stop * inner))
        block_shape += [s.stop - s.start, *t_shape[pos + 1 : pos + g]]
        pos += g
    block = source.read(name, tuple(hf_index)).reshape(block_shape)
    cut = tuple(slice(None) if i in _outer_dims(e.groups) else t_index[i] for i in range(len(t_shape)))
    return np.transpose(block[cut], np.argsort(e.perm))


def _outer_dims(groups: tuple[int, ...]) -> set[int]:
    return {sum(groups[:i]) for i in range(len(groups))}


def _read_param_block(source, entries: list[ParamEntry], layer, index: tuple[slice, ...]) -> np.ndarray:
    """Block `index` of one (per-layer) param from its HF tensor, or from the parts that tile one axis."""
    name = lambda e: e.hf_name if layer is None else e.hf_name.format(layer)  # noqa: E731
    if entries[0].part is None:
        return _read_block(source, entries[0], name(entries[0]), index)
    axis, pieces = entries[0].part[0], []
    want = index[axis]
    for e in sorted(entries, key=lambda e: e.part[1]):
        lo, hi = max(want.start, e.part[1]), min(want.stop, e.part[2])
        if lo < hi:
            local = (*index[:axis], slice(lo - e.part[1], hi - e.part[1]), *index[axis + 1 :])
            pieces.append(_read_block(source, e, name(e), local))
    return np.concatenate(pieces, axis=axis)


def _build_param(source, entries: list[ParamEntry], shape, sharding, dtype) -> jax.Array:
    cache: dict[tuple, np.ndarray] = {}  # replicated shards ask for the same block: read it once

    def block(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
        key = tuple((s.start, s.stop) for s in index)
        if key not in cache:
            if entries[0].per_layer:
                rows = [_read_param_block(source, entries, i, index[1:]) for i in range(*key[0])]
                cache[key] = np.stack(rows).astype(dtype, copy=False)
            else:
                cache[key] = _read_param_block(source, entries, None, index).astype(dtype, copy=False)
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, block)


def load_hf_checkpoint(
    path: str | Path, *, dtype: Any = None, mesh: Mesh | None = None, decoder: str = ""
) -> tuple[ModelConfig, dict]:
    """Loads a local Hugging Face checkpoint dir (config.json + model.safetensors, or sharded with
    model.safetensors.index.json) -> (ModelConfig, params of jax.Arrays).

    dtype: param dtype (default: the checkpoint's `dtype`/`torch_dtype`, else float32); also the
    compute dtype (change it with `dataclasses.replace`). With `mesh`, every param is assembled
    shard by shard into its `NamedSharding` (from `param_logical_axes`): each device's block is read
    from the memory-mapped file, never a full copy per device. Without, params land on this process's
    first local device (in a multi-process job `jax.devices()[0]` may belong to another process).
    decoder: the decoder class (`ModelConfig.decoder`: a family or `package.module:Class`) whose
    params layout and HF table the tensors are loaded into; default the built-in one of the family.
    """
    path = Path(path)
    name = None if dtype is None else jnp.dtype(dtype).name
    config = read_model_config(path, param_dtype=name, compute_dtype=name, decoder=decoder)
    source = _TensorSource(path)
    _check_tensors(config, source, path)
    if mesh is not None:
        shardings = logical_to_sharding(param_logical_axes(config), mesh)
    np_dtype = jnp.dtype(config.param_dtype)
    by_path: dict[tuple, list[ParamEntry]] = {}
    for e in param_entries(config):
        by_path.setdefault(e.path, []).append(e)
    pairs = []
    for path, entries in by_path.items():
        s = get_path(shardings, path) if mesh is not None else SingleDeviceSharding(jax.local_devices()[0])
        shape = (config.num_layers, *entries[0].shape) if entries[0].per_layer else entries[0].shape
        pairs.append((path, _build_param(source, entries, shape, s, np_dtype)))
    return config, nest_paths(pairs)


def _write_safetensors(path: Path, names: list[str], specs: dict, tensors: Iterator) -> None:
    """Streams tensors into one safetensors file whose header is written first from `specs`.

    Format: u64 little-endian header length, JSON header (name -> dtype, shape, byte offsets), data.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for n in names:
        shape, dt = specs[n]
        nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dt).itemsize
        header[n] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for n in names:
            name, x = next(tensors)
            assert name == n and x.shape == tuple(specs[n][0]), (name, n, x.shape)
            f.write(np.ascontiguousarray(x).tobytes())


def _plan_shards(specs: dict, max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for n, (shape, dt) in specs.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dt).itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    return shards


def save_hf_checkpoint(
    config: ModelConfig,
    params: dict,
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
) -> Path:
    """Writes a Hugging Face checkpoint dir that transformers and vLLM load unchanged: config.json,
    model.safetensors (or model-0000i-of-0000n.safetensors + index when larger than `max_shard_bytes`),
    and tokenizer/chat-template/generation files copied from `tokenizer_dir`. Tensors stream to disk one
    at a time (host memory: one tensor). Returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2, sort_keys=True))
    specs = hf_tensor_specs(config)
    shards = _plan_shards(specs, max_shard_bytes)
    tensors = iter_hf_tensors(config, params)
    if len(shards) == 1:
        _write_safetensors(path / "model.safetensors", shards[0], specs, tensors)
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(path / fname, names, specs, tensors)
            weight_map.update(dict.fromkeys(names, fname))
        total = sum(int(np.prod(s, dtype=np.int64)) * jnp.dtype(d).itemsize for s, d in specs.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, path)
    return path


def copy_tokenizer(source: str | Path, path: str | Path) -> None:
    """Copies the tokenizer, chat-template and generation files `source` has into `path`."""
    for fname in (f for f in _TOKENIZER_FILES if (Path(source) / f).exists()):
        shutil.copyfile(Path(source) / fname, Path(path) / fname)


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer (with its chat template) through `transformers.AutoTokenizer`."""
    from transformers import AutoTokenizer  # lazy: only tokenizer loading needs transformers

    return AutoTokenizer.from_pretrained(str(path))
