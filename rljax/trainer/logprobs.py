"""Per-token log-probs and entropies of a batch under some parameters, through `rljax.kernels`.

Every log-prob the trainer uses (current, old, reference) and every entropy comes from
`sequence_logprobs`, so they share one model function, one temperature convention and one kernel.

The no-gradient passes over a whole rollout batch (old and reference log-probs here, PPO values in
`rljax.trainer.ppo`) run as a `lax.map` over the train step's micro-batches inside one jit
(`map_micro_batches`), so their peak memory is one micro-batch's, whatever the rollout batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax import kernels, models
from rljax.config import Config
from rljax.trainer.accumulate import micro_batch_rows, split_micro_batches
from rljax.trainer.state import BATCH_AXES, batch_sharding, param_shardings, resolve_model_config
from rljax.types import LossInputs


def sequence_hidden(model_config: Any, params: Any, batch: LossInputs, mesh: Mesh | None = None) -> jax.Array:
    """Final-norm hidden states `f32[B,T,d]` of `batch.input_ids` with its positions and segment ids
    (the decoder computes in `model_config.compute_dtype`). With `mesh` (inside a sharded jit) the
    activations are constrained to the logical layout: each device computes its own rows."""
    return models.hidden_states(
        model_config,
        params,
        batch.input_ids,
        positions=batch.positions,
        segment_ids=batch.segment_ids,
        mesh=mesh,
    )


def sequence_logprobs(
    model_config: models.ModelConfig,
    params: Any,
    batch: LossInputs,
    *,
    impl: str = "auto",
    mesh: Mesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of every target token: `(logp f32[B,T], entropy f32[B,T])`.

    Row b, position t scores `batch.target_ids[b, t]` after `input_ids[b, :t+1]` at
    `batch.temperature` (the sampler's temperature, so ratios against the engine's processed log-probs
    are consistent). The head runs in `model_config.compute_dtype` (hidden states and unembedding cast
    to it; the kernel accumulates in float32). Values off `loss_mask` are meaningless; with
    `batch.head_positions` the head runs only there (the hidden states gathered per row) and every
    other position is 0.

    References: Shannon 1948 (entropy); the fused kernel is `rljax.kernels.token_logprobs`.
    """
    dtype = jnp.dtype(model_config.compute_dtype)
    hidden = sequence_hidden(model_config, params, batch, mesh).astype(dtype)
    targets, where = batch.target_ids, batch.head_positions
    if where is not None:  # the loss positions only; padding (index T) reads the last position
        hidden = jnp.take_along_axis(hidden, where[..., None], axis=1, mode="clip")
        targets = jnp.take_along_axis(targets, where, axis=1, mode="clip")
    b, k, d = hidden.shape
    logp, entropy = kernels.token_logprobs(
        hidden.reshape(b * k, d),
        models.unembed_matrix(model_config, params).astype(dtype),
        targets.reshape(b * k),
        temperature=float(batch.temperature),
        return_entropy=True,
        impl=impl,
        mesh=mesh,
    )
    logp, entropy = logp.reshape(b, k), entropy.reshape(b, k)
    if where is None:
        return logp, entropy
    t = batch.target_ids.shape[1]
    return scatter_rows(logp, where, t), scatter_rows(entropy, where, t)


def scatter_rows(values: jax.Array, where: jax.Array, length: int) -> jax.Array:
    """f32[B,length] zeros with `values[b, j]` at `[b, where[b, j]]`; out-of-range positions (padding)
    dropped. One scatter per row, batched (vmap), so a row-sharded batch scatters on each device without
    a gather."""
    row = lambda v, w: jnp.zeros((length,), values.dtype).at[w].set(v, mode="drop")  # noqa: E731
    return jax.vmap(row)(values, where)


