"""The loss-input contract: the one batch type that crosses from the host loop into the trainer.

Alignment convention (one place, used everywhere): row b holds one sequence (or several packed ones);
position t predicts `target_ids[b, t]` from `input_ids[b, :t+1]`, so `target_ids[b, t] == input_ids[b, t+1]`
inside a segment. Every per-token field ([B, T]) is indexed by the *target* position: `loss_mask[b, t] = 1`
iff `target_ids[b, t]` was sampled by the policy (not prompt, not tool output, not padding) and
`behavior_logp[b, t]` is the rollout engine's log-prob of that sampled token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "input_ids",
        "target_ids",
        "positions",
        "segment_ids",
        "loss_mask",
        "behavior_logp",
        "advantages",
        "rewards",
        "group_ids",
        "policy_version",
        "head_positions",
    ],
    meta_fields=["temperature", "top_p", "top_k"],
)
@dataclasses.dataclass(frozen=True)
class LossInputs:
    """A batch for the update step. Shapes: B sequences (rows), T tokens.

    Fields:
      input_ids: i32[B,T] token ids fed to the model (prompt + completion, padded with 0).
      target_ids: i32[B,T] the next token at each position (0 where there is none).
      positions: i32[B,T] RoPE positions (restart at 0 for each packed segment).
      segment_ids: i32[B,T] 0 = padding; tokens attend only within their own segment id (and, in a
        packed row with shared prompts, to the prompt segment theirs continues: `BRANCH_SHIFT` below).
      loss_mask: f32[B,T] 1 exactly on policy-sampled target tokens.
      behavior_logp: f32[B,T] rollout engine log-prob of each sampled target token (0 off-mask).
      advantages: f32[B] per-sequence advantage (GRPO family; zeros for PPO, which uses GAE).
      rewards: f32[B] scalar reward of each sequence.
      group_ids: i32[B] prompt group of each sequence (0..num_groups-1).
      policy_version: i32[B] policy version that generated each sequence.
    Packed batches (`rljax.trainer.packing`, several sequences per row, one segment id each) carry the
    four sequence fields per token instead, `[B,T]`: each token holds its sequence's value (0 on padding).
      temperature, top_p, top_k: the sampler settings that produced `behavior_logp` (static).
      head_positions: i32[B,K] or None. The positions of each row at which log-probs and entropies are
        computed (ascending; rows with fewer than K pad with T, out of range): `trainer.prepare_batch`
        sets them to the loss-mask positions, so the head skips prompt and padding positions. None:
        every position. Elsewhere `sequence_logprobs` returns 0.
    """

    input_ids: jax.Array
    target_ids: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array
    rewards: jax.Array
    group_ids: jax.Array
    policy_version: jax.Array
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    head_positions: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def replace(self, **changes) -> LossInputs:
        return dataclasses.replace(self, **changes)


# Shared prompts (`trainer.share_prompts`): a completion that continues a prompt stored once in its packed
# row carries the segment id `prompt | (branch << BRANCH_SHIFT)` (branch >= 1), the prompt its own id
# `prompt` (< 2**BRANCH_SHIFT). A token sees its own segment and the prompt segment it continues
# (`rljax.models.layers.attention_mask`); a shared prompt has no loss tokens of its own.
BRANCH_SHIFT = 16

TOKEN_FIELDS = ("input_ids", "target_ids", "positions", "segment_ids", "loss_mask", "behavior_logp")
SEQUENCE_FIELDS = ("advantages", "rewards", "group_ids", "policy_version")
_DTYPES = {
    "input_ids": np.int32,
    "target_ids": np.int32,
    "positions": np.int32,
    "segment_ids": np.int32,
    "loss_mask": np.float32,
    "behavior_logp": np.float32,
    "advantages": np.float32,
    "rewards": np.float32,
    "group_ids": np.int32,
    "policy_version": np.int32,
}


class BatchError(ValueError):
    """The loss-input batch violates the contract; the message names the field and the first bad row."""


def _check(cond: np.ndarray | bool, field: str, what: str) -> None:
    cond = np.asarray(cond)
    if cond.all():
        return
    bad = np.argwhere(~cond)[0] if cond.ndim else ()
    where = f" (first at index {tuple(int(i) for i in bad)})" if len(bad) else ""
    raise BatchError(f"LossInputs.{field}: {what}{where}")


def is_packed(batch: LossInputs) -> bool:
    """True for a packed batch (several sequences per row): its sequence fields are per token `[B,T]`."""
    return np.ndim(batch.advantages) == 2


def _segment_loss_counts(seg: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Loss tokens of each (row, segment > 0) present in a packed batch, as a flat array; shared
    prompts (segments another segment of the row continues, see BRANCH_SHIFT) are left out. Each
    (row, segment) is one int64 key `row << 32 | segment` (ids are non-negative int32), so one 1-D
    `np.unique` finds them (a 2-D unique over pairs costs ~10x more, measured on a 32 x 40 batch)."""
    real = seg > 0
    rows, _ = np.nonzero(real)
    keys = (rows.astype(np.int64) << 32) | seg[real].astype(np.int64)
    present, inverse = np.unique(keys, return_inverse=True)
    counts = np.bincount(inverse, weights=mask[real], minlength=len(present))
    low = (1 << BRANCH_SHIFT) - 1
    branch = present[(present & 0xFFFFFFFF) >> BRANCH_SHIFT > 0]
    prompts = ((branch >> 32) << 32) | (branch & low)  # the (row, prompt) each branch continues
    return counts[~np.isin(present, prompts)]


