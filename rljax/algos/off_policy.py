"""Importance weights correcting the trainer vs rollout-engine mismatch of the behaviour policy.

Two small registries, resolved by name when the weights are traced:
    IS_LEVELS  fn(log_ratio f32[B,T], mask f32[B,T], segment_ids=None) -> log_weights f32[B,T]
               (what each token is weighed by; a sequence is a row, or a segment of a packed row)
    IS_MODES   fn(raw f32[B,T], capped bool[B,T], cap: float) -> weights f32[B,T]   (what the cap does)
`log_ratio` is the clamped per-token `trainer_logp - behavior_logp`, exactly 0 off the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.registry import Registry

from ._masked import clamp_log_ratio, masked_log_ratio, masked_mean
from ._segments import sequence_totals

IS_LEVELS: Registry = Registry("importance-weight level")
IS_MODES: Registry = Registry("importance-weight mode")


@IS_LEVELS.register("none")
def no_correction(log_ratio: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """No correction: log-weight 0 (weight 1) on every token. log_ratio, mask f32[B,T] -> f32[B,T].

    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347),
    which assumes the sampler is the old policy.
    """
    del mask, segment_ids
    return jnp.zeros_like(log_ratio)


@IS_LEVELS.register("token")
def token_level(log_ratio: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Per-token weight `pi_trainer(y_t) / pi_behavior(y_t)`. log_ratio, mask f32[B,T] -> f32[B,T].

    References: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (truncated IS, fengyao.notion.site).
    """
    del mask, segment_ids
    return log_ratio


@IS_LEVELS.register("sequence")
def sequence_level(log_ratio: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """The sequence likelihood ratio, the product over its loss tokens, on every token of the sequence:
    `sum_t log_ratio[b, t]` over the sequence, clamped. log_ratio, mask f32[B,T] -> f32[B,T];
    segment_ids i32[B,T] for packed rows (None: each row is one sequence).

    Exact, but its variance grows with the length: on long answers it sits at the cap (or the clamp).

    References: Precup et al. 2000, "Eligibility Traces for Off-Policy Policy Evaluation" (ICML),
    per-trajectory importance sampling.
    """
    del mask
    return clamp_log_ratio(sequence_totals(log_ratio, segment_ids))


@IS_LEVELS.register("geometric")
def geometric_level(log_ratio: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """The length-normalised sequence ratio, the geometric mean over its loss tokens, on every token of
    the sequence: `sum_t log_ratio[b, t] / n` over the sequence, with n its loss tokens (0 when empty).
    log_ratio, mask f32[B,T] -> f32[B,T]; segment_ids as for "sequence".

    A mean of clamped log-ratios is itself within the clamp; it does not saturate with the length.

    References: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), the
    length-normalised sequence importance ratio.
    """
    count = sequence_totals((mask > 0).astype(jnp.float32), segment_ids)
    return sequence_totals(log_ratio, segment_ids) / jnp.maximum(count, 1.0)


@IS_MODES.register("truncate")
def truncate(raw: jax.Array, capped: jax.Array, cap: float) -> jax.Array:
    """`min(w, cap)`: raw f32[B,T] (0 off the mask), capped bool[B,T] -> f32[B,T].

    References: Espeholt et al. 2018, "IMPALA" (arXiv:1802.01561), truncated importance sampling.
    """
    del capped
    return jnp.minimum(raw, cap)


@IS_MODES.register("mask")
def mask_capped(raw: jax.Array, capped: jax.Array, cap: float) -> jax.Array:
    """0 where `w > cap` (drops the token, or with a sequence level the whole row), else w.
    raw f32[B,T] (0 off the mask), capped bool[B,T] -> f32[B,T].

    References: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (masked IS, fengyao.notion.site).
    """
    del cap
    return jnp.where(capped, 0.0, raw)


def importance_weights(
    trainer_logp: jax.Array,
    behavior_logp: jax.Array,
    mask: jax.Array,
    *,
    level: str,
    mode: str,
    cap: float,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Stop-gradient IS weights `w = pi_trainer(y) / pi_behavior(y)` for the policy loss (multiply per token).

    trainer_logp f32[B,T] (old policy as the trainer computes it), behavior_logp f32[B,T] (what the
    rollout engine reported for the same tokens), mask f32[B,T] -> (weights f32[B,T], metrics).
    `level` names an IS_LEVELS entry: "token" w_bt = exp(trainer_logp - behavior_logp); "sequence" every
    token of row b gets the product exp(sum_t ...); "geometric" the geometric mean exp(mean_t ...);
    "none" w = 1. Per-token log-ratios are clamped to +-20 (and the sequence sum too).
    `mode` names an IS_MODES entry: "truncate" min(w, cap); "mask" 0 where w > cap.
    `segment_ids i32[B,T]` marks the sequences of packed rows (None: one sequence per row).
    Weights are 0 off the mask. Metrics on the raw (pre-cap) weights, mask-weighted over tokens:
    `is_weight_mean`, `is_weight_max`, `is_frac_capped` (fraction with w > cap).

    References: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (truncated IS, fengyao.notion.site); Espeholt et al. 2018, "IMPALA" (arXiv:1802.01561),
    truncated importance sampling; Zheng et al. 2025, "GSPO" (arXiv:2507.18071), geometric level.
    """
    level_fn, mode_fn = IS_LEVELS.get(level), IS_MODES.get(mode)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_w = level_fn(masked_log_ratio(trainer_logp, behavior_logp, mask), mask, segment_ids)
    on = mask > 0
    raw = jnp.where(on, jnp.exp(log_w), 0.0)
    capped = on & (raw > cap)
    metrics = {
        "is_weight_mean": masked_mean(raw, mask),
        "is_weight_max": raw.max(),  # raw >= 0 and 0 off the mask, so an empty batch gives 0
        "is_frac_capped": masked_mean(capped.astype(jnp.float32), mask),
    }
    return jax.lax.stop_gradient(mode_fn(raw, capped, cap)), jax.lax.stop_gradient(metrics)
