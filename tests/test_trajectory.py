"""Trajectory processing: alignment of tokens, masks and behaviour log-probs; validation errors."""

import numpy as np
import pytest

from rljax.trajectory import Trajectory, bucket_length, build_loss_inputs
from rljax.types import BatchError, validate_loss_inputs


def make(prompt, completion, logprobs, mask=None, version=0):
    return Trajectory(
        prompt, completion, logprobs, reward=1.0, group_id=0, policy_version=version, completion_mask=mask
    )


def test_alignment_by_hand():
    # prompt [5, 6, 7], completion [8, 9]: tokens 5 6 7 8 9; positions 0..3 predict 6 7 8 9.
    batch = build_loss_inputs([make([5, 6, 7], [8, 9], [-0.5, -0.25])], np.array([2.0]), temperature=1.0)
    assert batch.input_ids.shape == (1, 32)
    np.testing.assert_array_equal(batch.input_ids[0, :5], [5, 6, 7, 8, 0])
    np.testing.assert_array_equal(batch.target_ids[0, :5], [6, 7, 8, 9, 0])
    np.testing.assert_array_equal(batch.loss_mask[0, :5], [0, 0, 1, 1, 0])
    np.testing.assert_array_equal(batch.behavior_logp[0, :5], [0, 0, -0.5, -0.25, 0])
    np.testing.assert_array_equal(batch.segment_ids[0, :5], [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(batch.positions[0, :4], [0, 1, 2, 3])
    assert batch.advantages.tolist() == [2.0]


def test_tool_tokens_are_masked_out():
    traj = make([1, 2], [3, 4, 5, 6], [-1.0, -9.0, -9.0, -2.0], mask=[1, 0, 0, 1])
    batch = build_loss_inputs([traj], np.zeros(1), temperature=1.0)
    np.testing.assert_array_equal(batch.loss_mask[0, :5], [0, 1, 0, 0, 1])
    np.testing.assert_array_equal(batch.behavior_logp[0, :5], [0, -1.0, 0, 0, -2.0])


def test_bucket_lengths_are_few():
    assert [bucket_length(n) for n in (1, 32, 33, 64, 65, 200)] == [32, 32, 64, 64, 128, 256]
    assert bucket_length(200, max_len=160) == 160


def test_rows_share_one_bucket():
    trajs = [make([1, 2], [3] * 10, [-1.0] * 10), make([1] * 30, [3] * 5, [-1.0] * 5)]
    batch = build_loss_inputs(trajs, np.zeros(2), temperature=0.7)
    assert batch.input_ids.shape == (2, 64)
    assert batch.temperature == pytest.approx(0.7)


def test_positive_behavior_logp_is_rejected():
    with pytest.raises(BatchError, match="behavior_logp: log-prob > 0"):
        build_loss_inputs([make([1, 2], [3], [0.5])], np.zeros(1), temperature=1.0)


def test_all_masked_row_is_rejected():
    with pytest.raises(BatchError, match="loss_mask: a sequence row has no loss tokens"):
        build_loss_inputs([make([1, 2], [3], [-1.0], mask=[0])], np.zeros(1), temperature=1.0)


def test_misaligned_targets_are_rejected():
    batch = build_loss_inputs([make([1, 2], [3, 4], [-1.0, -1.0])], np.zeros(1), temperature=1.0)
    bad = batch.replace(target_ids=np.roll(batch.target_ids, 1, axis=1))
    with pytest.raises(BatchError, match="target_ids: misaligned"):
        validate_loss_inputs(bad)


def test_token_outside_vocab_is_rejected():
    with pytest.raises(BatchError, match="input_ids: token id outside"):
        build_loss_inputs([make([1, 600], [3], [-1.0])], np.zeros(1), temperature=1.0, vocab_size=512)


def test_bad_lengths_raise_early():
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 completion tokens"):
        make([1], [2, 3], [-1.0])
    with pytest.raises(ValueError, match="more than max_len"):
        build_loss_inputs([make([1] * 40, [2], [-1.0])], np.zeros(1), temperature=1.0, max_len=32)