def validate_loss_inputs(batch: LossInputs, *, vocab_size: int | None = None) -> LossInputs:
    """Checks the contract once, on the host (numpy), before the batch enters jit. Returns the batch.

    Checks: dtypes and shapes, target alignment inside segments, mask only on real tokens and non-empty
    per sequence (a row, or a segment of a packed row; packed rows may be all padding), behaviour
    log-probs finite and <= 0 on the mask, token ids within the vocabulary.
    """
    arrays = {name: np.asarray(getattr(batch, name)) for name in TOKEN_FIELDS + SEQUENCE_FIELDS}
    shape = arrays["input_ids"].shape
    _check(len(shape) == 2, "input_ids", f"must be 2-D [B,T], got shape {shape}")
    packed = is_packed(batch)
    for name, arr in arrays.items():
        want = shape if name in TOKEN_FIELDS or packed else shape[:1]
        _check(arr.shape == want, name, f"shape {arr.shape} != expected {want}")
        _check(arr.dtype == _DTYPES[name], name, f"dtype {arr.dtype} != expected {np.dtype(_DTYPES[name])}")
    seg, mask = arrays["segment_ids"], arrays["loss_mask"]
    _check(np.isin(mask, (0.0, 1.0)), "loss_mask", "values must be 0 or 1")
    _check((mask == 0) | (seg > 0), "loss_mask", "is 1 on a padding position (segment_ids == 0)")
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    _check(
        ~same | (arrays["target_ids"][:, :-1] == arrays["input_ids"][:, 1:]),
        "target_ids",
        "misaligned: target_ids[b, t] must equal input_ids[b, t+1] inside a segment",
    )
    if packed:
        _check(_segment_loss_counts(seg, mask) > 0, "loss_mask", "a packed sequence has no loss tokens")
    else:
        _check(mask.sum(axis=1) > 0, "loss_mask", "a sequence row has no loss tokens")
    logp = arrays["behavior_logp"]
    _check(np.isfinite(logp), "behavior_logp", "non-finite value")
    _check((mask == 0) | (logp <= 0.0), "behavior_logp", "log-prob > 0 on a loss token")
    _check(np.isfinite(arrays["advantages"]), "advantages", "non-finite value")
    _check(arrays["policy_version"] >= 0, "policy_version", "negative version")
    if vocab_size is not None:
        for name in ("input_ids", "target_ids"):
            ids = arrays[name]
            _check((ids >= 0) & (ids < vocab_size), name, f"token id outside [0, {vocab_size})")
    return batch
