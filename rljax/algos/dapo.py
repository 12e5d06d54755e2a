"""DAPO's data-side helpers: the dynamic-sampling filter and soft overlong reward shaping."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dynamic_sampling_mask(
    rewards: jax.Array, group_ids: jax.Array, num_groups: int
) -> tuple[jax.Array, jax.Array]:
    """Keeps the groups whose rewards are not all equal (zero std: no group-relative signal).

    rewards f32[B], group_ids i32[B] in [0, num_groups) -> (keep bool[B], frac_dropped f32[]), where
    frac_dropped is the fraction of the B sequences dropped (= fraction of groups for equal-size groups).
    "All equal" is exact equality (max == min), so a group of one is always dropped.

    References: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
    (arXiv:2503.14476), dynamic sampling.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    hi = jax.ops.segment_max(rewards, group_ids, num_segments=num_groups)
    lo = jax.ops.segment_min(rewards, group_ids, num_segments=num_groups)
    keep = (hi > lo)[group_ids]
    return keep, 1.0 - keep.astype(jnp.float32).mean()


def overlong_penalty(lengths: jax.Array, *, max_len: int, buffer: int, penalty: float) -> jax.Array:
    """DAPO soft overlong punishment, added to the reward of each sequence.

    lengths i32[B] (response tokens) -> f32[B]: 0 for L <= max_len - buffer, then linear down to
    -penalty at L = max_len, and -penalty beyond: `clip((max_len - buffer - L) / buffer, -1, 0) * penalty`.

    References: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
    (arXiv:2503.14476), eq. 13.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    over = (max_len - buffer - jnp.asarray(lengths, jnp.float32)) / buffer
    return jnp.clip(over, -1.0, 0.0) * penalty
