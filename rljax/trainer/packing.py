"""Sequence packing: a batch of one-sequence rows -> rows of a fixed token budget, balanced over ranks.

The loop hands the trainer the loss-input contract (`LossInputs`, one sampled sequence per row, padded on
the host). With `trainer.tokens_per_micro_batch = N > 0` the trainer repacks it before it goes to the
devices: whole sequences are placed first-fit-decreasing into rows of exactly N tokens, each with its
own segment id (1, 2, ... within the row; 0 is padding) and positions restarting at 0, so attention,
RoPE and every loss reduction stay per sequence. With `trainer.share_prompts` the sequences of a batch
that start with the same prompt (a GRPO group) store it once per packed row: each completion keeps its
own segment and positions and also attends to the prompt's segment (`shared_prompt_units`,
`layers.attention_mask`), so every log-prob and the loss are those of the unshared batch, and a
group of G completions costs one prompt instead of G (the idea of Liu et al. 2025, "Prefix Grouper",
arXiv:2506.05433, here as a packing layout and a mask rule instead of a split attention). A micro-batch
is then up to `trainer.packed_rows_per_micro_batch` packed rows per data-parallel device (default 1: the
activations of N tokens per device, whatever the rollout lengths; see `trainer.step.num_micro_batches`).

Per-sequence fields (advantages, rewards, group ids, policy versions) become per-token `[R, N]` arrays
holding their sequence's value (0 on padding); the aggregations and sequence-level ratios reduce over
segments (`rljax.algos` take `segment_ids`), so a packed batch gives the same loss as the unpacked one.

Rows are dealt to the data-parallel ranks so each rank holds about the same number of real tokens, and
their count is rounded up (with empty rows) to a multiple of ranks x minibatches, the layout
`trainer.accumulate.split_micro_batches` expects: device d's contiguous block holds its rows of each
micro-batch.

Host-side numpy only; deterministic (the same batch packs the same way on every process).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from rljax.config import Config
from rljax.trainer.state import BATCH_AXES, shard_batch
from rljax.types import BRANCH_SHIFT, SEQUENCE_FIELDS, TOKEN_FIELDS, LossInputs, validate_loss_inputs

MAX_BRANCHES = (1 << (31 - BRANCH_SHIFT)) - 1  # completions per shared prompt: their ids fit int32


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """Which source rows go where. `rows[r]` lists the source rows packed, in order, into packed row r
    (an empty tuple is a padding row); `row_len` is the packed row length N.

    Shared prompts (`units` given to `plan_packing`): `shared[b]` is the length of the prompt source row b
    shares with the other members of its unit (0: not shared), `skip[b]` the tokens of row b not copied
    because an earlier member of its unit, in the same packed row, holds them (0 for a unit's first
    member, which carries the prompt)."""

    rows: tuple[tuple[int, ...], ...]
    row_len: int
    shared: tuple[int, ...]
    skip: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Unit:
    """Source rows packed together: `members` share their first `prompt` positions (0: one sequence,
    nothing shared). Its length in a packed row: `prompt + sum(length - prompt)`."""

    members: tuple[int, ...]
    prompt: int = 0

    def length(self, lengths: Sequence[int]) -> int:
        return self.prompt + sum(int(lengths[b]) - self.prompt for b in self.members)


def shared_prompt_units(input_ids: np.ndarray, loss_mask: np.ndarray, lengths: Sequence[int], row_len: int):
    """Units of the one-sequence rows of a batch that start with the same prompt (`trainer.share_prompts`).

    A row's prompt is its positions before the first loss position: the last prompt token stays with
    each completion (its position predicts the completion's first token, a different target per row),
    so every position keeps one target and one log-prob. Rows with the same prompt tokens form a unit,
    in order of first appearance; a unit longer than `row_len` is split into several (each repeats the
    prompt). A row whose prompt no other row shares is a unit of its own (prompt 0).
    """
    first_loss = np.argmax(np.asarray(loss_mask) > 0, axis=1)  # validated: every row has a loss token
    ids = np.asarray(input_ids)
    groups: dict[tuple[int, bytes], list[int]] = {}
    for b, f in enumerate(first_loss.tolist()):
        groups.setdefault((f, ids[b, :f].tobytes()), []).append(b)
    units: list[Unit] = []
    for (prompt, _), members in groups.items():
        if len(members) == 1 or prompt == 0:
            units += [Unit((b,)) for b in members]
            continue
        current: list[int] = []
        size = prompt
        for b in members:
            extra = int(lengths[b]) - prompt
            if current and (size + extra > row_len or len(current) == MAX_BRANCHES):
                units.append(Unit(tuple(current), prompt if len(current) > 1 else 0))
                current, size = [], prompt
            current.append(b)
            size += extra
        units.append(Unit(tuple(current), prompt if len(current) > 1 else 0))
    return units


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Bins of source indices whose lengths sum to <= row_len: longest first, each into the first bin
    with room (ties broken by index, so the result is deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(row_len - n)
    return bins


def balance_over_ranks(bins: list[list[int]], fills: list[int], num_ranks: int) -> list[list[int]]:
    """Bins (count a multiple of num_ranks) dealt to ranks, each rank the same number of bins and about
    the same number of tokens: fullest bin first, to the rank with the fewest tokens that has room
    (longest-processing-time rule). Returns the bins in rank order (rank r's are a contiguous block)."""
    per_rank = len(bins) // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for b in sorted(range(len(bins)), key=lambda b: (-fills[b], b)):
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < per_rank]
        r = min(open_ranks, key=lambda r: (tokens[r], r))
        ranks[r].append(b)
        tokens[r] += fills[b]
    return [bins[b] for rank in ranks for b in rank]


def plan_packing(
    lengths: Sequence[int],
    *,
    row_len: int,
    num_ranks: int = 1,
    rows_multiple: int = 1,
    units: Sequence[Unit] | None = None,
) -> PackingPlan:
    """PackingPlan for sequences of `lengths` tokens into rows of `row_len`, the row count rounded up to
    a multiple of `rows_multiple` (itself a multiple of `num_ranks`) with empty rows, balanced over ranks.
    `units` (`shared_prompt_units`): sequences packed together with their prompt stored once; default one
    unit per sequence.

    Raises ValueError for a sequence longer than a row (it could only be split, which would change its
    attention and its per-sequence loss; `layout_batch` sizes rows with `packed_row_length` first).
    """
    if units is not None:
        return _plan_units(lengths, units, row_len=row_len, num_ranks=num_ranks, rows_multiple=rows_multiple)
    if rows_multiple % num_ranks:
        raise ValueError(f"rows_multiple={rows_multiple} is not a multiple of num_ranks={num_ranks}")
    too_long = [int(n) for n in lengths if n > row_len]
    if too_long:
        raise ValueError(
            f"a sequence of {max(too_long)} tokens does not fit a packed row of "
            f"trainer.tokens_per_micro_batch={row_len}; raise it to at least the longest sequence "
            "(prompt + rollout.max_tokens)"
        )
    bins = first_fit_decreasing(lengths, row_len)
    bins += [[] for _ in range(-len(bins) % rows_multiple)]
    fills = [sum(int(lengths[i]) for i in b) for b in bins]
    ordered = balance_over_ranks(bins, fills, num_ranks)
    none = (0,) * len(lengths)
    return PackingPlan(rows=tuple(tuple(b) for b in ordered), row_len=row_len, shared=none, skip=none)


def _plan_units(lengths, units, *, row_len, num_ranks, rows_multiple) -> PackingPlan:
    """`plan_packing` of whole units (first-fit-decreasing on their lengths)."""
    unit_lengths = [u.length(lengths) for u in units]
    base = plan_packing(unit_lengths, row_len=row_len, num_ranks=num_ranks, rows_multiple=rows_multiple)
    shared, skip = [0] * len(lengths), [0] * len(lengths)
    for u in units:
        for i, b in enumerate(u.members):
            shared[b], skip[b] = u.prompt, u.prompt if i else 0
    rows = tuple(tuple(b for u in row for b in units[u].members) for row in base.rows)
    return PackingPlan(rows=rows, row_len=row_len, shared=tuple(shared), skip=tuple(skip))


def sequence_lengths(batch: LossInputs) -> np.ndarray:
    """i32[B]: the real (non-padding) positions of each one-sequence row."""
    return (np.asarray(batch.segment_ids) > 0).sum(axis=1).astype(np.int32)


def pack_token_arrays(arrays: dict, segment_ids: np.ndarray, plan: PackingPlan) -> dict:
    """Per-token `[B,T]` arrays of a one-sequence-per-row batch (real positions: `segment_ids > 0`)
    -> the same arrays in the packed layout `[R, N]` of `plan` (0 on padding)."""
    real = np.asarray(segment_ids) > 0
    shape = (len(plan.rows), plan.row_len)
    out = {name: np.zeros(shape, np.asarray(x).dtype) for name, x in arrays.items()}
    for r, members in enumerate(plan.rows):
        offset = 0
        for b in members:
            keep = np.flatnonzero(real[b])[plan.skip[b] :]
            n = len(keep)
            for name, x in arrays.items():
                out[name][r, offset : offset + n] = np.asarray(x)[b][keep]
            offset += n
    return out


def packed_segment_ids(plan: PackingPlan, lengths: Sequence[int]) -> np.ndarray:
    """i32[R, N]: 1, 2, ... for the sequences of each packed row, in order; 0 on padding. With shared
    prompts a unit's prompt gets the next id p and its completions `p | (k << BRANCH_SHIFT)`,
    k = 1, 2, ... (see `layers.attention_mask`)."""
    out = np.zeros((len(plan.rows), plan.row_len), np.int32)
    for r, members in enumerate(plan.rows):
        offset, seg, branch = 0, 0, 0
        for b in members:
            n, skip, shared = int(lengths[b]), plan.skip[b], plan.shared[b]
            if not skip:  # a new unit: a plain sequence, or a shared prompt and its first completion
                seg, branch = seg + 1, 0
                out[r, offset : offset + shared] = seg
                offset, n = offset + shared, n - shared
            if shared:
                branch += 1
                n -= skip
            if branch and seg >= 1 << BRANCH_SHIFT:
                raise ValueError(
                    f"{seg} sequences in a packed row: shared prompts take at most {(1 << BRANCH_SHIFT) - 1}"
                )
            out[r, offset : offset + n] = seg | (branch << BRANCH_SHIFT)
            offset += n
    return out


def pack_loss_inputs(batch: LossInputs, plan: PackingPlan) -> LossInputs:
    """The packed LossInputs `[R, N]` of a one-sequence-per-row batch (see the module docstring).

    Token fields are copied sequence by sequence (each keeps its positions, which start at 0; segment
    ids become 1, 2, ... per row); sequence fields become per-token `[R, N]`. The result is validated
    (packed form) before it is returned.
    """
    seg = np.asarray(batch.segment_ids)
    arrays = {name: np.asarray(getattr(batch, name)) for name in TOKEN_FIELDS}
    for name in SEQUENCE_FIELDS:
        per_row = np.asarray(getattr(batch, name))
        arrays[name] = np.broadcast_to(per_row[:, None], seg.shape)
    out = pack_token_arrays(arrays, seg, plan)
    out["segment_ids"] = packed_segment_ids(plan, sequence_lengths(batch))
    return validate_loss_inputs(dataclasses.replace(batch, **out))


def padding_fraction(batch: LossInputs) -> float:
    """Padded positions / positions processed (`batch/pad_fraction`) of a packed or unpacked batch."""
    seg = np.asarray(batch.segment_ids)
    return float(1.0 - (seg > 0).sum() / max(seg.size, 1))


def rank_token_imbalance(batch: LossInputs, num_ranks: int) -> float:
    """max / mean real tokens over the data-parallel ranks' contiguous row blocks (1.0 = balanced)."""
    seg = np.asarray(batch.segment_ids)
    per_rank = (seg > 0).reshape(num_ranks, -1).sum(axis=1).astype(np.float64)
    return float(per_rank.max() / max(per_rank.mean(), 1.0))


def packed_row_length(tokens_per_micro_batch: int, longest: int) -> int:
    """Row length of a packed batch: `trainer.tokens_per_micro_batch`, or for a batch whose longest
    sequence does not fit, the next power of two that holds it (a sequence is never split: that would
    change its attention and its per-sequence loss). Few distinct lengths, so few compiles."""
    row_len = tokens_per_micro_batch
    while row_len < longest:
        row_len *= 2
    return row_len


# The head's position count K is rounded up to a multiple of T / HEAD_STEPS: at most HEAD_STEPS compiled
# variants of the step per row length, at most T / HEAD_STEPS positions of wasted head work per row.
HEAD_STEPS = 8


def head_positions(loss_mask: np.ndarray) -> np.ndarray | None:
    """`LossInputs.head_positions` for a `loss_mask f32[B,T]`: i32[B,K], each row's loss positions in
    order, padded with T; K is the largest count of any row rounded up to a multiple of ceil(T /
    HEAD_STEPS). None when K would be T (the head runs everywhere anyway)."""
    t = loss_mask.shape[1]
    counts = (loss_mask > 0).sum(axis=1)
    step = -(-t // HEAD_STEPS)
    k = max(step, -(-int(counts.max(initial=0)) // step) * step)
    if k >= t:
        return None
    first = np.argsort(loss_mask <= 0, axis=1, kind="stable")[:, :k]  # mask positions first, in order
    return np.where(np.arange(k)[None, :] < counts[:, None], first, t).astype(np.int32)


def layout_batch(cfg: Config, batch: LossInputs, data_parallel: int) -> tuple[LossInputs, dict]:
    """The batch the devices train on, and its layout metrics: packed into rows of
    `trainer.tokens_per_micro_batch` tokens (grown by `packed_row_length` for a longer sequence; row
    count a multiple of data_parallel x trainer.minibatches) when that is > 0, else the batch as given.
    The head runs at the loss positions only (`head_positions`). Metrics: `batch/pad_fraction`,
    `batch/rows`, `batch/head_fraction`, and when packed `batch/rank_token_imbalance`,
    `batch/row_length` and `batch/shared_prompt_fraction` (tokens saved by `trainer.share_prompts`)."""
    n = cfg.trainer.tokens_per_micro_batch
    if n:
        lengths = sequence_lengths(batch)
        row_len = packed_row_length(n, int(lengths.max()))
        units = None
        if cfg.trainer.share_prompts:
            ids, mask = np.asarray(batch.input_ids), np.asarray(batch.loss_mask)
            units = shared_prompt_units(ids, mask, lengths, row_len)
        plan = plan_packing(
            lengths,
            row_len=row_len,
            num_ranks=data_parallel,
            rows_multiple=data_parallel * cfg.trainer.minibatches,
            units=units,
        )
        batch = pack_loss_inputs(batch, plan)
    batch = batch.replace(head_positions=head_positions(np.asarray(batch.loss_mask)))
    heads = batch.input_ids.shape[1] if batch.head_positions is None else batch.head_positions.shape[1]
    metrics = {"batch/pad_fraction": padding_fraction(batch), "batch/rows": float(batch.input_ids.shape[0])}
    metrics["batch/head_fraction"] = heads / batch.input_ids.shape[1]
    if n:
        metrics["batch/rank_token_imbalance"] = rank_token_imbalance(batch, data_parallel)
        metrics["batch/row_length"] = float(batch.input_ids.shape[1])
        metrics["batch/shared_prompt_fraction"] = (
            1.0 - (np.asarray(batch.segment_ids) > 0).sum() / lengths.sum()
        )
    return batch, metrics


def prepare_batch(cfg: Config, batch: LossInputs, mesh: Mesh) -> tuple[LossInputs, dict]:
    """`layout_batch` on the host, then the global sharded batch (`shard_batch`); every process packs the
    same (broadcast) batch the same way. Returns (sharded batch, layout metrics)."""
    data_parallel = math.prod(mesh.shape[a] for a in BATCH_AXES)
    laid_out, metrics = layout_batch(cfg, batch, data_parallel)
    return shard_batch(laid_out, mesh), metrics
