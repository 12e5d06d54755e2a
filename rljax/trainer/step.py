"""The GRPO-family train step: one optimizer step on a minibatch, as a pure sharded function.

Loss (per minibatch, each term aggregated by `algo.aggregation` with the minibatch's normalizers:
token count, rows, and the generation budget `rollout.max_tokens` as Dr. GRPO's constant length):
  policy  = agg(policy_loss(logp, old_logp, A) * w_IS)     w_IS = importance_weights(old_logp, behavior_logp)
  kl      = beta * agg(KL(logp, ref_logp))                  only when algo.beta > 0
  entropy = -entropy_coef * agg(entropy)                    only when algo.entropy_coef != 0
  total   = policy + kl + entropy
The IS weights correct the trainer-vs-rollout-engine mismatch (they depend on no parameter, so they
are computed once per minibatch, not per micro-batch).

On-policy shortcut (`on_policy=True`, chosen by `rljax.trainer.update.on_policy_shortcut`): the batch
carries no old log-probs; the loss takes `old_logp = stop_gradient(logp)` from its own forward, per
micro-batch, with the IS weights and the trainer-vs-rollout gap computed there too (IS levels reduce
per sequence and sequences never cross rows, so per micro-batch is exact; their metrics accumulate as
token sums and `max/` maxima like the others).

References: Shao et al. 2024, "DeepSeekMath" (GRPO); Schulman et al. 2017 (PPO clipped objective);
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (truncated IS).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rljax import algos
from rljax.config import Config
from rljax.models import lora
from rljax.trainer.accumulate import accumulate_gradients, guarded_update, is_finite, micro_batch_rows
from rljax.trainer.batch import TrainBatch
from rljax.trainer.logprobs import sequence_logprobs
from rljax.trainer.optim import make_optimizer, make_schedule, total_optimizer_steps
from rljax.trainer.state import (
    BATCH_AXES,
    TrainState,
    base_shardings,
    batch_sharding,
    param_shardings,
    replicated,
    resolve_model_config,
    state_shardings,
)
from rljax.types import LossInputs

LossFn = Callable[[Any, TrainBatch, dict], tuple[jax.Array, dict]]


def normalizers(batch: TrainBatch, *, max_len: int) -> dict:
    """Global normalizers of a minibatch for the aggregations: token count, sequence count (segments with
    loss tokens: one per row unpacked, several per packed row), length budget.

    `max_len` is Dr. GRPO's constant: the generation budget (`rollout.max_tokens`), bound outside jit,
    not the batch's padded width `T` (a length bucket that changes from step to step, which would
    rescale the loss and its gradient with the longest answer of the batch).
    """
    mask = batch.inputs.loss_mask
    return {
        "num_tokens": jnp.maximum(mask.sum(), 1.0),
        "num_seqs": algos.num_sequences(mask, batch.inputs.segment_ids),
        "max_len": max_len,
    }


def make_policy_loss(
    cfg: Config, model_config: Any, mesh: Mesh | None = None, *, on_policy: bool = False
) -> LossFn:
    """`loss_fn(params, micro_batch, norms) -> (loss f32[], sums)` for the policy (GRPO family and PPO actor).

    `sums` holds linear accumulators (exact over micro-batches): the loss terms, token sums of KL and
    entropy, and the policy loss's metrics weighted by the micro-batch token count. With `on_policy`
    the micro-batch's old log-probs and IS weights come from this forward (`own_old_logp`, whose sums
    join the others); `micro_batch.old_logp` is not read.
    """
    a = cfg.algo
    policy_loss = functools.partial(algos.POLICY_LOSSES.get(a.policy_loss), **algos_policy_options(cfg))
    aggregate = algos.LOSS_AGGREGATIONS.get(a.aggregation)
    kl_fn = algos.KL_ESTIMATORS.get(a.kl_estimator) if a.needs_reference else None
    model_config, impl = resolve_model_config(cfg, model_config), cfg.trainer.logprob_impl

    def loss_fn(params, mb: TrainBatch, norms: dict):
        mask, seg = mb.inputs.loss_mask, mb.inputs.segment_ids
        logp, entropy = sequence_logprobs(model_config, params, mb.inputs, impl=impl, mesh=mesh)
        mb, sums = own_old_logp(cfg, mb, logp) if on_policy else (mb, {})
        pg_tok, pg_metrics = policy_loss(logp, mb.old_logp, mb.advantages, mask, segment_ids=seg)
        pg = aggregate(pg_tok * mb.is_weights, mask, **norms, segment_ids=seg)
        ntok = mask.sum()
        sums |= {f"policy/{k}": v * ntok for k, v in pg_metrics.items()}
        sums |= {"loss/policy": pg, "tok/entropy": (entropy * mask).sum()}
        total = pg
        if kl_fn is not None:
            kl_tok = kl_fn(logp, mb.ref_logp)
            kl_loss = a.beta * aggregate(kl_tok, mask, **norms, segment_ids=seg)
            sums |= {"loss/kl": kl_loss, "tok/kl": (kl_tok * mask).sum()}
            total = total + kl_loss
        if a.entropy_coef:
            ent_loss = algos.entropy_bonus(
                entropy, mask, coef=a.entropy_coef, aggregation=a.aggregation, **norms, segment_ids=seg
            )
            sums["loss/entropy"] = ent_loss
            total = total + ent_loss
        sums["loss/total"] = total
        return total, sums

    return loss_fn


def algos_policy_options(cfg: Config) -> dict:
    """Keyword options of the configured policy loss (bound once, outside jit)."""
    a = cfg.algo
    return {"clip_low": a.clip_low, "clip_high": a.clip_high, "dual_clip_c": a.dual_clip_c}


def with_importance_weights(cfg: Config, batch: TrainBatch) -> tuple[TrainBatch, dict]:
    """Sets `batch.is_weights f32[B,T]` from old (trainer) vs behaviour log-probs; returns IS metrics."""
    a = cfg.algo
    weights, metrics = algos.importance_weights(
        batch.old_logp,
        batch.inputs.behavior_logp,
        batch.inputs.loss_mask,
        level=a.is_level,
        mode=a.is_mode,
        cap=a.is_cap,
        segment_ids=batch.inputs.segment_ids,
    )
    return batch.replace(is_weights=jax.lax.stop_gradient(weights)), metrics


# The trainer-vs-rollout log-prob gap on the loss tokens (update metrics; see `logprob_gap`).
GAP_MAX = "logprob/trainer_vs_rollout_abs_diff_max"
GAP_MEAN = "logprob/trainer_vs_rollout_abs_diff_mean"
# KL(rollout || trainer) per token, estimated on the rollout's own samples (k3: exp(r) - 1 - r >= 0,
# r = logp_trainer - logp_rollout): the "generation KL" other stacks gate on (NeMo-RL: 2e-3).
GAP_KL = "logprob/trainer_vs_rollout_kl"
# `importance_weights` metrics that are maxima; the others are token-weighted means.
IS_MAXIMA = ("is_weight_max",)


def logprob_kl(trainer_logp: jax.Array, inputs: LossInputs) -> jax.Array:
    """f32[B,T] `exp(r) - 1 - r`, r = trainer_logp - behavior_logp, on the loss tokens (GAP_KL's terms)."""
    r = jnp.where(inputs.loss_mask > 0, trainer_logp - inputs.behavior_logp, 0.0)
    return (jnp.expm1(r) - r) * inputs.loss_mask


def logprob_gap(trainer_logp: jax.Array, inputs: LossInputs) -> jax.Array:
    """f32[B,T] `|trainer_logp - behavior_logp|` on the loss tokens, 0 elsewhere."""
    return jnp.abs(trainer_logp - inputs.behavior_logp) * inputs.loss_mask


def own_old_logp(cfg: Config, mb: TrainBatch, logp: jax.Array) -> tuple[TrainBatch, dict]:
    """On-policy shortcut for one micro-batch: `old_logp = stop_gradient(logp)` (this forward's f32[b,T]),
    the IS weights from it, and linear accumulators of the IS metrics (`tok/is_*` token sums of the
    means, `max/is_*` maxima) and of the trainer-vs-rollout gap (`max/` GAP_MAX, `tok/logprob_gap`)."""
    mb, is_metrics = with_importance_weights(cfg, mb.replace(old_logp=jax.lax.stop_gradient(logp)))
    ntok = mb.inputs.loss_mask.sum()
    sums = {
        ("max/" + k if k in IS_MAXIMA else "tok/" + k): (v if k in IS_MAXIMA else v * ntok)
        for k, v in is_metrics.items()
    }
    gap = logprob_gap(mb.old_logp, mb.inputs)
    kl = logprob_kl(mb.old_logp, mb.inputs).sum()
    return mb, sums | {"max/" + GAP_MAX: gap.max(), "tok/logprob_gap": gap.sum(), "tok/logprob_kl": kl}


def own_old_logp_metrics(sums: dict, num_tokens: jax.Array) -> dict:
    """The update-level metrics of `own_old_logp`'s accumulated sums: `is/*` (as `is_metrics_out`) and
    the gap's max and token mean, equal to those of the separate pass over the same minibatch."""
    is_metrics = {
        k.split("/", 1)[1]: v if k.startswith("max/") else v / num_tokens
        for k, v in sums.items()
        if k.startswith(("max/is_", "tok/is_"))
    }
    gap = {
        GAP_MAX: sums["max/" + GAP_MAX],
        GAP_MEAN: sums["tok/logprob_gap"] / num_tokens,
        GAP_KL: sums["tok/logprob_kl"] / num_tokens,
    }
    return is_metrics_out(is_metrics) | gap


def policy_metrics(sums: dict, num_tokens: jax.Array) -> dict:
    """Scalar metrics from accumulated sums: every `loss/*` term, kl/entropy token means, clip fractions."""
    out = {k: jnp.zeros(()) for k in ("loss/kl", "loss/entropy")}  # reported as 0 when the term is off
    out |= {k: v for k, v in sums.items() if k.startswith("loss/")}
    out["kl/mean"] = sums.get("tok/kl", jnp.zeros(())) / num_tokens
    out["entropy/mean"] = sums["tok/entropy"] / num_tokens
    for k, v in sums.items():
        if k.startswith("policy/"):
            out[CLIP_METRIC_NAMES.get(k, k)] = v / num_tokens
    return out


# Names of the policy losses' metrics (token-weighted means) -> trainer metric names; others keep
# their name under "policy/".
CLIP_METRIC_NAMES = {
    "policy/clip_frac_low": "clip/frac_low",
    "policy/clip_frac_high": "clip/frac_high",
    "policy/dual_clip_frac": "clip/frac_dual",
}


def optimizer_metrics(grad_norm, finite, lr, skipped) -> dict:
    return {
        "optim/grad_norm": grad_norm,
        "optim/lr": jnp.asarray(lr, jnp.float32),
        "optim/skipped_steps": skipped.astype(jnp.float32),
        "optim/nonfinite": 1.0 - finite.astype(jnp.float32),
    }


def advance(state: TrainState, finite: jax.Array, **changes) -> TrainState:
    """Step counter and consecutive-skip counter after a (possibly skipped) update."""
    return state.replace(
        step=state.step + finite.astype(jnp.int32),
        nonfinite_count=jnp.where(finite, 0, state.nonfinite_count + 1).astype(jnp.int32),
        **changes,
    )


def num_micro_batches(cfg: Config, rows: int, data_parallel: int = 1) -> int:
    """Micro-batches per minibatch of `rows` rows (see `micro_batch_rows`). Packed: the fewest M that
    divide each device's rows with at most `trainer.packed_rows_per_micro_batch` per device in each (no
    padding rows are added for it: 9 rows per device at 2 make 9 micro-batches, 10 make 5)."""
    micro = micro_batch_rows(cfg, rows, data_parallel)
    if cfg.trainer.tokens_per_micro_batch and rows % data_parallel == 0:
        per_device = rows // data_parallel
        return next(m for m in range(1, per_device + 1) if per_device % m == 0 and rows <= m * micro)
    if rows % micro:
        raise ValueError(f"a micro-batch of {micro} rows does not divide the minibatch of {rows} rows")
    return rows // micro


def make_gradients(
    cfg: Config, mesh: Mesh, loss_fn: LossFn, *, on_policy: bool = False
) -> Callable[[Any, TrainBatch], tuple[Any, dict]]:
    """Un-jitted `fn(params, batch) -> (grads, metrics)` shared by every step: IS weights on the whole
    minibatch, then `loss_fn` gradients accumulated over micro-batches with the minibatch's normalizers
    (length budget `rollout.max_tokens`). With `on_policy` (`loss_fn` built with it too) the IS weights
    are the loss's own, and the metrics add the trainer-vs-rollout gap (`own_old_logp_metrics`).
    With LoRA `params` is the adapter (the gradient's tree) and `base` the frozen base params."""
    max_len = cfg.rollout.max_tokens
    data_parallel = math.prod(mesh.shape[a] for a in BATCH_AXES)

    def gradients(params, batch: TrainBatch, base: Any = None):
        norms = normalizers(batch, max_len=max_len)
        if not on_policy:
            batch, is_metrics = with_importance_weights(cfg, batch)
        fn = lambda p, mb: loss_fn(policy_params(p, base), mb, norms)
        num_micro = num_micro_batches(cfg, batch.num_rows, data_parallel)
        grads, sums = accumulate_gradients(fn, params, batch, num_micro, mesh)
        n = norms["num_tokens"]
        extra = own_old_logp_metrics(sums, n) if on_policy else is_metrics_out(is_metrics)
        return grads, policy_metrics(sums, n) | extra

    return gradients


def policy_params(params: Any, base: Any) -> Any:
    """The decoder's params: `params` (full fine-tuning, `base` None), or the base plus the adapter."""
    return params if base is None else lora.combine(base, params)


def make_policy_gradients(cfg: Config, model_config: Any, mesh: Mesh, *, on_policy: bool = False) -> Callable:
    """`make_gradients` of the GRPO-family policy loss (see make_policy_loss for `on_policy`)."""
    loss_fn = make_policy_loss(cfg, model_config, mesh, on_policy=on_policy)
    return make_gradients(cfg, mesh, loss_fn, on_policy=on_policy)


def make_grpo_step_fn(
    cfg: Config,
    model_config: Any,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    *,
    on_policy: bool = False,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict]]:
    """The un-jitted GRPO-family step `(state, batch) -> (state, metrics)` (see make_train_step)."""
    gradients = make_policy_gradients(cfg, model_config, mesh, on_policy=on_policy)
    schedule = make_schedule(cfg.optim, total_optimizer_steps(cfg))

    def step(state: TrainState, batch: TrainBatch, base: Any = None):
        grads, metrics = gradients(state.params, batch, base)
        grad_norm = optax.global_norm(grads)
        finite = is_finite(metrics["loss/total"], grad_norm)
        params, opt_state = guarded_update(optimizer, state.params, state.opt_state, grads, finite)
        new_state = advance(state, finite, params=params, opt_state=opt_state)
        metrics |= optimizer_metrics(grad_norm, finite, schedule(state.step), new_state.nonfinite_count)
        return new_state, metrics

    return step


