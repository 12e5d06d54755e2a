"""Per-token estimators of KL(pi || pi_ref) from samples of pi, registered by name in KL_ESTIMATORS.

Every estimator: `fn(logp f32[B,T], ref_logp f32[B,T]) -> f32[B,T]` (not masked: aggregate it with the
loss mask). With `log r = ref_logp - logp`, clamped to +-LOG_RATIO_CLAMP (20, see rljax.algos._masked:
exp(20) = 4.85e8 stays finite in float32/bfloat16; the clamp has zero gradient beyond it):
    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, low variance, >= 0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.registry import Registry

from ._masked import clamp_log_ratio

KL_ESTIMATORS: Registry = Registry("KL estimator")


def _log_r(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return clamp_log_ratio(jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32))


@KL_ESTIMATORS.register("k1")
def k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k1 = logp - ref_logp (clamped to +-20). logp, ref_logp f32[B,T] -> f32[B,T].

    References: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html).
    """
    return -_log_r(logp, ref_logp)


@KL_ESTIMATORS.register("k2")
def k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k2 = (logp - ref_logp)^2 / 2 (log-ratio clamped to +-20). logp, ref_logp f32[B,T] -> f32[B,T].

    References: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html).
    """
    log_r = _log_r(logp, ref_logp)
    return 0.5 * log_r * log_r


@KL_ESTIMATORS.register("k3")
def k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k3 = exp(log r) - 1 - log r with log r = ref_logp - logp clamped to +-20 (GRPO's KL term).

    logp, ref_logp f32[B,T] -> f32[B,T], >= 0. `expm1` keeps it accurate near r = 1.

    References: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html);
    Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), eq. 4.
    """
    log_r = _log_r(logp, ref_logp)
    return jnp.expm1(log_r) - log_r
