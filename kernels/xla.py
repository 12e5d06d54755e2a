"""Vocab-chunked log-probs in plain XLA: a fori_loop over unembed chunks with an online log-sum-exp.

No [N, V] array is ever built, forward or backward. The ragged last chunk is handled without padding
(which would copy the whole unembed): its start is pulled back to V - C so the slice stays in bounds, and
the columns it shares with the previous chunk are masked out. The backward recomputes each chunk's logits
from the saved per-row lse (and entropy), then writes that chunk's rows of d(unembed) in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .common import (
    IMPLS,
    chunk_stats,
    finalize_stats,
    logit_cotangent,
    matmul_nn,
    matmul_nt,
    matmul_tn,
    merge_stats,
)
from .fused import make_fused

# Target chunk width. On CPU, 4096 columns keep the [N, C] @ [C, d] matmuls near peak while the per-chunk
# temporaries stay ~N * C * 4 bytes (32 MiB at N=2048); measured with bench_logprobs.py.
DEFAULT_CHUNK = 4096


def chunk_width(vocab: int, block_size: int | None) -> int:
    """Chunk width C <= V: `block_size` if given, else DEFAULT_CHUNK spread evenly over
    ceil(V / DEFAULT_CHUNK) chunks and rounded up to 8, so the last chunk's overlap (wasted work) is small."""
    if block_size is not None:
        return min(block_size, vocab)
    n_chunks = -(-vocab // DEFAULT_CHUNK)
    width = -(-vocab // n_chunks)
    return min(vocab, -(-width // 8) * 8)


def _chunk(unembed: jax.Array, i: jax.Array, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chunk i: (rows [C,d], its first column index, valid bool[C] marking columns not seen before)."""
    vocab = unembed.shape[0]
    start = jnp.minimum(i * width, vocab - width)
    rows = jax.lax.dynamic_slice_in_dim(unembed, start, width, axis=0)
    valid = start + jnp.arange(width) >= i * width
    return rows, start, valid


def xla_forward_stats(
    hidden: jax.Array, unembed: jax.Array, scale: float, with_entropy: bool, block_size: int | None
) -> tuple[jax.Array, jax.Array | None]:
    """(lse f32[N], entropy f32[N] | None) for hidden [N,d], unembed [V,d], streaming C columns at a time."""
    width = chunk_width(unembed.shape[0], block_size)
    n_chunks = -(-unembed.shape[0] // width)

    def stats_of(i):
        rows, _, valid = _chunk(unembed, i, width)
        return chunk_stats(matmul_nt(hidden, rows) * scale, valid[None, :], with_entropy)

    stats = jax.lax.fori_loop(1, n_chunks, lambda i, acc: merge_stats(acc, stats_of(i)), stats_of(0))
    lse, entropy = finalize_stats(stats)
    return lse, entropy if with_entropy else None


def xla_backward_grads(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    lse: jax.Array,
    g_logp: jax.Array,
    c0: jax.Array,
    c1: jax.Array | None,
    scale: float,
    block_size: int | None,
) -> tuple[jax.Array, jax.Array]:
    """(d hidden f32[N,d], d unembed [V,d] in unembed's dtype), one vocab chunk per loop step."""
    width = chunk_width(unembed.shape[0], block_size)
    n_chunks = -(-unembed.shape[0] // width)
    cols = jnp.arange(width)

    def body(i, carry):
        dh, dw = carry
        rows, start, valid = _chunk(unembed, i, width)
        z = matmul_nt(hidden, rows) * scale
        onehot = (targets - start)[:, None] == cols[None, :]
        dz = logit_cotangent(z, lse, g_logp, c0, c1, onehot, valid[None, :], scale)
        dh = dh + matmul_nn(dz.astype(unembed.dtype), rows)
        dw_rows = matmul_tn(dz.astype(hidden.dtype), hidden).astype(dw.dtype)
        # Rows this chunk shares with the previous one already hold their gradient: keep them.
        old = jax.lax.dynamic_slice_in_dim(dw, start, width, axis=0)
        dw_rows = jnp.where(valid[:, None], dw_rows, old)
        return dh, jax.lax.dynamic_update_slice_in_dim(dw, dw_rows, start, axis=0)

    init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(unembed.shape, unembed.dtype))
    return jax.lax.fori_loop(0, n_chunks, body, init)


IMPLS.add("xla", make_fused(xla_forward_stats, xla_backward_grads))
