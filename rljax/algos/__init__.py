"""RL algorithms as pure JAX functions: advantages, policy losses, KL, aggregation, off-policy correction.

Variants live in registries, resolved by name when a step is built (`ADVANTAGES.get("grpo")`):
    ADVANTAGES         fn(*, rewards f32[B], group_ids i32[B], num_groups, **options) -> f32[B]
    STD_SCALES         fn(centered f32[B], group_std f32[B], rewards f32[B], eps) -> f32[B] (grpo's std_scale)
    POLICY_LOSSES      fn(logp, old_logp, advantages, mask, *, segment_ids=None, **options)
                       -> (per_token f32[B,T], metrics)
    KL_ESTIMATORS      fn(logp, ref_logp) -> f32[B,T]
    LOSS_AGGREGATIONS  fn(per_token, mask, *, num_tokens, num_seqs, max_len, segment_ids=None) -> f32[]
    IS_LEVELS          fn(log_ratio f32[B,T], mask f32[B,T], segment_ids=None) -> log_weights f32[B,T]
    IS_MODES           fn(raw f32[B,T], capped bool[B,T], cap) -> weights f32[B,T]
    FAMILIES           Family(critic, min_group_size, packing, note): what `algo.family` asks of the run
Plain functions: `sequence_totals`, `num_sequences` (per-sequence reductions over packed rows),
`advantage_options`, `gae`, `masked_whiten`, `value_loss`, `importance_weights`,
`dynamic_sampling_mask`, `overlong_penalty`, `token_entropy`, `entropy_bonus`.
Imports only jax/numpy and rljax.registry (see tests/test_layering.py).
"""

from ._masked import LOG_RATIO_CLAMP
from ._segments import num_sequences, sequence_totals
from .advantages import (
    ADVANTAGES,
    STD_SCALES,
    advantage_options,
    drgrpo,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from .aggregation import (
    LOSS_AGGREGATIONS,
    entropy_bonus,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_entropy,
    token_mean,
)
from .dapo import dynamic_sampling_mask, overlong_penalty
from .families import FAMILIES, Family
from .gae import gae, masked_whiten, value_loss
from .kl import KL_ESTIMATORS, k1, k2, k3
from .off_policy import IS_LEVELS, IS_MODES, importance_weights
from .policy_losses import POLICY_LOSSES, clipped_objective, gspo, ppo_clip

__all__ = [
    "ADVANTAGES",
    "FAMILIES",
    "Family",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "STD_SCALES",
    "advantage_options",
    "clipped_objective",
    "drgrpo",
    "dynamic_sampling_mask",
    "entropy_bonus",
    "gae",
    "grpo",
    "gspo",
    "importance_weights",
    "k1",
    "k2",
    "k3",
    "masked_whiten",
    "num_sequences",
    "overlong_penalty",
    "ppo_clip",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "sequence_totals",
    "token_entropy",
    "token_mean",
    "value_loss",
]
