"""The step and update builders of `algo.family`, chosen by what the family asks (`rljax.algos.FAMILIES`,
the one registry of families): a family with a critic (PPO) trains actor and critic on GAE advantages and
value targets (`rljax.trainer.ppo`); the others (the GRPO family) train the policy alone on per-sequence
advantages (`rljax.trainer.step`, `rljax.trainer.update`).

    make_family_update(cfg, model_config, mesh)       # what the loop calls
    make_family_train_step(cfg, model_config, mesh)   # one minibatch's jitted step (the memory report)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax
from jax.sharding import Mesh

from rljax.algos import FAMILIES
from rljax.config import Config
from rljax.trainer.ppo import make_ppo_train_step, make_ppo_update
from rljax.trainer.step import make_train_step
from rljax.trainer.update import make_update


def _builders(cfg: Config) -> tuple[Callable[..., Callable], Callable[..., Callable]]:
    """(make_train_step, make_update) of `cfg.algo.family`: each `(cfg, model_config, mesh, *,
    optimizer=None)`; the step maps `(state, minibatch) -> (state, metrics)`, the update `(state, batch:
    LossInputs, ref_params=None) -> (state, metrics)` over a whole rollout batch."""
    if FAMILIES.get(cfg.algo.family).critic:
        return make_ppo_train_step, make_ppo_update
    return make_train_step, make_update


def make_family_update(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[Any, dict]]:
    """The update of `cfg.algo.family`: `update(state, batch, ref_params=None) -> (state, metrics)`."""
    return _builders(cfg)[1](cfg, model_config, mesh, optimizer=optimizer)


def make_family_train_step(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[Any, dict]]:
    """The jitted train step of `cfg.algo.family` (PPO: actor + critic)."""
    return _builders(cfg)[0](cfg, model_config, mesh, optimizer=optimizer)
