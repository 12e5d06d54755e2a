"""Shared step machinery: micro-batch split, exact gradient accumulation, the non-finite guard.

Exactness: every loss term is aggregated with the *minibatch's* normalizers (token count, sequence
count, max length), so the per-micro-batch losses sum to the whole-minibatch loss and their gradients
sum to its gradient. Metrics are accumulated as sums for the same reason and normalised once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax.config import Config
from rljax.trainer.state import BATCH_AXES

# Metrics accumulated with max instead of sum across micro-batches.
MAX_PREFIX = "max/"


def split_micro_batches(tree: Any, num_micro: int, mesh: Mesh) -> Any:
    """`[B, ...]` leaves -> `[num_micro, B / num_micro, ...]`; micro-batch m takes rows m, m+M, m+2M, ...

    The strided split keeps every micro-batch spread over all data-parallel devices with no data
    movement when each device's row count is a multiple of `num_micro` (rows are device-contiguous).
    """
    spec = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))

    def split(x):
        rows = x.shape[0]
        if rows % num_micro:
            raise ValueError(f"{rows} rows do not split into {num_micro} micro-batches")
        y = x.reshape(rows // num_micro, num_micro, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(y, spec)

    return jax.tree.map(split, tree)


def micro_batch_rows(cfg: Config, minibatch_rows: int, data_parallel: int) -> int:
    """Rows per micro-batch (packed: at most; `step.num_micro_batches`): with packing
    (`trainer.tokens_per_micro_batch > 0`) `trainer.packed_rows_per_micro_batch` packed rows per
    data-parallel device (0: the whole minibatch), else `trainer.micro_batch_size` (0: the whole
    minibatch of `minibatch_rows`)."""
    if cfg.trainer.tokens_per_micro_batch:
        rows_per_device = cfg.trainer.packed_rows_per_micro_batch
        if rows_per_device < 0:
            raise ValueError(f"trainer.packed_rows_per_micro_batch must be >= 0, got {rows_per_device}")
        return data_parallel * rows_per_device or minibatch_rows
    return cfg.trainer.micro_batch_size or minibatch_rows


def _merge(acc: dict, new: dict) -> dict:
    return {k: jnp.maximum(acc[k], new[k]) if k.startswith(MAX_PREFIX) else acc[k] + new[k] for k in acc}


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]],
    params: Any,
    batch: Any,
    num_micro: int,
    mesh: Mesh,
) -> tuple[Any, dict]:
    """Sum of `grad(loss_fn)(params, micro_batch)` and of its metric dict over `num_micro` micro-batches.

    `loss_fn(params, batch) -> (loss f32[], sums {name: f32[]})`; sums named `max/...` are maxed instead.
    The loss itself is returned in the sums as `loss/total`. With `num_micro == 1` the batch is used
    whole (no scan).
    """
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if num_micro == 1:
        return grad_fn(params, batch)
    micro = split_micro_batches(batch, num_micro, mesh)
    first = jax.tree.map(lambda x: x[0], micro)
    zeros_sums = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: loss_fn(params, first)[1]))
    zeros_sums = {
        k: jnp.full_like(v, -jnp.inf) if k.startswith(MAX_PREFIX) else v for k, v in zeros_sums.items()
    }
    zeros_grads = jax.tree.map(jnp.zeros_like, params)

    def body(carry, mb):
        grads, sums = grad_fn(params, mb)
        acc_grads, acc_sums = carry
        return (jax.tree.map(jnp.add, acc_grads, grads), _merge(acc_sums, sums)), None

    (grads, sums), _ = jax.lax.scan(body, (zeros_grads, zeros_sums), micro)
    return grads, sums


def guarded_update(
    optimizer: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any, finite: jax.Array
) -> tuple[Any, Any]:
    """One optimizer update, or (params, opt_state) unchanged when `finite` is False."""
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt_state, opt_state)


def is_finite(loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """bool[]: the loss and every gradient entry are finite (a NaN/inf anywhere makes the norm non-finite)."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm)
