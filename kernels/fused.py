"""The custom VJP around every fused impl, and its partitioning over a device mesh (`shard_map`).

A fused impl supplies `forward_stats` and `backward_grads` (see `common`); `make_fused` turns them into
`fn(hidden, unembed, targets, *, scale, with_entropy, block_size, mesh)`. Without a mesh the kernels see the
whole arrays. With one, forward and backward each run under `jax.shard_map` (so a `pallas_call` or a Triton
custom call sees only manual mesh axes and its own shard):

- rows: `hidden [N,d]` and every per-row vector are split over `ROW_AXES` (the trainer's batch axes); each
  device computes the head for its own rows only (nothing of `hidden` is gathered).
- vocab: with `VOCAB_AXIS` > 1 the unembedding `[V,d]` stays split over the vocab and the log-sum-exp is
  vocab-parallel: each device reduces its `V / tensor` columns to (lse_k, H_k, target logit), then one
  `pmax`/`psum` per row vector over the vocab axis combines them. Backward: the logit cotangent of a column
  needs only the global per-row lse / c0 / c1, so each device forms its own columns' `dz`; `d hidden` is
  `psum`-ed over the vocab axis.
- embed: the unembedding's `d` split over `EMBED_AXIS` (FSDP) is all-gathered inside (`[V / tensor, d]` per
  device, never the full `[V, d]` when tensor > 1) and its gradient reduce-scattered back (`psum_scatter`).

Combining shards (w_k = e^(lse_k - lse), sum_k w_k = 1, E_k[z] = lse_k - H_k the mean logit of shard k under
its own softmax): lse = log sum_k e^(lse_k);  H = lse - sum_k w_k E_k[z] = sum_k w_k (H_k + lse - lse_k).

References: Shoeybi et al., "Megatron-LM" (2019), vocab-parallel cross-entropy; Wijmans et al., "Cut Your
  Losses in Large-Vocabulary Language Models" (2024).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .common import target_logits

# The mesh axes of `rljax.sharding` (kernels may not import it; tests/test_kernels_sharded.py checks that
# these agree with its LOGICAL_RULES): batch -> (data, fsdp), vocab -> tensor, embed -> fsdp.
ROW_AXES = ("data", "fsdp")
VOCAB_AXIS = "tensor"
EMBED_AXIS = "fsdp"


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How the head is partitioned: mesh axes splitting the rows, the vocab, and unembed's d (None: whole)."""

    mesh: Mesh | None = None
    rows: tuple[str, ...] = ()
    vocab: str | None = None
    embed: str | None = None

    @property
    def row_spec(self) -> PartitionSpec:
        return PartitionSpec(self.rows or None)

    @property
    def unembed_spec(self) -> PartitionSpec:
        return PartitionSpec(self.vocab, self.embed)

    @property
    def row_devices(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.rows) if self.mesh is not None else 1

    def map(self, fn: Callable, in_specs: tuple, out_specs: tuple) -> Callable:
        """`fn` under `shard_map` on the mesh (or `fn` itself without a mesh)."""
        if self.mesh is None:
            return fn
        # check_vma=False: pallas_call and jax_triton's custom call carry no varying-axes types.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def head_layout(mesh: Mesh | None, vocab: int, dim: int) -> HeadLayout:
    """The layout for unembed `[vocab, dim]` on `mesh` (None: unpartitioned; a one-device mesh still runs
    under `shard_map`, with no collectives).

    Rows go over the `ROW_AXES` present in the mesh with size > 1, the vocab over `VOCAB_AXIS` when it
    divides `vocab` (otherwise that axis splits the rows too: the unembedding is replicated over it), the
    `d` of the unembedding over `EMBED_AXIS` when that splits the rows and divides `dim`.
    """
    if mesh is None:
        return HeadLayout()
    size = lambda axis: dict(mesh.shape).get(axis, 1)
    rows = [a for a in ROW_AXES if size(a) > 1]
    vocab_axis = VOCAB_AXIS if size(VOCAB_AXIS) > 1 else None
    if vocab_axis is not None and vocab % size(vocab_axis):
        rows.append(vocab_axis)
        vocab_axis = None
    embed = EMBED_AXIS if EMBED_AXIS in rows and dim % size(EMBED_AXIS) == 0 else None
    return HeadLayout(mesh, tuple(rows), vocab_axis, embed)


def _gather_unembed(w: jax.Array, layout: HeadLayout) -> jax.Array:
    """This device's vocab rows with the whole d: [V / tensor, d / fsdp] -> [V / tensor, d] (FSDP gather)."""
    return w if layout.embed is None else jax.lax.all_gather(w, layout.embed, axis=1, tiled=True)


def _vocab_offset(w: jax.Array, layout: HeadLayout) -> jax.Array | int:
    """Global id of this device's first vocab row."""
    return 0 if layout.vocab is None else jax.lax.axis_index(layout.vocab) * w.shape[0]


def _combine_vocab_shards(lse, entropy, layout: HeadLayout):
    """Per-shard (lse_k, H_k) f32[n] -> global (lse, H) over the vocab axis (module docstring)."""
    if layout.vocab is None:
        return lse, entropy
    top = jax.lax.pmax(lse, layout.vocab)
    weight = jnp.exp(lse - top)
    total = jax.lax.psum(weight, layout.vocab)
    lse_all = top + jnp.log(total)
    if entropy is None:
        return lse_all, None
    mixed = jax.lax.psum(weight * (entropy + lse_all - lse), layout.vocab) / total
    return lse_all, jnp.maximum(mixed, 0.0)


