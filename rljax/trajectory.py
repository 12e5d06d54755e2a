"""Trajectory processing: sampled completions (grouped per prompt) -> one validated `LossInputs` batch.

Below both the host loop and the environments: `rljax.envs` builds `Group`s of `Trajectory`s and
`rljax.loop` turns them into batches, and neither imports the other's producer to get these types.

Rows are padded to a few length buckets (powers of two from 32) so the update step compiles once per
bucket (the models also take packed rows through segment ids; the loop pads). Per-token fields follow the
target-position convention of `rljax.types`: the log-prob of completion token j sits at position
`len(prompt) + j - 1`, where the model reads the token before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rljax.types import LossInputs, validate_loss_inputs

MIN_BUCKET = 32


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One sampled sequence as the trainer needs it (host side, python lists).

    `completion_mask[j]` is 1 where completion token j was sampled by the policy and 0 where it was
    inserted (a tool's output in multi-turn rollouts); `logprobs[j]` is the engine's log-prob of token j
    (ignored where the mask is 0).
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    reward: float
    group_id: int
    policy_version: int
    truncated: bool = False
    completion_mask: Sequence[int] | None = None

    def __post_init__(self):
        n = len(self.completion_ids)
        if len(self.logprobs) != n:
            raise ValueError(
                f"Trajectory.logprobs has {len(self.logprobs)} entries for {n} completion tokens"
            )
        if self.completion_mask is not None and len(self.completion_mask) != n:
            raise ValueError(
                f"Trajectory.completion_mask has {len(self.completion_mask)} entries for {n} tokens"
            )
        if not self.prompt_ids:
            raise ValueError("Trajectory.prompt_ids is empty: a completion needs at least one prompt token")


@dataclasses.dataclass
class Group:
    """The `group_size` samples of one prompt, scored: `per_fn[name]` f32[group_size] per reward fn."""

    example: dict
    trajectories: list[Trajectory]
    per_fn: dict[str, np.ndarray]

    @property
    def rewards(self) -> np.ndarray:
        """f32[group_size]: each trajectory's total reward."""
        return np.asarray([t.reward for t in self.trajectories], np.float32)


def bucket_length(n: int, max_len: int | None = None) -> int:
    """Smallest power of two >= n (and >= MIN_BUCKET), capped at `max_len` when given."""
    length = MIN_BUCKET
    while length < n:
        length *= 2
    return min(length, max_len) if max_len else length


def _token_rows(traj: Trajectory) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens i32[L], mask f32[L-1], logp f32[L-1]) for one trajectory, in target positions."""
    tokens = np.asarray(list(traj.prompt_ids) + list(traj.completion_ids), np.int32)
    p, n = len(traj.prompt_ids), len(traj.completion_ids)
    mask = np.zeros(len(tokens) - 1, np.float32)
    logp = np.zeros(len(tokens) - 1, np.float32)
    sampled = (
        np.ones(n, np.float32)
        if traj.completion_mask is None
        else np.asarray(traj.completion_mask, np.float32)
    )
    mask[p - 1 : p - 1 + n] = sampled
    logp[p - 1 : p - 1 + n] = np.asarray(traj.logprobs, np.float32) * sampled
    return tokens, mask, logp


def _empty(rows: int, length: int) -> dict[str, np.ndarray]:
    ints = ("input_ids", "target_ids", "positions", "segment_ids")
    out = {k: np.zeros((rows, length), np.int32) for k in ints}
    out.update({k: np.zeros((rows, length), np.float32) for k in ("loss_mask", "behavior_logp")})
    return out


def _place(arrays: dict, row: int, traj: Trajectory) -> None:
    tokens, mask, logp = _token_rows(traj)
    n = len(tokens) - 1
    sl = slice(0, n)
    arrays["input_ids"][row, sl] = tokens[:-1]
    arrays["target_ids"][row, sl] = tokens[1:]
    arrays["positions"][row, sl] = np.arange(n)
    arrays["segment_ids"][row, sl] = 1
    arrays["loss_mask"][row, sl] = mask
    arrays["behavior_logp"][row, sl] = logp


def build_loss_inputs(
    trajectories: Sequence[Trajectory],
    advantages: np.ndarray,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    max_len: int | None = None,
    vocab_size: int | None = None,
) -> LossInputs:
    """One row per trajectory, padded to a bucket length; validated before it is returned.

    Args:
      trajectories: B sampled sequences. advantages: f32[B] per-sequence advantages.
      max_len: the longest row allowed (prompt + completion - 1 tokens); longer ones raise.
    """
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    longest = max(len(t.prompt_ids) + len(t.completion_ids) - 1 for t in trajectories)
    if max_len is not None and longest > max_len:
        raise ValueError(f"a trajectory needs {longest} positions, more than max_len={max_len}")
    arrays = _empty(len(trajectories), bucket_length(longest, max_len))
    for row, traj in enumerate(trajectories):
        _place(arrays, row, traj)
    return _finish(arrays, trajectories, advantages, temperature, top_p, top_k, vocab_size)


def _finish(arrays, trajectories, advantages, temperature, top_p, top_k, vocab_size) -> LossInputs:
    batch = LossInputs(
        **arrays,
        advantages=np.asarray(advantages, np.float32),
        rewards=np.asarray([t.reward for t in trajectories], np.float32),
        group_ids=np.asarray([t.group_id for t in trajectories], np.int32),
        policy_version=np.asarray([t.policy_version for t in trajectories], np.int32),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
    )
    return validate_loss_inputs(batch, vocab_size=vocab_size)
