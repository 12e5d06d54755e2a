"""Sequence packing (host side): the plan, the packed layout, balance over ranks, padding accounting."""

import mp_trainer_common as C
import numpy as np
import pytest

from rljax.config import Config
from rljax.trainer import packing
from rljax.trajectory import Trajectory, build_loss_inputs
from rljax.types import BatchError, validate_loss_inputs


def make_batch(lengths, seed=0):
    """One row per trajectory; trajectory i has a 3-token prompt and lengths[i] - 2 completion tokens
    (so its row has lengths[i] real positions)."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i, n in enumerate(lengths):
        completion = rng.integers(1, 50, n - 2).tolist()
        logp = (-rng.random(n - 2)).tolist()
        trajs.append(
            Trajectory([7, 8, 9], completion, logp, reward=float(i), group_id=i // 2, policy_version=i)
        )
    adv = np.arange(len(lengths), dtype=np.float32) - 1.5
    return build_loss_inputs(trajs, adv, temperature=1.0)


def test_first_fit_decreasing_by_hand():
    # longest first: 7 -> bin0 (room 3), 5 -> bin1 (room 5), 4 -> bin1 (room 1), 3 -> bin0 (room 0), 1 -> bin1
    assert packing.first_fit_decreasing([3, 7, 1, 5, 4], 10) == [[1, 0], [3, 4, 2]]


def test_plan_rounds_rows_and_balances_ranks():
    lengths = [30, 30, 30, 30, 10, 10, 10, 10, 5]
    plan = packing.plan_packing(lengths, row_len=32, num_ranks=2, rows_multiple=4)
    assert len(plan.rows) % 4 == 0
    assert sorted(i for row in plan.rows for i in row) == list(range(len(lengths)))  # each sequence once
    assert all(sum(lengths[i] for i in row) <= 32 for row in plan.rows)
    half = len(plan.rows) // 2
    tokens = [sum(lengths[i] for row in plan.rows[k * half : (k + 1) * half] for i in row) for k in (0, 1)]
    # Bins (first-fit decreasing): 30, 30, 30, 30, [10 10 10] = 30, [10 5] = 15, and 2 empty rows. With 4 rows
    # per rank the best split is 90 / 75, which the longest-processing-time deal finds.
    assert sorted(tokens) == [75, 90], tokens


def test_too_long_sequence_names_the_field():
    with pytest.raises(ValueError, match="trainer.tokens_per_micro_batch=16"):
        packing.plan_packing([10, 17], row_len=16)


def test_packed_rows_hold_the_same_tokens_per_sequence():
    batch = make_batch([12, 9, 20, 5, 7, 15])
    plan = packing.plan_packing(packing.sequence_lengths(batch), row_len=32, num_ranks=2, rows_multiple=2)
    packed = packing.pack_loss_inputs(batch, plan)
    assert packed.input_ids.shape == (len(plan.rows), 32)
    for r, members in enumerate(plan.rows):
        for seg, b in enumerate(members, start=1):
            here = packed.segment_ids[r] == seg
            keep = batch.segment_ids[b] > 0
            for name in ("input_ids", "target_ids", "positions", "loss_mask", "behavior_logp"):
                np.testing.assert_array_equal(getattr(packed, name)[r][here], getattr(batch, name)[b][keep])
            for name in ("advantages", "rewards", "group_ids", "policy_version"):
                assert (getattr(packed, name)[r][here] == getattr(batch, name)[b]).all()
            assert packed.positions[r][here][0] == 0  # each sequence's positions restart
    assert (packed.advantages[packed.segment_ids == 0] == 0).all()
    assert packing.padding_fraction(packed) < packing.padding_fraction(batch)


def test_pad_fraction_and_imbalance_by_hand():
    batch = make_batch([16, 16, 8, 8])  # 48 real positions
    assert batch.input_ids.shape == (4, 32)
    assert packing.padding_fraction(batch) == pytest.approx(1 - 48 / 128)
    plan = packing.plan_packing(packing.sequence_lengths(batch), row_len=24, num_ranks=2, rows_multiple=2)
    packed = packing.pack_loss_inputs(batch, plan)
    assert packed.input_ids.shape == (2, 24)  # [16, 8] and [16, 8]: no padding at all
    assert packing.padding_fraction(packed) == 0.0
    assert packing.rank_token_imbalance(packed, 2) == 1.0


def test_packed_validation_rejects_an_empty_segment_and_allows_empty_rows():
    batch = make_batch([10, 10, 10])
    plan = packing.plan_packing(packing.sequence_lengths(batch), row_len=20, rows_multiple=4)
    packed = packing.pack_loss_inputs(batch, plan)
    assert (packed.segment_ids[-1] == 0).all()  # 2 rows of sequences + 2 empty rows
    validate_loss_inputs(packed)
    mask = np.array(packed.loss_mask)
    mask[packed.segment_ids == 2] = 0.0
    with pytest.raises(BatchError, match="a packed sequence has no loss tokens"):
        validate_loss_inputs(packed.replace(loss_mask=mask))


def test_rows_grow_for_a_sequence_longer_than_the_budget():
    assert packing.packed_row_length(64, 40) == 64
    assert packing.packed_row_length(64, 167) == 256
    batch = make_batch([12, 100, 9])
    cfg = C.with_fields(Config(), trainer__tokens_per_micro_batch=64)
    packed, metrics = packing.layout_batch(cfg, batch, 1)
    assert packed.input_ids.shape[1] == 128 and metrics["batch/row_length"] == 128.0
    assert sorted(packing.sequence_lengths(batch)) == [9, 12, 100]
    assert int((packed.segment_ids > 0).sum()) == 121  # every token kept, nothing split