def shard_forward(forward_stats, hidden, w, targets, *, scale, with_entropy, block_size, vocab, layout):
    """One device's rows: (logp, lse, keep[, entropy]) f32[n] (keep bool[n]: logp has a gradient)."""
    w = _gather_unembed(w, layout)
    lse, entropy = forward_stats(hidden, w, scale, with_entropy, block_size)
    local_t = targets - _vocab_offset(w, layout)
    in_shard = (local_t >= 0) & (local_t < w.shape[0])
    z_target = jnp.where(in_shard, target_logits(hidden, w, local_t, scale), 0.0)
    if layout.vocab is not None:
        z_target = jax.lax.psum(z_target, layout.vocab)
    lse, entropy = _combine_vocab_shards(lse, entropy, layout)
    raw = z_target - lse
    in_range = (targets >= 0) & (targets < vocab)
    logp = jnp.where(in_range, jnp.minimum(raw, 0.0), 0.0)
    keep = in_range & (raw <= 0.0)  # where the clamp is active, logp is constant
    return (logp, lse, keep) + ((entropy,) if with_entropy else ())


def shard_backward(backward_grads, hidden, w_part, targets, lse, g_logp, c0, *c1, scale, block_size, layout):
    """One device's (d hidden f32[n,d], d unembed f32[V / tensor, d / fsdp]) from its rows and vocab shard."""
    w = _gather_unembed(w_part, layout)
    local_t = targets - _vocab_offset(w, layout)  # other shards' targets match no local column
    dh, dw = backward_grads(hidden, w, local_t, lse, g_logp, c0, c1[0] if c1 else None, scale, block_size)
    dh = dh.astype(jnp.float32)
    dw = dw.astype(jnp.float32)  # summed over devices in f32, like the kernels' own accumulation
    if layout.vocab is not None:
        dh = jax.lax.psum(dh, layout.vocab)
    others = tuple(a for a in layout.rows if a != layout.embed)
    if others:
        dw = jax.lax.psum(dw, others)
    if layout.embed is not None:
        dw = jax.lax.psum_scatter(dw, layout.embed, scatter_dimension=1, tiled=True)
    return dh, dw


def _pad_rows(x: jax.Array, n_pad: int, value) -> jax.Array:
    return x if n_pad == 0 else jnp.pad(x, [(0, n_pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def make_fused(forward_stats: Callable[..., Any], backward_grads: Callable[..., Any]) -> Callable[..., Any]:
    """Builds fn(hidden, unembed, targets, *, scale, with_entropy, block_size, mesh=None) -> (logp, entropy).

    entropy is None unless `with_entropy`. The result has a custom VJP that saves only the inputs and f32[N]
    vectors, never [N, V]. Targets outside [0, V) (e.g. an ignore index) give logp = 0 and no log-prob
    gradient. With `mesh`, see the module docstring; N not divided by the row devices is padded with ignored
    rows (cut off again afterwards).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
    def fused(hidden, unembed, targets, scale, with_entropy, block_size, layout):
        return fused_fwd(hidden, unembed, targets, scale, with_entropy, block_size, layout)[0]

    def fused_fwd(hidden, unembed, targets, scale, with_entropy, block_size, layout):
        local = functools.partial(
            shard_forward, forward_stats, scale=scale, with_entropy=with_entropy, block_size=block_size,
            vocab=unembed.shape[0], layout=layout,
        )  # fmt: skip
        rows, w = layout.row_spec, layout.unembed_spec
        logp, lse, keep, *ent = layout.map(local, (rows, w, rows), (rows,) * (3 + with_entropy))(
            hidden, unembed, targets
        )
        entropy = ent[0] if with_entropy else None
        out = (logp, entropy) if with_entropy else logp
        return out, (hidden, unembed, targets, lse, entropy, keep)

    def fused_bwd(scale, with_entropy, block_size, layout, res, g):
        hidden, unembed, targets, lse, entropy, keep = res
        g_logp, g_ent = g if with_entropy else (g, None)
        g_logp = jnp.where(keep, g_logp.astype(jnp.float32), 0.0)
        per_row = (targets, lse, g_logp, g_logp)
        if with_entropy:
            c1 = g_ent.astype(jnp.float32)
            per_row = (targets, lse, g_logp, g_logp + c1 * entropy, c1)
        local = functools.partial(
            shard_backward, backward_grads, scale=scale, block_size=block_size, layout=layout
        )
        rows, w = layout.row_spec, layout.unembed_spec
        dh, dw = layout.map(local, (rows, w) + (rows,) * len(per_row), (rows, w))(hidden, unembed, *per_row)
        return dh.astype(hidden.dtype), dw.astype(unembed.dtype), None

    fused.defvjp(fused_fwd, fused_bwd)
    # Jitted so eager calls compile once per shape instead of dispatching the chunk loop op by op.
    fused_jit = jax.jit(fused, static_argnums=(3, 4, 5, 6))

    def call(hidden, unembed, targets, *, scale, with_entropy, block_size, mesh=None):
        layout = head_layout(mesh, unembed.shape[0], unembed.shape[1])
        n_rows = hidden.shape[0]
        n_pad = -n_rows % layout.row_devices
        out = fused_jit(
            _pad_rows(hidden, n_pad, 0), unembed, _pad_rows(targets, n_pad, -1),
            scale, with_entropy, block_size, layout,
        )  # fmt: skip
        logp, entropy = out if with_entropy else (out, None)
        cut = lambda x: x if x is None or n_pad == 0 else x[:n_rows]
        return cut(logp), cut(entropy)

    return call
