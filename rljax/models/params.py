"""The Hugging Face mapping table: every HF tensor, the parameter it comes from, and its layout.

A decoder class (see `rljax.models.model`) declares its table as `hf_table(config) -> list[HFTensor]`;
this one table drives checkpoint load, checkpoint save and weight sync, so the directions cannot drift
apart. Shapes and logical axes are not restated here: they come from the module's own parameters
(`abstract_params`), and `bind_table` joins the two into `ParamEntry`s.

Params are the module's pure state: a nested dict whose per-layer weights are stacked with a leading
layer axis `L` (scanned). The built-in decoder's layout (`rljax.models.decoder`):

    embed/embedding          [V, d]          model.embed_tokens.weight
    layers/attn_norm/scale   [L, d]          model.layers.{i}.input_layernorm.weight
    layers/q_proj/kernel     [L, d, H, hd]   model.layers.{i}.self_attn.q_proj.weight  [H*hd, d]
    layers/q_proj/bias       [L, H, hd]      (qwen2, or attention_bias)               [H*hd]
    layers/k_proj, v_proj    [L, d, K, hd]   ...k_proj / v_proj                        [K*hd, d]
    layers/o_proj/kernel     [L, H, hd, d]   ...o_proj.weight                          [d, H*hd]
    layers/q_norm, k_norm    [L, hd]         (qwen3) ...self_attn.q_norm.weight
    layers/mlp_norm/scale    [L, d]          ...post_attention_layernorm.weight
    layers/gate_proj, up_proj[L, d, F]       ...mlp.gate_proj.weight                   [F, d]
    layers/down_proj/kernel  [L, F, d]       ...mlp.down_proj.weight                   [d, F]
    final_norm/scale         [d]             model.norm.weight
    lm_head/kernel           [V, d]          lm_head.weight (untied only; HF layout kept for the kernel)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One row of a decoder's mapping table: the HF tensor `hf_name` is (a part of) the param at `path`.

    hf_name: with `{}` for per-layer tensors (the param then has a leading layer axis `L`, not counted
      in `perm`, `groups` or `part`).
    part: `(axis, start, stop)`: this tensor is `param[..., start:stop, ...]` along `axis` of the
      per-layer param (a fused param maps to several HF tensors: q/k/v, gate/up); None: the whole param.
    perm, groups: HF layout = `part.transpose(perm)` with consecutive dims merged in groups of these
      sizes. Defaults: identity, no merging.
    """

    path: tuple[str, ...]
    hf_name: str
    perm: tuple[int, ...] | None = None
    groups: tuple[int, ...] | None = None
    part: tuple[int, int, int] | None = None

    @property
    def per_layer(self) -> bool:
        return "{}" in self.hf_name


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """An `HFTensor` bound to its param's per-layer `shape` (without `L`)."""

    row: HFTensor
    shape: tuple[int, ...]

    path = property(lambda self: self.row.path)
    hf_name = property(lambda self: self.row.hf_name)
    per_layer = property(lambda self: self.row.per_layer)
    part = property(lambda self: self.row.part)

    @property
    def perm(self) -> tuple[int, ...]:
        return self.row.perm or tuple(range(len(self.shape)))

    @property
    def groups(self) -> tuple[int, ...]:
        return self.row.groups or (1,) * len(self.shape)

    @property
    def part_shape(self) -> tuple[int, ...]:
        """Shape of the slice of the param that this tensor holds."""
        if self.part is None:
            return self.shape
        axis, start, stop = self.part
        return (*self.shape[:axis], stop - start, *self.shape[axis + 1 :])

    @property
    def transposed_shape(self) -> tuple[int, ...]:
        return tuple(self.part_shape[p] for p in self.perm)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        t, out, pos = self.transposed_shape, [], 0
        for g in self.groups:
            out.append(math.prod(t[pos : pos + g]))
            pos += g
        return tuple(out)

    def take_part(self, x: np.ndarray) -> np.ndarray:
        """This tensor's slice of one (per-layer) param array `[*shape]`."""
        if self.part is None:
            return x
        axis, start, stop = self.part
        return x[(slice(None),) * axis + (slice(start, stop),)]

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """One (per-layer) param array `[*shape]` -> its HF tensor `[*hf_shape]`."""
        return self.part_to_hf(self.take_part(x))

    def part_to_hf(self, part: np.ndarray) -> np.ndarray:
        """This tensor's slice `[*part_shape]` of the param -> the HF tensor `[*hf_shape]`."""
        return np.ascontiguousarray(np.transpose(part, self.perm)).reshape(self.hf_shape)

    def from_hf(self, x: np.ndarray) -> np.ndarray:
        """HF tensor `[*hf_shape]` -> the (per-layer) param slice `[*part_shape]`."""
        return np.transpose(np.reshape(x, self.transposed_shape), np.argsort(self.perm))


