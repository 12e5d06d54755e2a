"""The optax optimizer and learning-rate schedule from `OptimConfig`.

Master parameters and optimizer state are float32 (the step casts to the model's compute dtype inside the
loss only), so everything here works on float32 trees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import optax

from rljax.config import Config, OptimConfig
from rljax.registry import Registry

Schedule = Callable[[jax.Array], jax.Array]


def total_optimizer_steps(cfg: Config) -> int:
    """Optimizer steps in a whole run: trainer.steps rollout batches x epochs x minibatches."""
    return cfg.trainer.steps * cfg.trainer.epochs * cfg.trainer.minibatches


# optim.schedule: fn(peak, warmup, total_steps) -> learning rate as a function of `count i32[]`.
SCHEDULES: Registry[Callable[[float, int, int], Schedule]] = Registry("learning-rate schedule")


@SCHEDULES.register("constant")
def constant_schedule(peak: float, warmup: int, total_steps: int) -> Schedule:
    """Linear warmup from 0 over `warmup` updates, then the peak rate."""
    del total_steps
    if warmup == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
    )


@SCHEDULES.register("cosine")
def cosine_schedule(peak: float, warmup: int, total_steps: int) -> Schedule:
    """Linear warmup from 0 over `warmup` updates, then cosine decay to 0 at `total_steps`.

    References: Loshchilov & Hutter 2017, "SGDR: Stochastic Gradient Descent with Warm Restarts".
    """
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), end_value=0.0)


def make_schedule(optim_cfg: OptimConfig, total_steps: int) -> Schedule:
    """Learning rate as a function of the number of applied updates `count i32[]`: the `optim.schedule`
    entry of SCHEDULES (constant or cosine, both after a linear warmup over `warmup_steps`)."""
    return SCHEDULES.get(optim_cfg.schedule)(optim_cfg.learning_rate, optim_cfg.warmup_steps, total_steps)


def _decay_mask(params):
    """Weight decay on matrices only: biases and norm scales (ndim < 2) are not decayed."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One `optim.name`: `make(optim_cfg, schedule) -> optax.GradientTransformation`, and `moments`, the
    float32 buffers of the parameters' shape its state holds per parameter (the memory formula's count)."""

    make: Callable[[OptimConfig, Schedule], optax.GradientTransformation]
    moments: int


OPTIMIZERS: Registry[Optimizer] = Registry("optimizer")


def _adamw(optim_cfg: OptimConfig, schedule: Schedule) -> optax.GradientTransformation:
    """AdamW, weight decay decoupled. References: Loshchilov & Hutter 2019, "Decoupled Weight Decay
    Regularization"."""
    c = optim_cfg
    return optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=_decay_mask)


def _sgd(optim_cfg: OptimConfig, schedule: Schedule) -> optax.GradientTransformation:
    """SGD with L2-coupled weight decay (added to the gradient)."""
    return optax.chain(
        optax.add_decayed_weights(optim_cfg.weight_decay, mask=_decay_mask), optax.sgd(schedule)
    )


OPTIMIZERS.add("adamw", Optimizer(_adamw, moments=2))  # mu and nu
OPTIMIZERS.add("sgd", Optimizer(_sgd, moments=0))


def make_optimizer(optim_cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The `optim.name` entry of OPTIMIZERS (AdamW or SGD) with `make_schedule`, and global-norm clipping
    when `max_grad_norm > 0`. Weight decay skips parameters with fewer than 2 dimensions.

    References: Pascanu et al. 2013, "On the difficulty of training recurrent neural networks" (clipping).
    """
    base = OPTIMIZERS.get(optim_cfg.name).make(optim_cfg, make_schedule(optim_cfg, total_steps))
    if optim_cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(optim_cfg.max_grad_norm), base)
    return base
