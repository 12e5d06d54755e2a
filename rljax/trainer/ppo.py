"""PPO: actor + critic train step and update (GAE advantages, clipped value loss).

Critic choice: a separate copy of the policy decoder with a scalar value head (`init_critic_params`),
trained by its own optimizer (same OptimConfig, its own clipping). V(s_t) is read at position t, i.e.
from the same hidden state that predicts target token t, so values align with `loss_mask`.
The sequence reward is placed on the last loss token of each row; GAE runs over the loss tokens only.

Loss = policy terms of the GRPO family (with token-level GAE advantages) + vf_coef * agg(value_loss).

References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; Schulman et al. 2016,
"High-Dimensional Continuous Control Using Generalized Advantage Estimation"; Ouyang et al. 2022
(InstructGPT: critic initialised from a copy of a language model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rljax import algos
from rljax.config import Config
from rljax.trainer.accumulate import guarded_update, is_finite
from rljax.trainer.batch import TrainBatch
from rljax.trainer.logprobs import jit_batch_pass, make_logprob_fn, sequence_hidden
from rljax.trainer.optim import make_optimizer, make_schedule, total_optimizer_steps
from rljax.trainer.state import (
    TrainState,
    batch_sharding,
    critic_shardings,
    init_critic_params,
    param_shardings,
    replicated,
    resolve_model_config,
    state_shardings,
)
from rljax.trainer.step import (
    advance,
    jit_grad_fn,
    jit_step,
    make_gradients,
    make_policy_loss,
    optimizer_metrics,
)
from rljax.trainer.update import mismatch_metrics, reference_logprobs, run_epochs
from rljax.types import LossInputs

__all__ = [
    "critic_values",
    "init_critic_params",
    "make_advantages_fn",
    "make_ppo_grad_fn",
    "make_ppo_train_step",
    "make_ppo_update",
    "make_values_fn",
    "token_rewards",
]


def critic_values(
    model_config: Any, critic_params: dict, batch: LossInputs, mesh: Mesh | None = None
) -> jax.Array:
    """V(s_t) for every position: `f32[B,T]` (decoder in `model_config.compute_dtype`, head in float32;
    activations constrained on `mesh` when given)."""
    hidden = sequence_hidden(model_config, critic_params["decoder"], batch, mesh)
    head = critic_params["value_head"]
    return hidden.astype(jnp.float32) @ head["kernel"] + head["bias"]


def make_values_fn(cfg: Config, model_config: Any, mesh: Mesh) -> Callable[[dict, LossInputs], jax.Array]:
    """Jitted `fn(critic_params, batch) -> values f32[B,T]` (`critic_values`, no gradient): the PPO
    update's old-value pass, run over the train step's micro-batches like `make_logprob_fn` (peak
    memory of one micro-batch; equal to the whole-batch pass). Critic on `critic_shardings`, batch and
    values sharded like a batch; `fn.lower(abstract_critic, abstract_batch)` compiles it from shapes."""
    resolved = resolve_model_config(cfg, model_config)
    values = lambda critic, batch: critic_values(resolved, critic, batch, mesh)  # noqa: E731
    return jit_batch_pass(values, cfg, mesh, critic_shardings(resolved, mesh), num_outputs=1)


def token_rewards(batch: LossInputs) -> jax.Array:
    """`f32[B,T]`: each row's scalar reward on its last loss token, zero elsewhere."""
    mask = batch.loss_mask
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)
    return jax.nn.one_hot(last, t, dtype=jnp.float32) * batch.rewards[:, None]


def make_advantages_fn(
    cfg: Config, mesh: Mesh
) -> Callable[[LossInputs, jax.Array], tuple[jax.Array, jax.Array]]:
    """Jitted `fn(batch, values f32[B,T]) -> (advantages f32[B,T], returns f32[B,T])` by GAE.

    Returns are `A + V` before normalisation; with `algo.whiten_advantages` the advantages the policy
    loss sees are whitened over the batch's loss tokens (`algos.masked_whiten`).
    """
    gamma, lam, whiten = cfg.algo.gamma, cfg.algo.lam, cfg.algo.whiten_advantages

    def fn(batch, values):
        advantages, returns = algos.gae(
            rewards=token_rewards(batch), values=values, mask=batch.loss_mask, gamma=gamma, lam=lam
        )
        if whiten:
            advantages = algos.masked_whiten(advantages, batch.loss_mask)
        return advantages, returns

    return jax.jit(fn, out_shardings=(batch_sharding(mesh), batch_sharding(mesh)))


