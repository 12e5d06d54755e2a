"""Each algorithm family's step and update builders, registered in FAMILY_STEPS under the names of
`rljax.algos.FAMILIES` (a test keeps the two registries' names equal).

    FAMILY_STEPS.get(cfg.algo.family).make_update(cfg, model_config, mesh)   # what the loop calls
    make_family_update(cfg, model_config, mesh)                              # the same, by cfg

The GRPO family trains the policy alone on per-sequence advantages; PPO adds a critic, GAE advantages and
value targets (`rljax.trainer.ppo`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax
from jax.sharding import Mesh

from rljax.config import Config
from rljax.registry import Registry
from rljax.trainer.ppo import make_ppo_train_step, make_ppo_update
from rljax.trainer.step import make_train_step
from rljax.trainer.update import make_update


@dataclasses.dataclass(frozen=True)
class FamilySteps:
    """make_train_step(cfg, model_config, mesh, *, optimizer=None) -> jitted `(state, batch) -> (state,
    metrics)` for one minibatch; make_update(cfg, model_config, mesh, *, optimizer=None) -> `update(state,
    batch: LossInputs, ref_params=None) -> (state, metrics)` over a whole rollout batch."""

    make_train_step: Callable[..., Callable]
    make_update: Callable[..., Callable]


FAMILY_STEPS: Registry[FamilySteps] = Registry("algorithm family")
FAMILY_STEPS.add("grpo", FamilySteps(make_train_step, make_update))
FAMILY_STEPS.add("ppo", FamilySteps(make_ppo_train_step, make_ppo_update))


def make_family_update(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[Any, dict]]:
    """The update of `cfg.algo.family` (`FAMILY_STEPS`): `update(state, batch, ref_params=None)`."""
    return FAMILY_STEPS.get(cfg.algo.family).make_update(cfg, model_config, mesh, optimizer=optimizer)


def make_family_train_step(
    cfg: Config, model_config: Any, mesh: Mesh, *, optimizer: optax.GradientTransformation | None = None
) -> Callable[..., tuple[Any, dict]]:
    """The jitted train step of `cfg.algo.family` (`FAMILY_STEPS`; PPO: actor + critic)."""
    return FAMILY_STEPS.get(cfg.algo.family).make_train_step(cfg, model_config, mesh, optimizer=optimizer)
