"""Pallas kernels (pl.pallas_call) for the fused log-probs; interpret mode on CPU, compiled on TPU/GPU.

Forward: grid (row blocks, vocab blocks), the vocab axis innermost and sequential; the (m, s, u)
online-softmax statistics of a row block stay in its output block across the vocab axis. Backward: two
kernels that each recompute the logit block, one reducing over vocab into d(hidden) (grid rows x vocab),
one reducing over rows into d(unembed) (grid vocab x rows), so neither needs atomics. Ragged edges are
masked inside the kernels (rows past N and unembed rows past V are zeroed before the matmuls), so no input
is padded or copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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

# Accelerator defaults (a [256, d] x [d, 512] block matmul); on CPU interpret mode each grid program costs
# milliseconds of Python, so blocks are made large there.
ROW_BLOCK, VOCAB_BLOCK = 256, 512
CPU_ROW_BLOCK, CPU_VOCAB_BLOCK = 1024, 8192


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _blocks(n_rows: int, vocab: int, block_size: int | None) -> tuple[int, int]:
    """(row block, vocab block): powers of two >= 8 (the Pallas GPU lowering needs powers of two), no
    larger than needed."""
    row_cap, vocab_cap = (CPU_ROW_BLOCK, CPU_VOCAB_BLOCK) if _interpret() else (ROW_BLOCK, VOCAB_BLOCK)
    pow2 = lambda x: max(8, 1 << (x - 1).bit_length())
    return min(row_cap, pow2(n_rows)), min(pow2(block_size or vocab_cap), pow2(vocab))


def _zero_past(x: jax.Array, first: jax.Array, limit: int) -> jax.Array:
    """Zeroes the rows of block x [B, d] whose global index first + r is >= limit (edge-block padding)."""
    idx = first + jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.where(idx < limit, x, jnp.zeros_like(x))


def _fwd_kernel(h_ref, w_ref, m_ref, s_ref, u_ref, *, scale, n_rows, vocab, with_entropy):
    i, j = pl.program_id(0), pl.program_id(1)
    bn, bv = h_ref.shape[0], w_ref.shape[0]
    h = _zero_past(h_ref[...], i * bn, n_rows)
    w = _zero_past(w_ref[...], j * bv, vocab)
    cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    new = chunk_stats(matmul_nt(h, w) * scale, cols < vocab, with_entropy)

    @pl.when(j == 0)
    def _first():
        for ref, x in zip((m_ref, s_ref, u_ref), new, strict=True):
            ref[...] = x[:, None]

    @pl.when(j > 0)
    def _rest():
        old = (m_ref[...][:, 0], s_ref[...][:, 0], u_ref[...][:, 0])
        for ref, x in zip((m_ref, s_ref, u_ref), merge_stats(old, new), strict=True):
            ref[...] = x[:, None]


def pallas_forward_stats(hidden, unembed, scale, with_entropy, block_size):
    """(lse f32[N], entropy f32[N] | None) for hidden [N,d], unembed [V,d]."""
    (n_rows, dim), vocab = hidden.shape, unembed.shape[0]
    bn, bv = _blocks(n_rows, vocab, block_size)
    kernel = functools.partial(
        _fwd_kernel, scale=scale, n_rows=n_rows, vocab=vocab, with_entropy=with_entropy
    )
    stat_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
    stats = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n_rows, 1), jnp.float32)] * 3,
        grid=(pl.cdiv(n_rows, bn), pl.cdiv(vocab, bv)),
        in_specs=[pl.BlockSpec((bn, dim), lambda i, j: (i, 0)), pl.BlockSpec((bv, dim), lambda i, j: (j, 0))],
        out_specs=[stat_spec] * 3,
        interpret=_interpret(),
        name="token_logprobs_fwd",
    )(hidden, unembed)
    lse, entropy = finalize_stats(tuple(x[:, 0] for x in stats))
    return lse, entropy if with_entropy else None


def _block_dz(row_ids, col_ids, h_ref, w_ref, row_refs, *, scale, n_rows, vocab):
    """(h [bn,d] masked, w [bv,d] masked, dz f32[bn,bv]) for one (row block, vocab block) pair."""
    t_ref, lse_ref, g_ref, c0_ref, *c1_ref = row_refs
    bn, bv = h_ref.shape[0], w_ref.shape[0]
    h = _zero_past(h_ref[...], row_ids * bn, n_rows)
    w = _zero_past(w_ref[...], col_ids * bv, vocab)
    rows = row_ids * bn + jax.lax.broadcasted_iota(jnp.int32, (bn, 1), 0)
    cols = col_ids * bv + jax.lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    col = lambda ref: ref[...][:, 0]
    z = matmul_nt(h, w) * scale
    onehot = t_ref[...] == cols
    c1 = col(c1_ref[0]) if c1_ref else None
    valid = (rows < n_rows) & (cols < vocab)
    dz = logit_cotangent(z, col(lse_ref), col(g_ref), col(c0_ref), c1, onehot, valid, scale)
    return h, w, dz


def _dh_kernel(h_ref, w_ref, *refs, **static):
    *row_refs, dh_ref = refs
    i, j = pl.program_id(0), pl.program_id(1)
    _, w, dz = _block_dz(i, j, h_ref, w_ref, row_refs, **static)
    part = matmul_nn(dz.astype(w.dtype), w)

    @pl.when(j == 0)
    def _first():
        dh_ref[...] = part

    @pl.when(j > 0)
    def _rest():
        dh_ref[...] += part


def _dw_kernel(h_ref, w_ref, *refs, **static):
    *row_refs, dw_ref = refs
    j, i = pl.program_id(0), pl.program_id(1)
    h, _, dz = _block_dz(i, j, h_ref, w_ref, row_refs, **static)
    part = matmul_tn(dz.astype(h.dtype), h)

    @pl.when(i == 0)
    def _first():
        dw_ref[...] = part

    @pl.when(i > 0)
    def _rest():
        dw_ref[...] += part


def pallas_backward_grads(hidden, unembed, targets, lse, g_logp, c0, c1, scale, block_size):
    """(d hidden f32[N,d], d unembed f32[V,d]) from two recomputing kernels (see the module docstring)."""
    (n_rows, dim), vocab = hidden.shape, unembed.shape[0]
    bn, bv = _blocks(n_rows, vocab, block_size)
    per_row = [targets, lse, g_logp, c0] + ([] if c1 is None else [c1])
    per_row = [x.reshape(n_rows, 1) for x in per_row]
    static = dict(scale=scale, n_rows=n_rows, vocab=vocab)
    n_blocks, v_blocks = pl.cdiv(n_rows, bn), pl.cdiv(vocab, bv)

    def call(kernel, grid, rows_of, vocab_of, out_shape, out_spec):
        h_spec = pl.BlockSpec((bn, dim), lambda a, b: (rows_of(a, b), 0))
        w_spec = pl.BlockSpec((bv, dim), lambda a, b: (vocab_of(a, b), 0))
        r_spec = pl.BlockSpec((bn, 1), lambda a, b: (rows_of(a, b), 0))
        return pl.pallas_call(
            functools.partial(kernel, **static),
            out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
            grid=grid,
            in_specs=[h_spec, w_spec] + [r_spec] * len(per_row),
            out_specs=out_spec,
            interpret=_interpret(),
        )(hidden, unembed, *per_row)

    dh = call(
        _dh_kernel, (n_blocks, v_blocks), lambda i, j: i, lambda i, j: j,
        (n_rows, dim), pl.BlockSpec((bn, dim), lambda i, j: (i, 0)),
    )  # fmt: skip
    dw = call(
        _dw_kernel, (v_blocks, n_blocks), lambda j, i: i, lambda j, i: j,
        (vocab, dim), pl.BlockSpec((bv, dim), lambda j, i: (j, 0)),
    )  # fmt: skip
    return dh, dw


IMPLS.add("pallas", make_fused(pallas_forward_stats, pallas_backward_grads))
