"""Blockwise (flash) attention in plain JAX: memory linear in the sequence length, any backend.

The forward runs an online softmax over key blocks for each query block (scores `[B,K,G,bq,bk]` per step,
never `[T,S]`) and saves only the output and the float32 log-sum-exp; the backward (a `jax.custom_vjp`)
recomputes each block's probabilities from the log-sum-exp (FlashAttention-2: `D = rowsum(dO * O)`,
`dS = P * (dP - D)`). Only the key blocks that the mask lets some query of a query block see are read,
whatever rules the others out: the causal order (so the KV-cache path, whose query slots start at the
cache index, skips the unwritten tail too) and the segments of packed rows (a query block of one short
sequence reads its own blocks and its shared prompt's, not the row's other sequences). The block map
(`_needed_blocks`, the mask reduced to blocks, one query block at a time) gives each query block the
list of its key blocks and each key block the list of its query blocks, so the loops run over those
lists (skipping a wholly masked block changes nothing: its probabilities are exactly 0). Grouped-query
heads are a `[K, G]` split of the query heads: k/v are never repeated. Everything is batched over B and
the heads, so under `jit` with the batch and heads sharded each device runs its own rows and heads; the
only collective is the block map's reduction over the rows (`[nq, nk]` booleans), so a sharded batch
reads the union of its rows' blocks.

References: Dao et al. 2022, FlashAttention (arXiv:2205.14135); Dao 2023, FlashAttention-2
(arXiv:2307.08691); Rabe & Staats 2021, "Self-attention Does Not Need O(n^2) Memory" (arXiv:2112.05682).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rljax.models import layers

_MASKED = float(jnp.finfo(jnp.float32).min)  # the materialized reference's masked score
_NO_SLOT = int(jnp.iinfo(jnp.int32).max)  # slot of a padded key: no query sees it


def blockwise_attention(q, k, v, *, q_slots, k_slots, q_segments, k_segments, block_size=512):
    """Flash attention with the signature of `rljax.models.attention` (see there for the mask).

    q [B,T,H,hd], k/v [B,S,K,hd] -> [B,T,H,hd] in q.dtype. Query and key blocks are
    `min(block_size, T)` and `min(block_size, S)`; T and S are padded to a multiple internally.
    """
    b, t, h, hd = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    bq, bk = min(block_size, t), min(block_size, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    qg = _pad(q, 1, tp, 0).reshape(b, tp, kv_heads, h // kv_heads, hd)
    kp, vp = _pad(k.astype(q.dtype), 1, sp, 0), _pad(v.astype(q.dtype), 1, sp, 0)
    # Padded queries see nothing (their rows are dropped); padded keys are seen by no query.
    qs, ks = _pad(q_slots.astype(jnp.int32), 0, tp, -1), _pad(k_slots.astype(jnp.int32), 0, sp, _NO_SLOT)
    qseg, kseg = _pad(q_segments, 1, tp, -1), _pad(k_segments, 1, sp, -1)
    out = _flash(bq, bk, qg, kp, vp, qs, ks, qseg, kseg)
    return out[:, :t].reshape(b, t, h, hd)


def _pad(x: jax.Array, axis: int, size: int, value) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _block(x: jax.Array, axis: int, i, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def _key_block(k, v, ks, kseg, j, bk: int):
    """Key block j: (k [B,bk,K,hd], v [B,bk,K,hd], slots i32[bk], segments i32[B,bk])."""
    return _block(k, 1, j, bk), _block(v, 1, j, bk), _block(ks, 0, j, bk), _block(kseg, 1, j, bk)


def _needed_blocks(qs, ks, qseg, kseg, bq: int, bk: int) -> jax.Array:
    """bool[nq, nk]: some query of block i sees some key of block j, in some row (`layers.attention_mask`
    reduced to blocks). Built one query block at a time: peak `[B, bq, Sp]` booleans."""
    nk = ks.shape[0] // bk

    def query_block(i):
        m = layers.attention_mask(_block(qs, 0, i, bq), ks, _block(qseg, 1, i, bq), kseg)  # [B,bq,Sp]
        return m.reshape(m.shape[0], bq, nk, bk).any(axis=(0, 1, 3))

    return jax.lax.map(query_block, jnp.arange(qs.shape[0] // bq))


def _block_lists(needed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(order i32[n, m], count i32[n]) for needed bool[n, m]: row i's needed columns are
    `order[i, :count[i]]`, ascending (a stable sort puts them first)."""
    order = jnp.argsort(~needed, axis=1, stable=True)
    return order.astype(jnp.int32), needed.sum(axis=1).astype(jnp.int32)


def _lists(qs, ks, qseg, kseg, bq: int, bk: int, *, by_key: bool) -> tuple[jax.Array, jax.Array]:
    """`_block_lists` of the block map (by query block, or `by_key`). One block each way (short rows):
    that block, with no map to build (every real query sees itself; padded queries are dropped)."""
    if qs.shape[0] == bq and ks.shape[0] == bk:
        return jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    needed = _needed_blocks(qs, ks, qseg, kseg, bq, bk)
    return _block_lists(needed.T if by_key else needed)


