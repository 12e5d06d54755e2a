"""The optax optimizer and learning-rate schedule from `OptimConfig`.

Master parameters and optimizer state are float32 (the step casts to the model's compute dtype inside the
loss only), so everything here works on float32 trees.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from rljax.config import Config, OptimConfig


def total_optimizer_steps(cfg: Config) -> int:
    """Optimizer steps in a whole run: trainer.steps rollout batches x epochs x minibatches."""
    return cfg.trainer.steps * cfg.trainer.epochs * cfg.trainer.minibatches


def make_schedule(optim_cfg: OptimConfig, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """Learning rate as a function of the number of applied updates `count i32[]`.

    Linear warmup from 0 over `warmup_steps`, then `constant` (the peak rate) or `cosine` decay to 0 at
    `total_steps`.

    References: Loshchilov & Hutter 2017, "SGDR: Stochastic Gradient Descent with Warm Restarts" (cosine).
    """
    peak, warmup = optim_cfg.learning_rate, optim_cfg.warmup_steps
    if optim_cfg.schedule == "cosine":
        decay_steps = max(total_steps, warmup + 1)
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, decay_steps, end_value=0.0)
    if warmup == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
    )


def _decay_mask(params):
    """Weight decay on matrices only: biases and norm scales (ndim < 2) are not decayed."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(optim_cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """optax AdamW or SGD with `make_schedule`, global-norm clipping when `max_grad_norm > 0`.

    Weight decay is decoupled for AdamW and L2-coupled (added to the gradient) for SGD; both skip
    parameters with fewer than 2 dimensions.

    References: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization" (AdamW);
    Pascanu et al. 2013, "On the difficulty of training recurrent neural networks" (norm clipping).
    """
    schedule = make_schedule(optim_cfg, total_steps)
    if optim_cfg.name == "adamw":
        base = optax.adamw(
            schedule,
            b1=optim_cfg.b1,
            b2=optim_cfg.b2,
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
            mask=_decay_mask,
        )
    elif optim_cfg.name == "sgd":
        base = optax.chain(
            optax.add_decayed_weights(optim_cfg.weight_decay, mask=_decay_mask), optax.sgd(schedule)
        )
    else:  # OptimConfig choices are validated when the config is parsed
        raise ValueError(f"unknown optimizer {optim_cfg.name!r}; valid: adamw, sgd")
    if optim_cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(optim_cfg.max_grad_norm), base)
    return base