def pass_micro_batches(cfg: Config, rows: int, data_parallel: int) -> int:
    """Micro-batches of a no-gradient pass (old/reference log-probs, PPO values) over `rows` sequences.

    Each is at most the train step's micro-batch (`accumulate.micro_batch_rows`: one packed row per
    device, or `trainer.micro_batch_size`, or the minibatch `rows / trainer.minibatches` when 0). The
    count is the smallest M that divides every data-parallel device's rows with `rows / M` within that
    bound, so the update's batch (a multiple of the
    micro-batch) runs exactly `rows / micro` of them and a batch smaller than one micro-batch (the
    weight-sync canary) runs whole. M divides each device's rows, so the strided split moves no data.
    """
    micro = micro_batch_rows(cfg, max(rows // cfg.trainer.minibatches, 1), data_parallel)
    per_device = rows // data_parallel if rows % data_parallel == 0 else rows
    fits = (m for m in range(1, per_device + 1) if per_device % m == 0 and rows <= m * micro)
    return next(fits, per_device)


def merge_micro_batches(tree: Any, mesh: Mesh) -> Any:
    """Inverse of `split_micro_batches`: `[M, b, ...]` leaves -> `[M * b, ...]` in the original row order
    (row `i * M + m` is micro-batch m's row i), sharded like a batch (no data movement)."""
    spec = batch_sharding(mesh)

    def merge(y):
        x = y.swapaxes(0, 1).reshape(y.shape[0] * y.shape[1], *y.shape[2:])
        return jax.lax.with_sharding_constraint(x, spec)

    return jax.tree.map(merge, tree)


def map_micro_batches(
    fn: Callable[[Any, LossInputs], Any], params: Any, batch: LossInputs, num_micro: int, mesh: Mesh
) -> Any:
    """`fn(params, batch)` (a tree of `[B, ...]` arrays) computed as a `lax.map` over `num_micro` strided
    micro-batches of `batch` (inside the caller's jit): the same values, with the temporaries of one
    micro-batch. `num_micro == 1` calls `fn` on the whole batch."""
    if num_micro == 1:
        return fn(params, batch)
    micro = split_micro_batches(batch, num_micro, mesh)
    return merge_micro_batches(jax.lax.map(lambda mb: fn(params, mb), micro), mesh)


def jit_batch_pass(
    fn: Callable[[Any, LossInputs], Any], cfg: Config, mesh: Mesh, params_shardings: Any, num_outputs: int
) -> Callable:
    """`jax.jit` of `fn(params, batch)` micro-batched by `pass_micro_batches` (the count is read from the
    batch's row count at trace time), params on `params_shardings`, batch and outputs sharded like a
    batch. The result can be `.lower(abstract_params, abstract_batch)`-ed for compile-only memory."""
    data_parallel = math.prod(mesh.shape[a] for a in BATCH_AXES)

    def batch_pass(params, batch: LossInputs):
        num_micro = pass_micro_batches(cfg, batch.input_ids.shape[0], data_parallel)
        return map_micro_batches(fn, params, batch, num_micro, mesh)

    out = batch_sharding(mesh)
    return jax.jit(
        batch_pass,
        in_shardings=(params_shardings, batch_sharding(mesh)),
        out_shardings=out if num_outputs == 1 else (out,) * num_outputs,
    )


def make_logprob_fn(
    cfg: Config, model_config: Any, mesh: Mesh
) -> Callable[[Any, LossInputs], tuple[jax.Array, jax.Array]]:
    """Jitted `fn(params, batch) -> (logp f32[B,T], entropy f32[B,T])` on the mesh (no gradient).

    Used by the update for old and reference log-probs and by the loop for the trainer-vs-rollout
    mismatch metric. Runs over the train step's micro-batches (`pass_micro_batches`), so its peak
    memory does not grow with the rollout batch; equal to the whole-batch pass. Params are placed like
    the policy (`param_shardings`), the batch and outputs like `batch_sharding`. Compute dtype and remat
    come from `cfg.model`. `fn.lower(abstract_params, abstract_batch)` compiles it from shapes alone.
    """
    model_config = resolve_model_config(cfg, model_config)
    impl = cfg.trainer.logprob_impl

    def logprob_fn(params, batch):
        return sequence_logprobs(model_config, params, batch, impl=impl, mesh=mesh)

    return jit_batch_pass(logprob_fn, cfg, mesh, param_shardings(model_config, mesh), num_outputs=2)
