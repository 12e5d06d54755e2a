"""The oracle: plain log_softmax over materialized [N, V] logits, differentiated by JAX autodiff."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .common import IMPLS, matmul_nt


@IMPLS.register("reference")
def reference_token_logprobs(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    *,
    scale: float,
    with_entropy: bool,
    block_size: int | None = None,
    mesh: Any = None,
) -> tuple[jax.Array, jax.Array | None]:
    """logp f32[N] (and entropy f32[N]) from hidden [N,d], unembed [V,d], targets i32[N].

    Builds logits f32[N,V] = scale * hidden @ unembed.T; `block_size` is ignored, and so is `mesh` (plain
    JAX: inside a sharded jit, XLA's SPMD partitioner places it).
    Targets outside [0, V) give logp = 0 (same contract as the fused kernels).

    References: standard softmax cross-entropy; entropy H = -sum_j p_j log p_j.
    """
    del block_size, mesh
    logits = matmul_nt(hidden, unembed) * scale
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    in_range = (targets >= 0) & (targets < unembed.shape[0])
    safe = jnp.clip(targets, 0, unembed.shape[0] - 1)
    picked = jnp.take_along_axis(logp_all, safe[:, None], axis=-1)[:, 0]
    logp = jnp.where(in_range, jnp.minimum(picked, 0.0), 0.0)
    if not with_entropy:
        return logp, None
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy
