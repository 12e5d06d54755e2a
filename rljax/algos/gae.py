"""PPO critic pieces: generalized advantage estimation and the clipped value loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae(
    *, rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation over the mask tokens of each row.

    rewards f32[B,T] (per target token; an outcome reward sits on the last mask token), values f32[B,T]
    (critic value at each target position), mask f32[B,T] -> (advantages f32[B,T], returns f32[B,T]),
    both 0 off the mask. Going backwards over t:
        delta_t = r_t + gamma * m_{t+1} V_{t+1} - V_t
        A_t     = m_t * (delta_t + gamma * lam * A_{t+1})        (A_{t+1} is 0 where m_{t+1} = 0)
        R_t     = m_t * (A_t + V_t)
    A zero in the mask ends the trajectory: nothing is bootstrapped from past the end of a response, from
    padding, or across a gap (tool output, the next packed segment).

    References: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (arXiv:1506.02438).
    """
    rewards, values, mask = (jnp.asarray(x, jnp.float32) for x in (rewards, values, mask))
    if not rewards.shape == values.shape == mask.shape or rewards.ndim != 2:
        raise ValueError(
            f"rewards, values, mask must share one [B,T] shape: {rewards.shape}, {values.shape}, {mask.shape}"
        )
    zeros = jnp.zeros(rewards.shape[:1], jnp.float32)

    def step(carry, xs):
        next_value, next_adv = carry  # already multiplied by m_{t+1}
        r, v, m = xs
        delta = r + gamma * next_value - v
        adv = m * (delta + gamma * lam * next_adv)
        return (m * v, adv), adv

    xs = (rewards.T, values.T, mask.T)  # scan over time
    _, adv = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    advantages = adv.T
    return advantages, mask * (advantages + values)


def masked_whiten(x: jax.Array, mask: jax.Array, *, eps: float = 1e-8) -> jax.Array:
    """`(x - mean) / sqrt(var + eps)` with mean and (population) variance over the mask tokens of the
    whole batch; 0 off the mask. x f32[B,T], mask f32[B,T] -> f32[B,T]. An all-zero mask gives zeros.

    PPO's per-batch advantage normalisation: GAE advantages have a scale set by the reward and the critic's
    error, which the clip range assumes is about 1.

    References: the advantage normalisation of OpenAI baselines' ppo2, studied in Andrychowicz et al. 2021,
    "What Matters in On-Policy Reinforcement Learning?" (arXiv:2006.05990).
    """
    x, mask = jnp.asarray(x, jnp.float32), jnp.asarray(mask, jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    mean = (x * mask).sum() / count
    var = (jnp.square(x - mean) * mask).sum() / count
    return (x - mean) * jax.lax.rsqrt(var + eps) * mask


def value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, *, clip: float | None
) -> jax.Array:
    """Per-token clipped value loss `0.5 * max((V - R)^2, (V_clip - R)^2) * mask`.

    values f32[B,T] (current critic), old_values f32[B,T] (critic at rollout time), returns f32[B,T],
    mask f32[B,T] -> per_token f32[B,T], 0 off the mask; aggregate it with a LOSS_AGGREGATIONS entry.
    `V_clip = old + clip(V - old, -clip, clip)`; `clip` None or 0 gives the plain `0.5 * (V - R)^2`.

    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347) and
    the value clipping of OpenAI baselines' ppo2, analysed in Engstrom et al. 2020, "Implementation
    Matters in Deep Policy Gradients" (arXiv:2005.12729).
    """
    if clip is not None and clip < 0:
        raise ValueError(f"clip must be None, 0 (off) or > 0, got {clip}")
    on = mask > 0
    err = jnp.where(on, values - returns, 0.0)
    loss = err * err
    if clip:
        clipped = old_values + jnp.clip(values - old_values, -clip, clip)
        err_c = jnp.where(on, clipped - returns, 0.0)
        loss = jnp.maximum(loss, err_c * err_c)
    return 0.5 * loss * mask