def is_metrics_out(metrics: dict) -> dict:
    """`importance_weights` metrics (`is_weight_mean`, ...) under the trainer's names (`is/weight_mean`,
    `is/weight_max`, `is/frac_capped`); computed on the whole minibatch, so exact."""
    return {"is/" + k.removeprefix("is_"): jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def jit_step(
    step: Callable, shardings: TrainState, mesh: Mesh, base_shardings: Any = None
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict]]:
    """`jax.jit(step)` with explicit shardings (state in = state out = `shardings`, batch rows over
    (data, fsdp), metrics replicated) and the input state donated. With `base_shardings` (LoRA) the
    step takes the frozen base params as a third argument (not donated)."""
    extra = () if base_shardings is None else (base_shardings,)
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding(mesh), *extra),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )


def make_train_step(
    cfg: Config,
    model_config: Any,
    mesh: Mesh,
    *,
    optimizer: optax.GradientTransformation | None = None,
    on_policy: bool = False,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict]]:
    """Jitted GRPO-family step `(state, batch) -> (state, metrics)`; the input state is donated.

    One optimizer step on the minibatch `batch` (rows `[B]`, sharded over data x fsdp), with exact
    gradient accumulation over `B / trainer.micro_batch_size` micro-batches. A non-finite loss or
    gradient leaves params and optimizer state unchanged and bumps `state.nonfinite_count`.
    Metrics (replicated f32[] scalars): loss/total, loss/policy, loss/kl, loss/entropy, kl/mean,
    entropy/mean, clip/frac_low, clip/frac_high, is/weight_mean, is/weight_max, is/frac_capped,
    optim/grad_norm (before clipping), optim/lr, optim/skipped_steps, optim/nonfinite.
    With LoRA (`cfg.model.lora_rank > 0`) it is `(state, batch, base)`: `state.params` is the adapter.
    With `on_policy` (the update's on-policy shortcut) `batch.old_logp` is None: the step takes the old
    log-probs from its own forward under stop-gradient, and adds the metrics GAP_MAX, GAP_MEAN and GAP_KL.
    """
    if optimizer is None:
        optimizer = make_optimizer(cfg.optim, total_optimizer_steps(cfg))
    resolved = resolve_model_config(cfg, model_config)
    shardings = state_shardings(resolved, mesh, optimizer)
    step = make_grpo_step_fn(cfg, model_config, mesh, optimizer, on_policy=on_policy)
    return jit_step(step, shardings, mesh, base_shardings(resolved, mesh) if resolved.lora_rank else None)


def jit_grad_fn(gradients: Callable, params_shardings: Any, mesh: Mesh) -> Callable:
    """`jax.jit(gradients)` with params in/grads out on `params_shardings`, metrics replicated."""
    return jax.jit(
        gradients,
        in_shardings=(params_shardings, batch_sharding(mesh)),
        out_shardings=(params_shardings, replicated(mesh)),
    )


def make_grad_fn(
    cfg: Config, model_config: Any, mesh: Mesh, *, on_policy: bool = False
) -> Callable[[Any, TrainBatch], tuple[Any, dict]]:
    """Jitted `fn(params, batch) -> (grads, metrics)`: exactly the GRPO-family step's accumulated
    gradient (same micro-batching, no update) and its loss metrics. For tests and diagnostics."""
    gradients = make_policy_gradients(cfg, model_config, mesh, on_policy=on_policy)
    return jit_grad_fn(gradients, param_shardings(resolve_model_config(cfg, model_config), mesh), mesh)
