"""Masked and grouped reductions shared by the algos modules (pure jax.numpy, no registries)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before `exp`: exp(20) = 4.85e8 is far
# below float32's max (3.4e38) and bfloat16's, so ratios, their products with advantages and k3's
# exp term stay finite; a token 20 nats off-policy is clipped or masked by every caller anyway.
# (verl clamps its approximate KL to the same +-20.) The clamp has zero gradient outside the range.
LOG_RATIO_CLAMP = 20.0


def clamp_log_ratio(log_ratio: jax.Array) -> jax.Array:
    """`f32[...]` log-ratio clamped to +-LOG_RATIO_CLAMP (see the constant for why)."""
    return jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_log_ratio(logp: jax.Array, other_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """`f32[B,T]` clamped `logp - other_logp` on mask tokens, exactly 0 off the mask.

    Off-mask log-probs may be garbage (padding, -inf): selecting before the subtraction keeps them out
    of the forward values and out of the gradient.
    """
    on = mask > 0
    diff = jnp.where(on, logp, 0.0) - jnp.where(on, other_logp, 0.0)
    return clamp_log_ratio(diff)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Scalar `sum(x * mask) / max(sum(mask), 1)`; 0 for an empty mask. x, mask f32[...] (same shape)."""
    return jnp.where(mask > 0, x * mask, 0.0).sum() / jnp.maximum(mask.sum(), 1.0)


def masked_fraction(cond: jax.Array, mask: jax.Array) -> jax.Array:
    """Scalar fraction of mask tokens where `cond bool[...]` holds (mask-weighted)."""
    return masked_mean(cond.astype(jnp.float32), mask)


def safe_sqrt(x: jax.Array) -> jax.Array:
    """`sqrt(x)` with value and gradient 0 at x <= 0 (plain sqrt has an infinite gradient at 0)."""
    pos = x > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def center(x: jax.Array) -> jax.Array:
    """`x - mean(x)` for `x f32[B]`, exactly 0 when all entries are equal.

    The mean is taken around a shift (the max, not differentiated: the mean does not depend on it), so
    equal rewards like 0.7 give exact zeros instead of rounding noise that a small std would amplify.
    """
    shift = jax.lax.stop_gradient(x.max())
    return (x - shift) - (x - shift).mean()


def unbiased_std(x: jax.Array) -> jax.Array:
    """Scalar Bessel-corrected std of `x f32[B]` like `torch.std` (0 if B == 1 or all entries are equal)."""
    dev = center(x)
    return safe_sqrt(jnp.sum(dev * dev) / max(x.shape[0] - 1, 1))


def group_stats(
    x: jax.Array, group_ids: jax.Array, num_groups: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-element `(x - group mean, group Bessel-corrected std, group size)`, each f32[B].

    x f32[B], group_ids i32[B] in [0, num_groups) (ids outside are dropped by `segment_sum`).
    A group of one has std 0; a group of equal values has deviations and std exactly 0 (the mean is
    taken around the group max, as in `center`).
    """
    ones = jnp.ones_like(x)
    count = jax.ops.segment_sum(ones, group_ids, num_segments=num_groups)
    shift = jax.ops.segment_max(jax.lax.stop_gradient(x), group_ids, num_segments=num_groups)
    shifted = x - jnp.where(count > 0, shift, 0.0)[group_ids]
    mean = jax.ops.segment_sum(shifted, group_ids, num_segments=num_groups) / jnp.maximum(count, 1.0)
    dev = shifted - mean[group_ids]
    var = jax.ops.segment_sum(dev * dev, group_ids, num_segments=num_groups) / jnp.maximum(count - 1.0, 1.0)
    return dev, safe_sqrt(var)[group_ids], count[group_ids]


def per_token(advantages: jax.Array, like: jax.Array) -> jax.Array:
    """Broadcasts `advantages f32[B]` (or passes `f32[B,T]`) to the shape of `like f32[B,T]`."""
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    if advantages.ndim != 2:
        raise ValueError(f"advantages must be [B] or [B,T], got shape {advantages.shape}")
    return jnp.broadcast_to(advantages.astype(jnp.float32), like.shape)
