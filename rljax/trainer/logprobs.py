"""Per-token log-probs and entropies of a batch under some parameters, through `rljax.kernels`.

Every log-prob the trainer uses (current, old, reference) and every entropy comes from
`sequence_logprobs`, so they share one model function, one temperature convention and one kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax import kernels, models
from rljax.config import Config
from rljax.trainer.state import batch_sharding, param_shardings, resolve_model_config
from rljax.types import LossInputs


def sequence_hidden(model_config: Any, params: Any, batch: LossInputs) -> jax.Array:
    """Final-norm hidden states `f32[B,T,d]` of `batch.input_ids` with its positions and segment ids
    (the decoder computes in `model_config.compute_dtype`)."""
    return models.hidden_states(
        model_config,
        params,
        batch.input_ids,
        positions=batch.positions,
        segment_ids=batch.segment_ids,
    )


def sequence_logprobs(
    model_config: models.ModelConfig, params: Any, batch: LossInputs, *, impl: str = "auto"
) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of every target token: `(logp f32[B,T], entropy f32[B,T])`.

    Row b, position t scores `batch.target_ids[b, t]` after `input_ids[b, :t+1]` at
    `batch.temperature` (the sampler's temperature, so ratios against the engine's processed log-probs
    are consistent). The head runs in `model_config.compute_dtype` (hidden states and unembedding cast
    to it; the kernel accumulates in float32). Values off `loss_mask` are computed but meaningless.

    References: Shannon 1948 (entropy); the fused kernel is `rljax.kernels.token_logprobs`.
    """
    dtype = jnp.dtype(model_config.compute_dtype)
    hidden = sequence_hidden(model_config, params, batch).astype(dtype)
    b, t, d = hidden.shape
    logp, entropy = kernels.token_logprobs(
        hidden.reshape(b * t, d),
        models.unembed_matrix(model_config, params).astype(dtype),
        batch.target_ids.reshape(b * t),
        temperature=float(batch.temperature),
        return_entropy=True,
        impl=impl,
    )
    return logp.reshape(b, t), entropy.reshape(b, t)


def make_logprob_fn(
    cfg: Config, model_config: Any, mesh: Mesh
) -> Callable[[Any, LossInputs], tuple[jax.Array, jax.Array]]:
    """Jitted `fn(params, batch) -> (logp f32[B,T], entropy f32[B,T])` on the mesh (no gradient).

    Used by the update for old and reference log-probs and by the loop for the trainer-vs-rollout
    mismatch metric. Params are placed like the policy (`param_shardings`), the batch like
    `batch_sharding`. Compute dtype and remat come from `cfg.model`.
    """
    model_config = resolve_model_config(cfg, model_config)
    impl = cfg.trainer.logprob_impl

    def logprob_fn(params, batch):
        return sequence_logprobs(model_config, params, batch, impl=impl)

    out = batch_sharding(mesh)
    return jax.jit(
        logprob_fn,
        in_shardings=(param_shardings(model_config, mesh), batch_sharding(mesh)),
        out_shardings=(out, out),
    )
