"""Decoder math as pure jnp functions: RMSNorm, RoPE, masked GQA attention, positions of packed rows.

Numerics follow the Hugging Face reference: RMSNorm statistics, RoPE angles and the attention softmax
in float32; matmuls in the compute dtype with float32 accumulation where the result is re-normalised.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rljax.types import BRANCH_SHIFT

_MASKED = float(jnp.finfo(jnp.float32).min)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: jnp.dtype) -> jax.Array:
    """`x * rsqrt(mean(x^2) + eps) * scale` over the last axis, in float32, returned in `dtype`.

    x [..., n], scale [n].

    References: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization" (arXiv:1910.07467).
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(dtype)


def rope_angles(inv_freq: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) `f32[B,T,hd]` of positions `i32[B,T]` for inverse frequencies `f32[hd/2]`.

    The two halves of head_dim share a frequency (the "rotate half" layout of Hugging Face checkpoints).

    References: Su et al. 2021, RoFormer (arXiv:2104.09864).
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x [B,T,N,hd]` by (cos, sin) `f32[B,T,hd]`; computed in float32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def attention_mask(
    q_slots: jax.Array, k_slots: jax.Array, q_segments: jax.Array, k_segments: jax.Array
) -> jax.Array:
    """bool[B,T,S]: query t sees key s iff `k_slot <= q_slot` and key s carries the query's segment id,
    or the id of the shared prompt the query's segment continues (`q_segment % 2**BRANCH_SHIFT`; for a
    segment that continues none, that is the segment itself).

    q_slots i32[T] / k_slots i32[S] are sequence (or cache) indices; segments i32[B,T] / i32[B,S].
    Padding (segment 0) only sees padding, so no row is empty and pad outputs stay finite.
    """
    causal = k_slots[None, :] <= q_slots[:, None]
    prompt = jnp.bitwise_and(q_segments, (1 << BRANCH_SHIFT) - 1)
    key = k_segments[:, None, :]
    same = (q_segments[:, :, None] == key) | (prompt[:, :, None] == key)
    return causal[None] & same


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    q [B,T,H,hd], k/v [B,S,K,hd] (H a multiple of K; query head h uses KV head h // (H/K)),
    mask bool[B,T,S] -> [B,T,H,hd] in q.dtype. Scale 1/sqrt(hd); softmax in float32.

    References: Vaswani et al. 2017 (arXiv:1706.03762); Ainslie et al. 2023, GQA (arXiv:2305.13245).
    """
    b, t, h, hd = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(q.dtype))
    return out.reshape(b, t, h, hd)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Positions `i32[B,T]` that restart at 0 at every change of segment id (packed rows, padding)."""
    t = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start_idx = jax.lax.cummax(jnp.where(starts, t[None, :], 0), axis=1)
    return t[None, :] - start_idx


def lora_weight_delta(a: jax.Array, b: jax.Array, stack_dims: int = 0) -> jax.Array:
    """`A @ B` of a LoRA pair in the kernel's layout, float32: A `[*S, *in, r]`, B `[*S, r, *out]` ->
    `[*S, *in, *out]` (`S`: `stack_dims` leading layer axes).

    References: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685).
    """
    stack, in_shape, out_shape = a.shape[:stack_dims], a.shape[stack_dims:-1], b.shape[stack_dims + 1 :]
    a2 = a.reshape(*stack, math.prod(in_shape), a.shape[-1]).astype(jnp.float32)
    b2 = b.reshape(*stack, b.shape[stack_dims], math.prod(out_shape)).astype(jnp.float32)
    delta = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST)
    return delta.reshape(*stack, *in_shape, *out_shape)
