"""Outcome-reward advantage estimators (one scalar per sequence), registered by name in ADVANTAGES.

Every estimator is called with keywords:
    fn(*, rewards f32[B], group_ids i32[B], num_groups: int, **options) -> advantages f32[B]
`group_ids` says which prompt group each sequence belongs to (ids in [0, num_groups); `num_groups` is
static under jit). An estimator declares its options (`std_scale`, `eps`, ...) in its signature, each
with a default; `advantage_options` picks them from the configured values once, outside jit.
Stds are Bessel-corrected (like `torch.std`, as the reference implementations use); a group of one
sequence gets advantage 0 from every group-relative estimator.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from rljax.registry import Registry

from ._masked import center, group_stats, unbiased_std

ADVANTAGES: Registry = Registry("advantage estimator")

# `algo.adv_std_scale`: fn(centered f32[B], group_std f32[B], rewards f32[B], eps) -> advantages f32[B].
STD_SCALES: Registry = Registry("advantage std scale")
# What every estimator takes per batch; any other keyword of an estimator is one of its options.
ADVANTAGE_INPUTS = ("rewards", "group_ids", "num_groups")


def advantage_options(fn: Callable, offered: Mapping[str, Any]) -> dict[str, Any]:
    """The options estimator `fn` declares, taken from `offered` (e.g. `{"eps": cfg.algo.adv_eps}`).

    Read from `fn`'s signature once, when the loop is built, so an option reaches every estimator
    that declares it and no call site switches on the estimator's name. An option `fn` declares
    without a default that `offered` lacks raises (listing what is offered).
    """
    params = inspect.signature(fn).parameters
    options = {k: offered[k] for k in params if k in offered and k not in ADVANTAGE_INPUTS}
    missing = [
        k
        for k, p in params.items()
        if k not in ADVANTAGE_INPUTS and k not in options and p.default is inspect.Parameter.empty
    ]
    if missing:
        raise ValueError(f"{fn.__name__} needs options {missing}; offered: {sorted(offered)}")
    return options


@STD_SCALES.register("group")
def scale_by_group_std(centered: jax.Array, std: jax.Array, rewards: jax.Array, eps: float) -> jax.Array:
    """Divides by each sequence's group std (DeepSeekMath's GRPO)."""
    return centered / (std + eps)


@STD_SCALES.register("batch")
def scale_by_batch_std(centered: jax.Array, std: jax.Array, rewards: jax.Array, eps: float) -> jax.Array:
    """Divides by the std of all B rewards (group mean, batch std; Liu et al. 2025, arXiv:2508.08221)."""
    return centered / (unbiased_std(rewards) + eps)


@STD_SCALES.register("none")
def no_scale(centered: jax.Array, std: jax.Array, rewards: jax.Array, eps: float) -> jax.Array:
    """Leaves the centered rewards unscaled (then GRPO equals Dr. GRPO)."""
    return centered


def _as_f32(rewards: jax.Array) -> jax.Array:
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {rewards.shape}")
    return rewards


@ADVANTAGES.register("grpo")
def grpo(
    *,
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    std_scale: str = "group",
    eps: float = 1e-6,
) -> jax.Array:
    """GRPO group-relative advantage `(r - mean_group) / (std + eps)`.

    rewards f32[B], group_ids i32[B] -> f32[B]. `std_scale`: "group" divides by the group's std
    (DeepSeekMath), "batch" by the std of all B rewards (group mean, batch std), "none" does not scale
    (then identical to `drgrpo`). `std_scale` and `eps` are Python values bound outside jit.

    References: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300); batch std: Liu et al. 2025,
    "Tricks or Traps? A Deep Dive into RL for LLM Reasoning" (arXiv:2508.08221).
    """
    if std_scale not in STD_SCALES:
        raise ValueError(f"std_scale must be one of {', '.join(STD_SCALES.names())}, got {std_scale!r}")
    scale = STD_SCALES.get(std_scale)
    rewards = _as_f32(rewards)
    centered, std, _ = group_stats(rewards, group_ids, num_groups)
    return scale(centered, std, rewards, eps)


@ADVANTAGES.register("drgrpo")
def drgrpo(*, rewards: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    """Dr. GRPO advantage `r - mean_group`, with no std scaling (removes the difficulty bias).

    rewards f32[B], group_ids i32[B] -> f32[B].

    References: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783).
    """
    rewards = _as_f32(rewards)
    return group_stats(rewards, group_ids, num_groups)[0]


@ADVANTAGES.register("rloo")
def rloo(*, rewards: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    """RLOO leave-one-out advantage `r_i - mean_{j != i in group} r_j = n/(n-1) * (r_i - mean_group)`.

    rewards f32[B], group_ids i32[B] -> f32[B]; 0 for a group of one.

    References: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (arXiv:2402.14740); Kool et al. 2019, "Buy 4 REINFORCE
    Samples, Get a Baseline for Free!".
    """
    rewards = _as_f32(rewards)
    centered, _, count = group_stats(rewards, group_ids, num_groups)
    scale = jnp.where(count > 1, count / jnp.maximum(count - 1.0, 1.0), 0.0)
    return scale * centered


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(
    *, rewards: jax.Array, group_ids: jax.Array, num_groups: int, eps: float = 1e-6
) -> jax.Array:
    """REINFORCE++ advantage: rewards normalized over the whole batch, `(r - mean_B) / (std_B + eps)`.

    rewards f32[B] -> f32[B]; `group_ids`/`num_groups` are accepted for the common signature and unused.

    References: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models" (arXiv:2501.03262).
    """
    del group_ids, num_groups
    rewards = _as_f32(rewards)
    return center(rewards) / (unbiased_std(rewards) + eps)


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline(
    *, rewards: jax.Array, group_ids: jax.Array, num_groups: int, eps: float = 1e-6
) -> jax.Array:
    """REINFORCE++-baseline: subtract the group mean, then normalize over the batch.

    `x = r - mean_group; A = (x - mean_B(x)) / (std_B(x) + eps)`. rewards f32[B], group_ids i32[B] -> f32[B].

    References: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models" (arXiv:2501.03262), the "REINFORCE++-baseline" variant.
    """
    rewards = _as_f32(rewards)
    centered = group_stats(rewards, group_ids, num_groups)[0]
    return center(centered) / (unbiased_std(centered) + eps)