def bind_table(rows: list[HFTensor], abstract: dict, num_layers: int) -> list[ParamEntry]:
    """Joins a mapping table with the module's abstract params; raises (naming the param) when a param
    is not covered exactly once (whole, or by parts that tile one axis)."""
    entries = []
    for row in rows:
        shape = tuple(get_path(abstract, row.path).shape)
        if row.per_layer:
            if shape[:1] != (num_layers,):
                raise ValueError(f"{'/'.join(row.path)}: per-layer tensor {row.hf_name!r}, no layer axis")
            shape = shape[1:]
        entries.append(ParamEntry(row, shape))
    _check_coverage(entries, abstract)
    return entries


def _check_coverage(entries: list[ParamEntry], abstract: dict) -> None:
    by_path: dict[tuple, list[ParamEntry]] = {}
    for e in entries:
        by_path.setdefault(e.path, []).append(e)
    paths = {p for p, _ in flatten_paths(abstract)}
    if paths - set(by_path):
        raise ValueError(f"params not in the HF table: {sorted('/'.join(p) for p in paths - set(by_path))}")
    for path, group in by_path.items():
        name = "/".join(path)
        if len(group) == 1 and group[0].part is None:
            continue
        if any(e.part is None for e in group) or len({e.part[0] for e in group}) != 1:
            raise ValueError(f"{name}: HF tensors must be the whole param or parts along one axis")
        axis = group[0].part[0]
        spans = sorted(e.part[1:] for e in group)
        if [s[0] for s in spans] != [0] + [s[1] for s in spans[:-1]] or spans[-1][1] != group[0].shape[axis]:
            raise ValueError(f"{name}: parts {spans} do not tile axis {axis} of size {group[0].shape[axis]}")


def flatten_paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """`[(path, leaf)]` of a nested dict, in insertion order."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += flatten_paths(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def nest_paths(pairs: list[tuple[tuple[str, ...], Any]]) -> dict:
    tree: dict = {}
    for path, value in pairs:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def get_path(params: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        params = params[key]
    return params


def hf_blocks(e: ParamEntry, index: tuple[slice, ...], block: np.ndarray) -> list[tuple[tuple, np.ndarray]]:
    """The parts of a block of one (per-layer) param that land in `e`'s HF tensor, as rectangular slices
    of it: `[(hf_index, piece)]`, `hf_index` `((start, stop), ...)` over `e.hf_shape`, `piece` its data.

    `block` is `param[index]` (`index`: `slice(start, stop)` per dim of `e.shape`, e.g. an owned shard of
    a sharded param, layer axis already taken). Only `e.part`'s range of the block is used (fused params
    map to several tensors). A merged HF dim stays one range when the merged dims after the first cut one
    are whole (every sharding rljax uses: heads, not head_dim, are split); otherwise the block is cut into
    one piece per index of the leading dims. The pieces of all entries of all owned blocks tile every HF
    tensor exactly once.
    """
    index = list(index)
    if e.part is not None:
        axis, start, stop = e.part
        lo, hi = max(index[axis].start, start), min(index[axis].stop, stop)
        if lo >= hi:
            return []
        cut = [slice(None)] * block.ndim
        cut[axis] = slice(lo - index[axis].start, hi - index[axis].start)
        block, index[axis] = block[tuple(cut)], slice(lo - start, hi - start)
    t_shape, t_index = e.transposed_shape, [index[p] for p in e.perm]
    t_block = np.transpose(block, e.perm)
    choices, pos = [], 0  # per transposed dim: the list of (start, stop) ranges it is cut into
    for g in e.groups:
        dims = range(pos, pos + g)
        whole = [t_index[k].start == 0 and t_index[k].stop == t_shape[k] for k in dims]
        j = max([k for k in dims if not whole[k - pos]], default=pos)  # last cut dim of the group
        for k in dims:
            s = t_index[k]
            single = k < j and s.stop - s.start > 1
            choices.append([(i, i + 1) for i in range(s.start, s.stop)] if single else [(s.start, s.stop)])
        pos += g
    out = []
    for ranges in itertools.product(*choices):
        local = tuple(slice(a - s.start, b - s.start) for (a, b), s in zip(ranges, t_index, strict=True))
        hf_index, shape, pos = [], [], 0
        for g in e.groups:
            strides = [math.prod(t_shape[k + 1 : pos + g]) for k in range(pos, pos + g)]
            start = sum(ranges[k][0] * strides[k - pos] for k in range(pos, pos + g))
            size = math.prod(ranges[k][1] - ranges[k][0] for k in range(pos, pos + g))
            hf_index.append((start, start + size))
            shape.append(size)
            pos += g
        assert all(b <= n for (_, b), n in zip(hf_index, e.hf_shape, strict=True))
        out.append((tuple(hf_index), np.ascontiguousarray(t_block[local]).reshape(shape)))
    return out
