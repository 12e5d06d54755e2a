"""Loss aggregation (per-token loss -> scalar), registered by name in LOSS_AGGREGATIONS, and entropy.

Every aggregation: `fn(per_token_loss f32[B,T], mask f32[B,T], *, num_tokens=None, num_seqs=None,
max_len=None, segment_ids=None) -> f32[]`. The normalizers make micro-batching exact: pass the GLOBAL
values of the whole (mini)batch being optimized and sum the micro-batch results (and gradients):
    num_tokens  total mask weight of the whole batch      (default: this batch's, at least 1)
    num_seqs    number of sequences of the batch           (default: this batch's rows B)
    max_len     Dr. GRPO's constant length: the generation budget (the trainer passes
                rollout.max_tokens); the default, this batch's T, is constant only if every batch
                is padded to one width, which length-bucketed batches are not
A sequence is a row, or with `segment_ids i32[B,T]` a segment of a packed row (`rljax.trainer.packing`):
its per-sequence mean uses only its own tokens, so it is exact as long as a sequence is never split
across micro-batches (packing keeps each one whole in one row). A row with an all-zero mask contributes
0 (no NaN) and still counts in the default num_seqs. Off-mask values of the loss are ignored, even if
they are inf/NaN in the forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.registry import Registry

from ._segments import sequence_totals

LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")

Normalizer = jax.Array | float | int | None


def _masked(per_token_loss: jax.Array, mask: jax.Array) -> jax.Array:
    if per_token_loss.shape != mask.shape or mask.ndim != 2:
        raise ValueError(f"loss {per_token_loss.shape} and mask {mask.shape} must share one [B,T] shape")
    return jnp.where(mask > 0, per_token_loss * mask, 0.0)


def _or(value: Normalizer, default) -> jax.Array:
    return jnp.asarray(default if value is None else value, jnp.float32)


def _divide(total: jax.Array, normalizer: jax.Array) -> jax.Array:
    # Floored at float32's smallest normal so an explicit 0 over an empty batch gives 0, not NaN.
    return total / jnp.maximum(normalizer, jnp.finfo(jnp.float32).tiny)


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean(
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    num_tokens: Normalizer = None,
    num_seqs: Normalizer = None,
    max_len: Normalizer = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """`sum(loss * mask) / num_tokens`: every token weighs the same (long answers count more).

    per_token_loss, mask f32[B,T] -> f32[]. Uses num_tokens only.

    References: Yu et al. 2025, "DAPO" (arXiv:2503.14476), token-level policy gradient loss.
    """
    del num_seqs, max_len, segment_ids
    total = _masked(per_token_loss, mask).sum()
    return _divide(total, _or(num_tokens, jnp.maximum(mask.sum(), 1.0)))


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    num_tokens: Normalizer = None,
    num_seqs: Normalizer = None,
    max_len: Normalizer = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """`sum_b [sum_t loss*mask / max(sum_t mask, 1)] / num_seqs`: mean over tokens, then over sequences.

    per_token_loss, mask f32[B,T] -> f32[]. Uses num_seqs only (the original GRPO objective).

    References: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), eq. 3.
    """
    del num_tokens, max_len
    if segment_ids is None:
        per_seq = _masked(per_token_loss, mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
        return _divide(per_seq.sum(), _or(num_seqs, mask.shape[0]))
    # Each token weighs 1 / (its sequence's loss tokens): the token sum is the sum of sequence means.
    weight = 1.0 / jnp.maximum(sequence_totals(mask, segment_ids), 1.0)
    return _divide((_masked(per_token_loss, mask) * weight).sum(), _or(num_seqs, mask.shape[0]))


@LOSS_AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    num_tokens: Normalizer = None,
    num_seqs: Normalizer = None,
    max_len: Normalizer = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """`sum_b [sum_t loss*mask] / num_seqs`: the sequence log-likelihood objective of REINFORCE.

    per_token_loss, mask f32[B,T] -> f32[]. Uses num_seqs only.

    References: Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist
    Reinforcement Learning" (Machine Learning 8); Liu et al. 2025, "Understanding R1-Zero-Like
    Training" (arXiv:2503.20783), sec. 3.
    """
    del num_tokens, max_len, segment_ids
    return _divide(_masked(per_token_loss, mask).sum(), _or(num_seqs, mask.shape[0]))


@LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    num_tokens: Normalizer = None,
    num_seqs: Normalizer = None,
    max_len: Normalizer = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Dr. GRPO: `sum_b [sum_t loss*mask / max_len] / num_seqs`, a constant length normalizer.

    per_token_loss, mask f32[B,T] -> f32[]. Uses num_seqs and max_len, the generation budget (the
    paper's MAX_TOKENS; the trainer passes rollout.max_tokens). Then a batch's loss does not depend on
    the width it is padded to. The default, this batch's T, is only constant if every batch is padded to
    one width. (A multi-turn row may hold more loss tokens than the per-turn budget; the normalizer
    stays the same constant.)

    References: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783).
    """
    del num_tokens, segment_ids
    total = _masked(per_token_loss, mask).sum()
    return _divide(total, _or(num_seqs, mask.shape[0]) * _or(max_len, mask.shape[1]))


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the softmax at each position. logits f32[B,T,V] -> f32[B,T] (in nats).

    References: Mnih et al. 2016, "Asynchronous Methods for Deep Reinforcement Learning"
    (arXiv:1602.01783), entropy regularization.
    """
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    logp = jnp.where(jnp.isfinite(logp), logp, 0.0)  # -inf logits (masked vocab) have p = 0: 0 log 0 = 0
    return -(jnp.exp(logp) * logp).sum(axis=-1)


def entropy_bonus(
    entropy: jax.Array,
    mask: jax.Array,
    *,
    coef: float,
    aggregation: str = "token_mean",
    num_tokens: Normalizer = None,
    num_seqs: Normalizer = None,
    max_len: Normalizer = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The entropy term to ADD to the loss: `-coef * aggregate(entropy, mask)` (minimizing it raises entropy).

    entropy f32[B,T] (per-token policy entropy, e.g. from `token_entropy`), mask f32[B,T] -> f32[].
    `aggregation` names a LOSS_AGGREGATIONS entry (resolved here, outside jit); the normalizers are
    passed through, so the bonus is exact under micro-batching like the other loss terms.

    References: Mnih et al. 2016, "Asynchronous Methods for Deep Reinforcement Learning"
    (arXiv:1602.01783).
    """
    aggregate = LOSS_AGGREGATIONS.get(aggregation)
    norms = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len, segment_ids=segment_ids)
    return -coef * aggregate(entropy, mask, **norms)
