"""`TrainState` (arrays only), its shardings, sharded init and batch placement on the mesh.

The optimizer, model definition and losses are closed over by the step factories, never stored, so orbax
save/restore and sharding inference need nothing special. Reference parameters are not part of the state:
they are passed to the update separately (they never change).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax import models, sharding
from rljax.algos import FAMILIES
from rljax.config import Config
from rljax.models import lora
from rljax.trainer.optim import make_optimizer, total_optimizer_steps

# Batch rows are split over every data-parallel mesh axis; the rest of each array is replicated.
BATCH_AXES = ("data", "fsdp")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "opt_state", "nonfinite_count", "critic_params", "critic_opt_state"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes during training, as arrays.

    Fields:
      step: i32[] number of optimizer updates applied (skipped non-finite steps do not count), which is
        also the optimizer's schedule count.
      params: policy parameters (master copy, `cfg.model.param_dtype`, float32 by default); with LoRA
        (`cfg.model.lora_rank > 0`) the adapter only: the frozen base is passed to the update beside it.
      opt_state: the policy optimizer's state (same dtype as params: with LoRA, over the adapter only).
      nonfinite_count: i32[] consecutive skipped (non-finite) steps; 0 after any good step.
      critic_params: PPO only (else None): `{"decoder": <policy-shaped params>, "value_head": {"kernel":
        f32[d], "bias": f32[]}}` -- a separate copy of the decoder with a scalar head (see rljax.trainer.ppo).
      critic_opt_state: PPO only (else None): the critic optimizer's state.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    nonfinite_count: jax.Array
    critic_params: Any = None
    critic_opt_state: Any = None

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


class NonFiniteError(FloatingPointError):
    """Too many consecutive update steps had a non-finite loss or gradient; the run stops."""


def check_nonfinite(skipped_steps: int, max_skips: int) -> None:
    """Host side: raises NonFiniteError once `skipped_steps` consecutive steps were skipped (>= max_skips)."""
    if skipped_steps >= max_skips:
        raise NonFiniteError(
            f"{skipped_steps} consecutive update steps had a non-finite loss or gradient and were skipped "
            f"(trainer.max_nonfinite_skips={max_skips}); parameters are left at the last good step. "
            "Check the batch (advantages, behaviour log-probs), the learning rate and bf16 overflow."
        )


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of scalars and small replicated arrays."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of any batch leaf `[B, ...]`: rows over (data, fsdp), other dims replicated.

    One NamedSharding serves as a pytree prefix for a whole batch (LossInputs, TrainBatch).
    """
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def dtype_of(name: str) -> jnp.dtype:
    """`"float32"`/`"bfloat16"` (config choices) -> jnp dtype."""
    return jnp.dtype(name)


def resolve_model_config(cfg: Config, model_config: models.ModelConfig) -> models.ModelConfig:
    """The model config the trainer runs: decoder class, master param dtype, compute dtype and remat from
    `cfg.model` (the decoder casts params to the compute dtype where used; hidden states are float32)."""
    return dataclasses.replace(
        model_config,
        param_dtype=cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype,
        remat=cfg.model.remat,
        attention_impl=cfg.model.attention_impl,
        attention_block_size=cfg.model.attention_block_size,
        unroll_layers=cfg.model.unroll_layers,
        decoder=model_decoder(cfg),
        lora_rank=cfg.model.lora_rank,
        lora_alpha=cfg.model.lora_alpha,
        lora_targets=tuple(cfg.model.lora_targets),
    )


def model_decoder(cfg: Config) -> str:
    """`ModelConfig.decoder` for `cfg.model.family` ("auto": "", the checkpoint family's built-in one)."""
    return "" if cfg.model.family == "auto" else cfg.model.family


def param_shardings(model_config: models.ModelConfig, mesh: Mesh) -> Any:
    """NamedSharding tree of the policy parameters, from the model's logical axes and LOGICAL_RULES."""
    return sharding.logical_to_sharding(models.param_logical_axes(model_config), mesh)


def trainable_shardings(model_config: models.ModelConfig, mesh: Mesh) -> Any:
    """NamedSharding tree of `TrainState.params`: the LoRA adapter when `model_config.lora_rank > 0`
    (the frozen base is held outside the state, `base_shardings`), else every parameter."""
    shardings = param_shardings(model_config, mesh)
    return lora.split_params(shardings)[1] if model_config.lora_rank else shardings


def base_shardings(model_config: models.ModelConfig, mesh: Mesh) -> Any:
    """NamedSharding tree of the frozen base params of a LoRA model (the checkpoint's params)."""
    return lora.split_params(param_shardings(model_config, mesh))[0]


def abstract_trainable(model_config: models.ModelConfig) -> Any:
    """ShapeDtypeStruct tree of `TrainState.params` (see `trainable_shardings`)."""
    if model_config.lora_rank:
        return lora.abstract_adapter(model_config)
    return models.abstract_params(model_config)


def abstract_critic(model_config: models.ModelConfig) -> dict:
    """ShapeDtypeStruct tree of the PPO critic (see `init_critic_params`)."""
    dtype = jnp.dtype(model_config.param_dtype)
    head = {
        "kernel": jax.ShapeDtypeStruct((model_config.hidden_size,), dtype),
        "bias": jax.ShapeDtypeStruct((), dtype),
    }
    return {"decoder": models.abstract_params(model_config), "value_head": head}


