"""Shared pieces of the fused log-prob kernels: the impl registry, the online-softmax algebra, the custom VJP.

Every fused implementation supplies two pieces and this module turns them into a differentiable function:

- `forward_stats(hidden, unembed, scale, with_entropy, block_size) -> (lse f32[N], entropy f32[N] | None)`:
  per-row log-sum-exp of `scale * hidden @ unembed.T` (and the entropy of its softmax), streamed over vocab.
- `backward_grads(hidden, unembed, targets, lse, g_logp, c0, c1, scale, block_size)
  -> (dh f32[N,d], dw [V,d])`:
  recomputes logits chunk by chunk and contracts the logit cotangent
  `dz[i,j] = scale * (g_logp[i] * [j == t_i] - p[i,j] * (c0[i] + c1[i] * logp[i,j]))` with the inputs, where
  `p = softmax(z)`, `logp = z - lse`. `c1` is None when no entropy cotangent flows (then `c0 = g_logp`).

Derivation (z = scale * h @ W.T, p = softmax(z), H = -sum_j p_j log p_j):
  d logp_t / d z_j = [j == t] - p_j;  d H / d z_j = -p_j (log p_j + H).
  So dz_j = g_lp [j == t] - p_j (g_lp + g_H (log p_j + H)) = g_lp [j == t] - p_j (c0 + c1 log p_j)
  with c0 = g_lp + g_H * H and c1 = g_H. Only per-row lse and H are saved from the forward.

References: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018);
  Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rljax.registry import Registry

# name -> fn(hidden, unembed, targets, *, scale, with_entropy, block_size, mesh)
#         -> (logp f32[N], entropy f32[N] | None)
IMPLS: Registry[Callable[..., Any]] = Registry("token_logprobs impl")

Stats = tuple[jax.Array, jax.Array, jax.Array]  # (m, s, u): running max, sum e^(z-m), sum e^(z-m) (z-m)


def chunk_stats(z: jax.Array, valid: jax.Array, with_entropy: bool) -> Stats:
    """Online-softmax statistics of one logit block.

    Args: z f32[N,C] logits; valid bool[C] or bool[N,C] (masked columns contribute nothing; every row
    must have at least one valid column).
    Returns (m f32[N], s f32[N], u f32[N]) with m = max z, s = sum e^(z-m), u = sum e^(z-m) (z-m)
    (u is zeros when `with_entropy` is False).
    """
    z = jnp.where(valid, z, -jnp.inf)
    m = jnp.max(z, axis=-1)
    zc = jnp.where(valid, z - m[:, None], 0.0)  # finite everywhere, so e * zc never makes 0 * inf
    e = jnp.where(valid, jnp.exp(zc), 0.0)
    s = jnp.sum(e, axis=-1)
    u = jnp.sum(e * zc, axis=-1) if with_entropy else jnp.zeros_like(s)
    return m, s, u


def merge_stats(a: Stats, b: Stats) -> Stats:
    """Combines the statistics of two disjoint vocab ranges (all f32[N]); both must be finite."""
    m = jnp.maximum(a[0], b[0])
    da, db = a[0] - m, b[0] - m
    ea, eb = jnp.exp(da), jnp.exp(db)
    s = a[1] * ea + b[1] * eb
    # u is taken relative to the max, so re-centring from m_a to m adds (m_a - m) * s_a.
    u = ea * (a[2] + da * a[1]) + eb * (b[2] + db * b[1])
    return m, s, u


def finalize_stats(stats: Stats) -> tuple[jax.Array, jax.Array]:
    """(m, s, u) -> (lse f32[N], entropy f32[N]); entropy = log s - u / s, clamped at 0."""
    m, s, u = stats
    log_s = jnp.log(s)
    return m + log_s, jnp.maximum(log_s - u / s, 0.0)


def matmul_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M,K] @ b[N,K].T -> f32[M,N], float32 accumulation (bf16 inputs stay bf16 into the dot)."""
    return jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision="highest", preferred_element_type=jnp.float32
    )


def matmul_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [K,M].T @ b [K,N] -> f32[M,N], float32 accumulation."""
    return jax.lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision="highest", preferred_element_type=jnp.float32
    )


def matmul_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M,K] @ b [K,N] -> f32[M,N], float32 accumulation."""
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision="highest", preferred_element_type=jnp.float32
    )


def logit_cotangent(
    z: jax.Array,
    lse: jax.Array,
    g_logp: jax.Array,
    c0: jax.Array,
    c1: jax.Array | None,
    onehot: jax.Array,
    valid: jax.Array,
    scale: float,
) -> jax.Array:
    """dz f32[N,C] for one block (already multiplied by `scale`), see the module docstring.

    Args: z f32[N,C] scaled logits; lse, g_logp, c0, c1 f32[N]; onehot bool[N,C] (target hits);
    valid bool[C] or bool[N,C] (columns/rows outside the real [N, V] range get dz = 0).
    """
    logp = z - lse[:, None]
    coef = c0[:, None] if c1 is None else c0[:, None] + c1[:, None] * logp
    dz = jnp.where(onehot, g_logp[:, None], 0.0) - jnp.exp(logp) * coef
    # A select, not a product, so padded/duplicate columns and garbage edge rows (even NaN) give exactly 0.
    return jnp.where(valid, dz * scale, 0.0)


def target_logits(hidden: jax.Array, unembed: jax.Array, targets: jax.Array, scale: float) -> jax.Array:
    """z[i, t_i] f32[N] by gathering the N target rows of unembed (out-of-range targets are clipped)."""
    rows = jnp.take(unembed, jnp.clip(targets, 0, unembed.shape[0] - 1), axis=0)
    prod = hidden.astype(jnp.float32) * rows.astype(jnp.float32)
    return jnp.sum(prod, axis=-1) * scale
