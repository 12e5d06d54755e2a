"""Algorithm families (`algo.family`): what each one asks of the rest of the run, registered in FAMILIES.

A family is resolved once, when the run is built (`FAMILIES.get(cfg.algo.family)`); its entry answers the
questions that call sites would otherwise ask by comparing names: does the run train a critic, how many
samples per prompt does its advantage need, may sequences be packed. Config validation, the train state,
the memory report and preflight read these facts; `rljax.trainer.families` picks each family's step
and update builders under the same names.

References: Shao et al. 2024, "DeepSeekMath" (GRPO); Schulman et al. 2017, "Proximal Policy Optimization
Algorithms" (PPO with a learned value function and GAE).
"""

from __future__ import annotations

from dataclasses import dataclass

from rljax.registry import Registry


@dataclass(frozen=True)
class Family:
    """Facts about one algorithm family.

    critic: trains a value head beside the policy (TrainState.critic_*): GAE gives token-level
      advantages `f32[B,T]`, returns and old values; without it advantages are per sequence `f32[B]`.
    min_group_size: samples per prompt (`rollout.group_size`) its advantage needs.
    packing: sequences may be packed into rows (`trainer.tokens_per_micro_batch`).
    note: why, for the errors that name a limit above.
    """

    critic: bool
    min_group_size: int
    packing: bool
    note: str


FAMILIES: Registry[Family] = Registry("algorithm family")

FAMILIES.add(
    "grpo",
    Family(
        critic=False,
        min_group_size=2,
        packing=True,
        note="group-relative advantages (the GRPO family: GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++) "
        "compare at least 2 samples of each prompt",
    ),
)
FAMILIES.add(
    "ppo",
    Family(
        critic=True,
        min_group_size=1,
        packing=False,
        note="PPO's value targets are per row (set trainer.tokens_per_micro_batch to 0)",
    ),
)