def _scores(q_i, k_j, qs_i, ks_j, qseg_i, kseg_j):
    """Scaled, masked float32 scores [B,K,G,bq,bk] of q_i [B,bq,K,G,hd] and k_j [B,bk,K,hd], and the
    mask bool[B,1,1,bq,bk]."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32)
    mask = layers.attention_mask(qs_i, ks_j, qseg_i, kseg_j)[:, None, None]
    return jnp.where(mask, s * (q_i.shape[-1] ** -0.5), _MASKED), mask


def _forward(bq, bk, q, k, v, qs, ks, qseg, kseg):
    """-> (out [B,Tp,K,G,hd] in q.dtype, lse f32[B,K,G,Tp]); q [B,Tp,K,G,hd], k/v [B,Sp,K,hd]."""
    b, tp, kh, g, hd = q.shape
    k_blocks, k_count = _lists(qs, ks, qseg, kseg, bq, bk, by_key=False)

    def query_block(_, i):
        q_i, qs_i, qseg_i = _block(q, 1, i, bq), _block(qs, 0, i, bq), _block(qseg, 1, i, bq)

        def key_step(n, carry):
            o, m, denom = carry  # running output, row max, row sum of exp(s - m)
            k_j, v_j, ks_j, kseg_j = _key_block(k, v, ks, kseg, k_blocks[i, n], bk)
            s, _ = _scores(q_i, k_j, qs_i, ks_j, qseg_i, kseg_j)
            m_new = jnp.maximum(m, s.max(axis=-1))
            alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return o * alpha[..., None] + pv, m_new, denom * alpha + p.sum(axis=-1)

        o = jnp.zeros_like(jnp.einsum("bqkgd->bkgqd", q_i), jnp.float32)  # *_like: keeps explicit shardings
        init = (o, jnp.full_like(o[..., 0], _MASKED), jnp.zeros_like(o[..., 0]))
        o, m, denom = jax.lax.fori_loop(0, k_count[i], key_step, init)
        denom = jnp.where(
            denom == 0.0, 1.0, denom
        )  # a query block that reads no key block (not in the decoder)
        out_i = jnp.einsum("bkgqd->bqkgd", o / denom[..., None]).astype(q.dtype)
        return None, (out_i, m + jnp.log(denom))

    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(tp // bq))
    out = jnp.moveaxis(out, 0, 1).reshape(b, tp, kh, g, hd)  # [nq,B,bq,...] -> [B,Tp,...]
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, tp)  # [nq,B,K,G,bq] -> [B,K,G,Tp]
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(bq, bk, q, k, v, qs, ks, qseg, kseg):
    return _forward(bq, bk, q, k, v, qs, ks, qseg, kseg)[0]


def _flash_fwd(bq, bk, q, k, v, qs, ks, qseg, kseg):
    out, lse = _forward(bq, bk, q, k, v, qs, ks, qseg, kseg)
    return out, (q, k, v, qs, ks, qseg, kseg, out, lse)


def _flash_bwd(bq, bk, residuals, dout):
    """FlashAttention-2 backward: for each key block, loop over the query blocks that see it,
    accumulating dk/dv for the block and adding into a float32 dq."""
    q, k, v, qs, ks, qseg, kseg, out, lse = residuals
    b, tp, kh, g, hd = q.shape
    sp = k.shape[1]
    q_blocks, q_count = _lists(qs, ks, qseg, kseg, bq, bk, by_key=True)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", dout.astype(jnp.float32), out.astype(jnp.float32))
    f32 = dict(preferred_element_type=jnp.float32)

    def key_block(dq, j):
        k_j, v_j, ks_j, kseg_j = _key_block(k, v, ks, kseg, j, bk)

        def query_step(n, carry):
            dq, dk_j, dv_j = carry
            i = q_blocks[j, n]
            q_i, do_i = _block(q, 1, i, bq), _block(dout, 1, i, bq)
            s, mask = _scores(q_i, k_j, _block(qs, 0, i, bq), ks_j, _block(qseg, 1, i, bq), kseg_j)
            p = jnp.where(mask, jnp.exp(s - _block(lse, 3, i, bq)[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do_i.dtype), do_i, **f32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j, **f32)
            ds = (p * (dp - _block(delta, 3, i, bq)[..., None]) * hd**-0.5).astype(q.dtype)
            dq_i = _block(dq, 1, i, bq) + jnp.einsum("bkgqs,bskd->bqkgd", ds, k_j, **f32)
            dk_j = dk_j + jnp.einsum("bkgqs,bqkgd->bskd", ds, q_i, **f32)
            return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, axis=1), dk_j, dv_j

        zeros = jnp.zeros_like(k_j, jnp.float32)
        dq, dk_j, dv_j = jax.lax.fori_loop(0, q_count[j], query_step, (dq, zeros, zeros))
        return dq, (dk_j, dv_j)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros_like(q, jnp.float32), jnp.arange(sp // bk))
    dk = jnp.moveaxis(dk, 0, 1).reshape(b, sp, kh, hd)  # [nk,B,bk,K,hd] -> [B,Sp,K,hd]
    dv = jnp.moveaxis(dv, 0, 1).reshape(b, sp, kh, hd)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
