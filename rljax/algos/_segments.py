"""Per-sequence reductions that work on packed rows: each token gets its sequence's total.

A sequence is a row (unpacked batches, `segment_ids=None`) or a maximal run of one segment id within a
row (packed batches, `rljax.trainer.packing`). Totals use a segmented associative scan along the row, so
they are exact to float rounding of a tree sum (no differences of long cumulative sums) and partition over
rows like any element-wise op (no scatter across the batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _segment_starts(segment_ids: jax.Array) -> jax.Array:
    """bool[B,T]: the first token of each run of one segment id."""
    first = jnp.ones_like(segment_ids[:, :1], bool)
    return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _segment_ends(segment_ids: jax.Array) -> jax.Array:
    """i32[B,T]: the index of the last token of each token's run."""
    t = segment_ids.shape[1]
    last = jnp.ones_like(segment_ids[:, :1], bool)
    is_end = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], last], axis=1)
    idx = jnp.where(is_end, jnp.arange(t, dtype=jnp.int32)[None, :], t)
    return jax.lax.cummin(idx, axis=1, reverse=True)


def running_totals(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`f32[B,T]`: the inclusive running sum of `x` within each token's run of one segment id."""

    def combine(a, b):
        (a_val, a_start), (b_val, b_start) = a, b
        return jnp.where(b_start, b_val, a_val + b_val), a_start | b_start

    running, _ = jax.lax.associative_scan(combine, (x, _segment_starts(segment_ids)), axis=1)
    return running


def sequence_totals(x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """`f32[B,T]`: for every token, the sum of `x f32[B,T]` over its sequence (its row when
    `segment_ids` is None, else its run of one segment id in `segment_ids i32[B,T]`)."""
    if segment_ids is None:
        return jnp.broadcast_to(x.sum(axis=1, keepdims=True), x.shape)
    return jnp.take_along_axis(running_totals(x, segment_ids), _segment_ends(segment_ids), axis=1)


def num_sequences(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """f32[]: sequences with at least one loss token (`mask f32[B,T]` of 0/1); the row count when
    unpacked. Exact: it counts each sequence's first loss token (an integer running count)."""
    if segment_ids is None:
        return jnp.asarray(mask.shape[0], jnp.float32)
    on = mask > 0
    first = on & (running_totals(on.astype(jnp.float32), segment_ids) == 1.0)
    return first.sum().astype(jnp.float32)
