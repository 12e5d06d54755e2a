"""`TrainBatch`: a `LossInputs` plus what the trainer derives from it before the optimizer steps."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from rljax.types import LossInputs


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["inputs", "old_logp", "advantages", "ref_logp", "is_weights", "returns", "old_values"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """One minibatch for a train step. Shapes: B rows, T tokens (target-position convention).

    Fields:
      inputs: the validated LossInputs.
      old_logp: f32[B,T] the trainer's log-probs under the parameters at the start of the update, or
        None for the on-policy step, which takes them from its own forward (`update.on_policy_shortcut`).
      advantages: f32[B] (GRPO family: `inputs.advantages`) or f32[B,T] (PPO: GAE).
      ref_logp: f32[B,T] reference-policy log-probs, or None when algo.beta == 0.
      is_weights: f32[B,T] trainer-vs-behaviour importance weights; set inside the step (None outside).
      returns: f32[B,T] PPO value targets (None for the GRPO family).
      old_values: f32[B,T] PPO critic values at the start of the update (None for the GRPO family).
    """

    inputs: LossInputs
    old_logp: jax.Array
    advantages: jax.Array
    ref_logp: Any = None
    is_weights: Any = None
    returns: Any = None
    old_values: Any = None

    def replace(self, **changes) -> TrainBatch:
        return dataclasses.replace(self, **changes)

    @property
    def num_rows(self) -> int:
        return int(self.inputs.input_ids.shape[0])
