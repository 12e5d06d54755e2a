"""Importance weights correcting the trainer vs rollout-engine mismatch of the behaviour policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._masked import clamp_log_ratio, masked_log_ratio, masked_mean

IS_LEVELS = ("none", "token", "sequence")
IS_MODES = ("truncate", "mask")


def importance_weights(
    trainer_logp: jax.Array,
    behavior_logp: jax.Array,
    mask: jax.Array,
    *,
    level: str,
    mode: str,
    cap: float,
) -> tuple[jax.Array, dict]:
    """Stop-gradient IS weights `w = pi_trainer(y) / pi_behavior(y)` for the policy loss (multiply per token).

    trainer_logp f32[B,T] (old policy as the trainer computes it), behavior_logp f32[B,T] (what the
    rollout engine reported for the same tokens), mask f32[B,T] -> (weights f32[B,T], metrics).
    level "token": w_bt = exp(trainer_logp - behavior_logp); "sequence": every token of row b gets
    the product exp(sum_t m (trainer_logp - behavior_logp)); "none": w = 1. Log-ratios are clamped to +-20.
    mode "truncate": min(w, cap); "mask": 0 where w > cap (drops the token, or the whole sequence).
    Weights are 0 off the mask. Metrics on the raw (pre-cap) weights, mask-weighted over tokens:
    `is_weight_mean`, `is_weight_max`, `is_frac_capped` (fraction with w > cap).

    References: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (truncated IS, fengyao.notion.site); Espeholt et al. 2018, "IMPALA" (arXiv:1802.01561),
    truncated importance sampling.
    """
    if level not in IS_LEVELS or mode not in IS_MODES:
        raise ValueError(f"level must be in {IS_LEVELS} and mode in {IS_MODES}, got {level!r}, {mode!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_w = masked_log_ratio(trainer_logp, behavior_logp, mask)
    if level == "sequence":
        log_w = jnp.broadcast_to(clamp_log_ratio(log_w.sum(axis=1, keepdims=True)), log_w.shape)
    elif level == "none":
        log_w = jnp.zeros_like(log_w)
    on = mask > 0
    raw = jnp.where(on, jnp.exp(log_w), 0.0)
    capped = on & (raw > cap)
    weights = jnp.minimum(raw, cap) if mode == "truncate" else jnp.where(capped, 0.0, raw)
    metrics = {
        "is_weight_mean": masked_mean(raw, mask),
        "is_weight_max": raw.max(),  # raw >= 0 and 0 off the mask, so an empty batch gives 0
        "is_frac_capped": masked_mean(capped.astype(jnp.float32), mask),
    }
    return jax.lax.stop_gradient(weights), jax.lax.stop_gradient(metrics)
