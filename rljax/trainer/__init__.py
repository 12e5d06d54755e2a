"""Sharded, pure-functional train steps for the GRPO family and PPO.

Build once, outside jit, from the typed Config:
  optimizer = make_optimizer(cfg.optim, total_optimizer_steps(cfg))
  state = init_train_state(cfg, model_config, params, mesh)
  update = make_family_update(cfg, model_config, mesh)   # by algo.family: the GRPO family or PPO
  batch, layout_metrics = prepare_batch(cfg, loss_inputs, mesh)   # packs when configured, then shards
  state, metrics = update(state, batch, ref_params)
"""

from rljax.trainer.batch import TrainBatch
from rljax.trainer.families import make_family_train_step, make_family_update
from rljax.trainer.logprobs import make_logprob_fn, sequence_logprobs
from rljax.trainer.optim import make_optimizer, make_schedule, total_optimizer_steps
from rljax.trainer.packing import layout_batch, prepare_batch
from rljax.trainer.ppo import critic_values, make_ppo_train_step, make_ppo_update, token_rewards
from rljax.trainer.state import (
    NonFiniteError,
    TrainState,
    batch_sharding,
    check_nonfinite,
    init_critic_params,
    init_train_state,
    param_shardings,
    put_global,
    shard_batch,
    shard_local_batch,
)
from rljax.trainer.step import make_train_step
from rljax.trainer.update import make_update

__all__ = [
    "NonFiniteError",
    "TrainBatch",
    "TrainState",
    "batch_sharding",
    "check_nonfinite",
    "critic_values",
    "init_critic_params",
    "init_train_state",
    "layout_batch",
    "make_family_train_step",
    "make_family_update",
    "make_logprob_fn",
    "make_optimizer",
    "make_ppo_train_step",
    "make_ppo_update",
    "make_schedule",
    "make_train_step",
    "make_update",
    "param_shardings",
    "prepare_batch",
    "put_global",
    "sequence_logprobs",
    "shard_batch",
    "shard_local_batch",
    "token_rewards",
    "total_optimizer_steps",
]
