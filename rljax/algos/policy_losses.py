"""Clipped policy-gradient losses, registered by name in POLICY_LOSSES.

Every loss has the signature
    fn(logp f32[B,T], old_logp f32[B,T], advantages f32[B] | f32[B,T], mask f32[B,T], *,
       segment_ids=None (i32[B,T]: the sequences of packed rows), **options)
        -> (per_token_loss f32[B,T], metrics dict[str, f32[]])
The loss is per token (0 off the mask) and NOT normalized: a LOSS_AGGREGATIONS entry does that, with
global normalizers, so micro-batching is exact. Every metric is a mask-weighted mean over the given
batch, so `sum_k metric_k * tokens_k / total_tokens` over micro-batches is exactly the batch's metric.
Options are Python floats bound outside jit (e.g. with functools.partial).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.registry import Registry

from ._masked import masked_fraction, masked_log_ratio, masked_mean, per_token
from ._segments import sequence_totals

POLICY_LOSSES: Registry = Registry("policy loss")


def _check_options(clip_low: float, clip_high: float, dual_clip_c: float | None) -> None:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be None/0 (off) or > 1, got {dual_clip_c}")


def clipped_objective(
    ratio: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
) -> tuple[jax.Array, dict]:
    """The PPO clipped surrogate per token, as a loss, plus clip-fraction metrics.

    ratio f32[B,T], advantages f32[B,T], mask f32[B,T] -> (loss f32[B,T], metrics):
        loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        dual clip (A < 0 only): loss = min(loss, -A * dual_clip_c)
    Metrics (mask-weighted fractions of tokens whose gradient a clip zeroes): `clip_frac_high`
    (A > 0, ratio > 1 + clip_high), `clip_frac_low` (A < 0, ratio < 1 - clip_low), `dual_clip_frac`
    (A < 0, ratio > dual_clip_c; 0 when off).

    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347);
    clip-higher: Yu et al. 2025, "DAPO" (arXiv:2503.14476); dual clip: Ye et al. 2020, "Mastering
    Complex Control in MOBA Games with Deep Reinforcement Learning" (arXiv:1912.09729).
    """
    _check_options(clip_low, clip_high, dual_clip_c)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    neg = advantages < 0
    if dual_clip_c:
        loss = jnp.where(neg, jnp.minimum(loss, -advantages * dual_clip_c), loss)
        dual = neg & (ratio > dual_clip_c)
    else:
        dual = jnp.zeros(ratio.shape, bool)
    metrics = {
        "clip_frac_high": masked_fraction((advantages > 0) & (ratio > 1.0 + clip_high), mask),
        "clip_frac_low": masked_fraction(neg & (ratio < 1.0 - clip_low), mask),
        "dual_clip_frac": masked_fraction(dual, mask),
    }
    return jnp.where(mask > 0, loss * mask, 0.0), metrics


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """PPO clipped loss with a token-level ratio `exp(logp - old_logp)` (GRPO, DAPO, PPO actor).

    logp f32[B,T] (current policy, differentiated), old_logp f32[B,T], advantages f32[B] or f32[B,T],
    mask f32[B,T] -> (per_token_loss f32[B,T], metrics). `clip_high > clip_low` is DAPO's clip-higher;
    `dual_clip_c` (None or 0 = off, else > 1) bounds the loss of negative-advantage tokens. The log-ratio
    is clamped to +-20 against overflow. Metrics: `clip_frac_high`, `clip_frac_low`, `dual_clip_frac`,
    `ratio_mean` (all mask-weighted means; a max is not exact over micro-batches, so none is reported).

    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347);
    Yu et al. 2025, "DAPO" (arXiv:2503.14476); Ye et al. 2020 (dual clip, arXiv:1912.09729).
    """
    del segment_ids  # token-level: no per-sequence reduction
    ratio = jnp.exp(masked_log_ratio(logp, old_logp, mask))
    loss, metrics = clipped_objective(
        ratio,
        per_token(advantages, logp),
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
    )
    metrics["ratio_mean"] = masked_mean(ratio, mask)
    return loss, jax.lax.stop_gradient(metrics)


@POLICY_LOSSES.register("gspo")
def gspo(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip_c: float | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """GSPO: PPO clipping on the sequence-level, length-normalized ratio (GSPO-token form).

    logp, old_logp, mask f32[B,T], advantages f32[B] or f32[B,T] -> (per_token_loss f32[B,T], metrics).
    `s_b = exp(sum_t m (logp - old_logp) / sum_t m)` is the geometric-mean ratio of sequence b (a row, or
    with `segment_ids i32[B,T]` a segment of a packed row). Each token
    uses `s_b * pi(y_t) / sg[pi(y_t)]` (value s_b, gradient s_b * grad logp_t), so the whole sequence is
    clipped together; with `seq_mean_token_mean` aggregation and a per-sequence advantage this is
    exactly GSPO's objective. The defaults are the paper's clip range (3e-4, 4e-4), far smaller than
    PPO's. Metrics as for `ppo_clip`, token-weighted (`ratio_mean` is the mean of s_b over tokens).

    References: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).
    """
    log_ratio = masked_log_ratio(logp, old_logp, mask)
    count = sequence_totals(mask, segment_ids)
    seq_log_ratio = sequence_totals(log_ratio, segment_ids) / jnp.maximum(count, 1.0)
    logp_on = jnp.where(mask > 0, logp, 0.0)
    token_log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logp_on - jax.lax.stop_gradient(logp_on)
    ratio = jnp.exp(token_log_ratio)  # |value| <= 20: a mean of clamped log-ratios
    loss, metrics = clipped_objective(
        ratio,
        per_token(advantages, logp),
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
    )
    metrics["ratio_mean"] = masked_mean(ratio, mask)
    return loss, jax.lax.stop_gradient(metrics)