def critic_shardings(model_config: models.ModelConfig, mesh: Mesh) -> Any:
    """NamedSharding tree of the PPO critic: the decoder's shardings plus a replicated scalar head."""
    head = {"kernel": replicated(mesh), "bias": replicated(mesh)}
    return {"decoder": param_shardings(model_config, mesh), "value_head": head}


def opt_state_shardings(
    optimizer: optax.GradientTransformation, abstract_params: Any, shardings: Any, mesh: Mesh
) -> Any:
    """Shardings of `optimizer.init(params)` from `jax.eval_shape`: param-shaped leaves follow their
    parameter, the rest (step counts) are replicated. `abstract_params` is a ShapeDtypeStruct tree."""
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    return optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        abstract_opt,
        shardings,
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def state_shardings(
    model_config: models.ModelConfig,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    *,
    critic: bool = False,
) -> TrainState:
    """TrainState of NamedShardings for `model_config` (resolved: its param dtype is the master dtype);
    critic fields None unless `critic`."""
    p_sh = trainable_shardings(model_config, mesh)
    c_sh = c_opt = None
    if critic:
        c_sh = critic_shardings(model_config, mesh)
        c_opt = opt_state_shardings(optimizer, abstract_critic(model_config), c_sh, mesh)
    return TrainState(
        step=replicated(mesh),
        params=p_sh,
        opt_state=opt_state_shardings(optimizer, abstract_trainable(model_config), p_sh, mesh),
        nonfinite_count=replicated(mesh),
        critic_params=c_sh,
        critic_opt_state=c_opt,
    )


def put_global(tree: Any, shardings: Any, dtype: Any = None) -> Any:
    """Places a tree of host values (identical on every process) or arrays onto `shardings` as global
    jax.Arrays; works in multi-process runs (each process builds only its addressable shards)."""

    def put(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.jit(lambda a: a.astype(dtype or a.dtype), out_shardings=s)(x)
        host = np.asarray(x) if dtype is None else np.asarray(x).astype(dtype)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """A batch of host arrays with the global shape (the same on every process) -> global jax.Arrays."""
    return put_global(batch, jax.tree.map(lambda _: batch_sharding(mesh), batch))


def shard_local_batch(local_batch: Any, mesh: Mesh) -> Any:
    """Each process's own rows `[B / num_processes, ...]` -> one global batch `[B, ...]` (process order)."""
    s = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(s, np.asarray(x)), local_batch)


def init_critic_params(model_config: Any, params: Any) -> dict:
    """PPO critic: a separate copy of the policy decoder plus a zero-initialised scalar value head.

    A separate copy (rather than a head on the policy's hidden states) keeps the value loss from
    pulling on the policy's features and lets the critic have its own optimizer state, as in the
    InstructGPT/verl PPO setups. Zero head weights make every initial value 0. The decoder leaves are
    the given ones; `init_train_state` places them into fresh buffers (never aliasing the policy's).
    """
    d = model_config.hidden_size
    head = {"kernel": np.zeros((d,), np.float32), "bias": np.zeros((), np.float32)}
    return {"decoder": params, "value_head": head}


def init_train_state(
    cfg: Config,
    model_config: Any,
    params: Any,
    mesh: Mesh,
    *,
    optimizer: optax.GradientTransformation | None = None,
    critic_params: Any = None,
) -> TrainState:
    """Sharded TrainState from (host or device) parameters: every parameter, or with LoRA
    (`cfg.model.lora_rank > 0`) the adapter only (`rljax.models.lora.init_adapter`).

    Shardings come from `jax.eval_shape` of the optimizer init and the model's logical axes, so no
    unsharded copy of the optimizer state is ever built. Master params are cast to `cfg.model.param_dtype`.
    `optimizer` defaults to `make_optimizer(cfg.optim, total_optimizer_steps(cfg))` (what the steps use).
    For a family with a critic (`rljax.algos.FAMILIES`: PPO) the critic defaults to
    `init_critic_params(model_config, params)`.
    """
    if optimizer is None:
        optimizer = make_optimizer(cfg.optim, total_optimizer_steps(cfg))
    if critic_params is None and FAMILIES.get(cfg.algo.family).critic:
        critic_params = init_critic_params(model_config, params)
    model_config = resolve_model_config(cfg, model_config)
    dtype = dtype_of(model_config.param_dtype)
    shardings = state_shardings(model_config, mesh, optimizer, critic=critic_params is not None)
    params = put_global(params, shardings.params, dtype)
    init_opt = lambda p, s: jax.jit(optimizer.init, out_shardings=s)(p)
    critic_opt = None
    if critic_params is not None:
        critic_params = put_global(critic_params, shardings.critic_params, dtype)
        critic_opt = init_opt(critic_params, shardings.critic_opt_state)
    return TrainState(
        step=put_global(np.zeros((), np.int32), replicated(mesh)),
        params=params,
        opt_state=init_opt(params, shardings.opt_state),
        nonfinite_count=put_global(np.zeros((), np.int32), replicated(mesh)),
        critic_params=critic_params,
        critic_opt_state=critic_opt,
    )