def make_ppo_loss(cfg: Config, model_config: Any, mesh: Mesh | None = None):
    """`loss_fn({"actor", "critic"}, mb, norms) -> (loss, sums)`: policy terms + vf_coef * value loss."""
    policy_loss = make_policy_loss(cfg, model_config, mesh)
    aggregate = algos.LOSS_AGGREGATIONS.get(cfg.algo.aggregation)
    model_config = resolve_model_config(cfg, model_config)
    vf_coef, clip = cfg.algo.vf_coef, cfg.algo.value_clip

    def loss_fn(params, mb: TrainBatch, norms: dict):
        pi_loss, sums = policy_loss(params["actor"], mb, norms)
        values = critic_values(model_config, params["critic"], mb.inputs, mesh)
        v_tok = algos.value_loss(values, mb.old_values, mb.returns, mb.inputs.loss_mask, clip=clip)
        v_loss = vf_coef * aggregate(v_tok, mb.inputs.loss_mask, **norms)
        total = pi_loss + v_loss
        return total, sums | {"loss/value": v_loss, "loss/total": total}

    return loss_fn


def make_ppo_step_fn(cfg: Config, model_config: Any, mesh: Mesh, optimizer: optax.GradientTransformation):
    """The un-jitted PPO step `(state, batch) -> (state, metrics)` (see make_ppo_train_step)."""
    gradients = make_gradients(cfg, mesh, make_ppo_loss(cfg, model_config, mesh))
    schedule = make_schedule(cfg.optim, total_optimizer_steps(cfg))

    def step(state: TrainState, batch: TrainBatch):
        grads, metrics = gradients({"actor": state.params, "critic": state.critic_params}, batch)
        actor_norm, critic_norm = optax.global_norm(grads["actor"]), optax.global_norm(grads["critic"])
        finite = is_finite(metrics["loss/total"], actor_norm + critic_norm)
        actor, actor_opt = guarded_update(optimizer, state.params, state.opt_state, grads["actor"], finite)
        critic, critic_opt = guarded_update(
            optimizer, state.critic_params, state.critic_opt_state, grads["critic"], finite
        )
        new_state = advance(
            state,
            finite,
            params=actor,
            opt_state=actor_opt,
            critic_params=critic,
            critic_opt_state=critic_opt,
        )
        metrics |= optimizer_metrics(actor_norm, finite, schedule(state.step), new_state.nonfinite_count)
        metrics["optim/critic_grad_norm"] = critic_norm
        return new_state, metrics

    return step


def make_ppo_grad_fn(cfg: Config, model_config: Any, mesh: Mesh) -> Callable:
    """Jitted `fn({"actor": params, "critic": critic_params}, batch) -> (grads, metrics)`: exactly the PPO
    step's accumulated gradients (no update). For tests and diagnostics."""
    resolved = resolve_model_config(cfg, model_config)
    shardings = {"actor": param_shardings(resolved, mesh), "critic": critic_shardings(resolved, mesh)}
    return jit_grad_fn(make_gradients(cfg, mesh, make_ppo_loss(cfg, model_config, mesh)), shardings, mesh)


def make_ppo_train_step(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict]]:
    """Jitted PPO step `(state, batch) -> (state, metrics)`, state donated; `batch` must carry
    `advantages f32[B,T]`, `returns` and `old_values`. Metrics: those of `make_train_step` plus
    loss/value and optim/critic_grad_norm. Actor and critic are skipped together on a non-finite step."""
    if optimizer is None:
        optimizer = make_optimizer(cfg.optim, total_optimizer_steps(cfg))
    shardings = state_shardings(resolve_model_config(cfg, model_config), mesh, optimizer, critic=True)
    return jit_step(make_ppo_step_fn(cfg, model_config, mesh, optimizer), shardings, mesh)


def make_ppo_update(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[TrainState, dict]]:
    """PPO: `update(state, batch: LossInputs, ref_params=None) -> (state, metrics)`.

    Old log-probs and old values come from the state at the start of the update (micro-batched passes:
    `make_logprob_fn`, `make_values_fn`); GAE advantages and returns are computed once from them; then
    epochs x minibatches PPO steps (see make_update).
    """
    logprob_fn = make_logprob_fn(cfg, model_config, mesh)
    values_fn = make_values_fn(cfg, model_config, mesh)
    advantages_fn = make_advantages_fn(cfg, mesh)
    step = make_ppo_train_step(cfg, model_config, mesh, optimizer=optimizer)
    mismatch = jax.jit(mismatch_metrics, out_shardings=replicated(mesh))

    def update(state: TrainState, batch: LossInputs, ref_params: Any = None):
        old_logp, _ = logprob_fn(state.params, batch)
        old_values = values_fn(state.critic_params, batch)
        advantages, returns = advantages_fn(batch, old_values)
        train_batch = TrainBatch(
            inputs=batch,
            old_logp=old_logp,
            advantages=advantages,
            ref_logp=reference_logprobs(cfg, logprob_fn, ref_params, batch),
            returns=returns,
            old_values=old_values,
        )
        extra = {k: float(v) for k, v in jax.device_get(mismatch(old_logp, batch)).items()}
        state, metrics = run_epochs(cfg, mesh, step, state, train_batch)
        return state, metrics | extra

    return update
