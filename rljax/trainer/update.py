"""Host side of an update: old/reference log-probs, epochs x minibatches of train steps, the skip check.

`make_update(cfg, ...)` returns `update(state, batch, ref_params=None) -> (state, metrics)` for one
rollout batch. Everything numeric happens in jitted functions; this module only sequences them,
fetches each step's scalar metrics, and raises `NonFiniteError` after K consecutive skipped steps.
When the run is on-policy for the trainer (`on_policy_shortcut`) the old log-probs are the single
train step's own forward, so no separate pass runs for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from rljax.config import Config
from rljax.metrics.values import combine_metrics
from rljax.trainer.batch import TrainBatch
from rljax.trainer.logprobs import make_logprob_fn
from rljax.trainer.state import TrainState, batch_sharding, check_nonfinite, put_global, replicated
from rljax.trainer.step import (
    GAP_KL,
    GAP_MAX,
    GAP_MEAN,
    logprob_gap,
    logprob_kl,
    make_train_step,
    policy_params,
)
from rljax.types import LossInputs

StepFn = Callable[[TrainState, TrainBatch], tuple[TrainState, dict]]


def minibatch_order(seed: int, step: int, epoch: int, rows: int, minibatches: int) -> np.ndarray:
    """i32[minibatches, rows / minibatches]: a shuffled split of the rows, deterministic in
    (trainer.seed, state.step at the start of the update, epoch), identical on every process."""
    rng = np.random.default_rng([seed, step, epoch])
    return rng.permutation(rows).astype(np.int32).reshape(minibatches, rows // minibatches)


def make_select_rows(mesh: Mesh) -> Callable[[Any, jax.Array], Any]:
    """Jitted `fn(batch, idx i32[b]) -> batch[idx]` (rows gathered, result sharded like a batch)."""
    return jax.jit(lambda tree, idx: jax.tree.map(lambda x: x[idx], tree), out_shardings=batch_sharding(mesh))


def summarize(history: list[dict]) -> dict:
    """Per-step host metrics -> one dict, each name combined over the update's steps by its reduction in
    the metric schema (`rljax.metrics.schema`, the one table: e.g. optim/lr and optim/skipped_steps last,
    optim/nonfinite summed, is/weight_max max, the rest averaged); adds optim/steps (steps run)."""
    return combine_metrics(history) | {"optim/steps": float(len(history))}


def run_epochs(cfg: Config, mesh: Mesh, step: StepFn, state: TrainState, batch: TrainBatch) -> tuple:
    """`trainer.epochs` passes of `trainer.minibatches` steps over `batch`. Returns (state, summary)."""
    rows, minibatches = batch.num_rows, cfg.trainer.minibatches
    if rows % minibatches:
        raise ValueError(f"trainer.minibatches={minibatches} does not divide the batch of {rows} rows")
    select = make_select_rows(mesh) if minibatches > 1 else None
    start = int(jax.device_get(state.step))
    history = []
    for epoch in range(cfg.trainer.epochs):
        order = minibatch_order(cfg.trainer.seed, start, epoch, rows, minibatches)
        for idx in order:
            mb = batch if select is None else select(batch, put_global(idx, replicated(mesh)))
            state, metrics = step(state, mb)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            history.append(metrics)
            check_nonfinite(int(metrics["optim/skipped_steps"]), cfg.trainer.max_nonfinite_skips)
    return state, summarize(history)


def mismatch_metrics(trainer_logp: jax.Array, batch: LossInputs) -> dict:
    """Trainer-vs-rollout log-prob gap on the loss tokens: max and mean |logp_trainer - logp_behavior|,
    and the per-token KL(rollout || trainer) estimate (GAP_KL)."""
    diff, ntok = logprob_gap(trainer_logp, batch), jnp.maximum(batch.loss_mask.sum(), 1.0)
    kl = logprob_kl(trainer_logp, batch).sum() / ntok
    return {GAP_MAX: diff.max(), GAP_MEAN: diff.sum() / ntok, GAP_KL: kl}


def on_policy_shortcut(cfg: Config) -> bool:
    """True when the old log-probs are provably the update's own forward: one epoch of one minibatch, so
    the only train step runs on the parameters at the start of the update, which define the old
    log-probs (`TrainBatch.old_logp`). Staleness (`trainer.max_staleness > 0`) does not change that:
    a stale batch's behaviour policy differs (the IS weights against `behavior_logp` correct for it,
    computed in the step from the same old log-probs), but its old log-probs are still the trainer's
    under the current params, so the shortcut is exact with staleness too.
    """
    return cfg.trainer.epochs == 1 and cfg.trainer.minibatches == 1


def make_update(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[TrainState, dict]]:
    """GRPO family: `update(state, batch: LossInputs, ref_params=None, base=None) -> (state, metrics)`
    (`base`: with LoRA, the frozen base params; `state.params` is then the adapter, and the reference
    policy, when algo.beta > 0 and no `ref_params` are given, is the base): the
    on-policy update (`make_on_policy_update`) when `on_policy_shortcut(cfg)`, else the update with a
    separate old log-prob pass (`make_separate_pass_update`). Same results, same metrics."""
    build = make_on_policy_update if on_policy_shortcut(cfg) else make_separate_pass_update
    return build(cfg, model_config, mesh, optimizer=optimizer)


def make_on_policy_update(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[TrainState, dict]]:
    """The update when `on_policy_shortcut(cfg)`: one train step that takes the old log-probs from its
    own forward under stop-gradient (`make_train_step(on_policy=True)`), so no old log-prob pass runs;
    the reference log-probs (algo.beta > 0) keep their pass. Metrics as `make_separate_pass_update`'s
    (the trainer-vs-rollout gap comes out of the step)."""
    if not on_policy_shortcut(cfg):
        raise ValueError(
            f"the on-policy update needs trainer.epochs == trainer.minibatches == 1, got "
            f"{cfg.trainer.epochs} and {cfg.trainer.minibatches}"
        )
    logprob_fn = make_logprob_fn(cfg, model_config, mesh)  # reference log-probs only
    step = make_train_step(cfg, model_config, mesh, optimizer=optimizer, on_policy=True)

    def update(state: TrainState, batch: LossInputs, ref_params: Any = None, base: Any = None):
        ref_params = lora_reference(ref_params, base, state.params)
        ref_logp = reference_logprobs(cfg, logprob_fn, ref_params, batch)
        train_batch = TrainBatch(inputs=batch, old_logp=None, advantages=batch.advantages, ref_logp=ref_logp)
        return run_epochs(cfg, mesh, with_base(step, base), state, train_batch)

    return update


def make_separate_pass_update(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[TrainState, dict]]:
    """GRPO family, any epochs x minibatches: `update(state, batch, ref_params=None) -> (state, metrics)`.

    Computes old log-probs with `state.params` (and reference log-probs with `ref_params` when
    algo.beta > 0) over the train step's micro-batches (`make_logprob_fn`: peak memory of one
    micro-batch, whatever the rollout batch), then runs epochs x minibatches train steps. Metrics: the
    step metrics summarized over steps (see `summarize`) plus the trainer-vs-rollout mismatch of the old
    log-probs. Raises NonFiniteError after trainer.max_nonfinite_skips consecutive skipped steps.
    """
    logprob_fn = make_logprob_fn(cfg, model_config, mesh)
    step = make_train_step(cfg, model_config, mesh, optimizer=optimizer)
    mismatch = jax.jit(mismatch_metrics, out_shardings=replicated(mesh))

    def update(state: TrainState, batch: LossInputs, ref_params: Any = None, base: Any = None):
        old_logp, _ = logprob_fn(policy_params(state.params, base), batch)
        ref_logp = reference_logprobs(cfg, logprob_fn, lora_reference(ref_params, base, state.params), batch)
        train_batch = TrainBatch(
            inputs=batch, old_logp=old_logp, advantages=batch.advantages, ref_logp=ref_logp
        )
        extra = {k: float(v) for k, v in jax.device_get(mismatch(old_logp, batch)).items()}
        state, metrics = run_epochs(cfg, mesh, with_base(step, base), state, train_batch)
        return state, metrics | extra

    return update


def with_base(step: Callable, base: Any) -> StepFn:
    """`step(state, batch)`: the jitted step itself, or with LoRA bound to the frozen `base` params."""
    return step if base is None else (lambda state, batch: step(state, batch, base))


def lora_reference(ref_params: Any, base: Any, adapter: Any) -> Any:
    """The reference policy's params: `ref_params`, or with LoRA (`base` given) the base model itself:
    the base with a zero adapter (`x W + 0`: exactly the base's forward, no second copy of the model)."""
    if base is None or ref_params is not None:
        return ref_params
    return policy_params(jax.tree.map(jnp.zeros_like, adapter), base)


def reference_logprobs(cfg: Config, logprob_fn: Callable, ref_params: Any, batch: LossInputs):
    """f32[B,T] reference log-probs when algo.beta > 0 (ref_params required), else None."""
    if not cfg.algo.needs_reference:
        return None
    if ref_params is None:
        raise ValueError(
            f"algo.beta={cfg.algo.beta} > 0 needs ref_params (the reference policy's parameters)"
        )
    return logprob_fn(ref_params, batch)[0]
