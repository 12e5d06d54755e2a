"""The log-prob head at the loss positions only (`LossInputs.head_positions`, set by prepare_batch): the
positions each row gets, and the same log-probs, loss, metrics and gradients as the head over every
position, on 1 and 8 devices, with no extra collective under a sharded jit."""

import jax
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import trainer
from rljax.trainer import packing
from rljax.trainer.logprobs import make_logprob_fn
from rljax.trainer.step import make_grad_fn


@pytest.fixture(scope="module")
def ref():
    return C.reference_run()


def test_each_row_gets_its_loss_positions_in_order_padded_with_the_row_length():
    mask = np.zeros((3, 16), np.float32)
    mask[0, 3:7] = 1  # 4 positions
    mask[1, [1, 9, 10]] = 1  # 3, not contiguous
    where = packing.head_positions(mask)
    assert where.dtype == np.int32 and where.shape == (3, 4)  # K: 4 rounded up to a multiple of 16 / 8
    np.testing.assert_array_equal(where[0], [3, 4, 5, 6])
    np.testing.assert_array_equal(where[1], [1, 9, 10, 16])
    np.testing.assert_array_equal(where[2], [16, 16, 16, 16])  # no loss token: all padding
    mask[2, 1:6] = 1  # 5 positions: K rounds up to 6
    assert packing.head_positions(mask).shape == (3, 6)
    mask[2, 1:16] = 1  # 15 of 16: K would be 16, the whole row
    assert packing.head_positions(mask) is None


def test_prepare_batch_sets_them_and_reports_the_head_fraction(ref):
    batch, metrics = trainer.prepare_batch(ref.cfg, ref.batch.inputs, ref.mesh)
    mask = np.asarray(ref.batch.inputs.loss_mask)
    expected = packing.head_positions(mask)
    assert expected is not None  # the reference batch has prompt positions to skip
    np.testing.assert_array_equal(np.asarray(batch.head_positions), expected)
    assert metrics["batch/head_fraction"] == expected.shape[1] / mask.shape[1] < 1


def with_positions(batch):
    where = packing.head_positions(np.asarray(batch.inputs.loss_mask))
    return batch.replace(inputs=batch.inputs.replace(head_positions=where))


def test_logprobs_equal_the_whole_head_on_the_loss_positions_and_are_zero_elsewhere(ref):
    fn = make_logprob_fn(ref.cfg, ref.model_config, ref.mesh)
    state = trainer.init_train_state(ref.cfg, ref.model_config, ref.params, ref.mesh)
    batch = with_positions(ref.batch).inputs
    logp, entropy = (np.asarray(x) for x in fn(state.params, trainer.shard_batch(batch, ref.mesh)))
    whole_batch = trainer.shard_batch(ref.batch.inputs, ref.mesh)
    whole, whole_entropy = (np.asarray(x) for x in fn(state.params, whole_batch))
    on = np.asarray(batch.loss_mask) > 0
    np.testing.assert_allclose(logp[on], whole[on], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(entropy[on], whole_entropy[on], rtol=1e-6, atol=1e-6)
    assert not logp[~on].any() and not entropy[~on].any()
    assert np.abs(whole[~on]).max() > 0.1  # the whole head computes there: the zeros are the change


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 4, 1)], ids=["1dev", "8dev-data2-fsdp4"])
def test_gradients_and_metrics_equal_the_whole_head(ref, shape):
    mesh = C.mesh_of(jax.devices(), *shape)
    state = trainer.init_train_state(ref.cfg, ref.model_config, ref.params, mesh)
    grad_fn = make_grad_fn(ref.cfg, ref.model_config, mesh)
    g_all, m_all = C.to_host(grad_fn(state.params, trainer.shard_batch(ref.batch, mesh)))
    g_head, m_head = C.to_host(grad_fn(state.params, trainer.shard_batch(with_positions(ref.batch), mesh)))
    for key, value in m_all.items():
        np.testing.assert_allclose(m_head[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    assert C.max_rel_diff(g_head, g_all) <= 1e-5


def test_the_gather_adds_no_collective_under_fsdp(ref):
    mesh = C.mesh_of(jax.devices(), 1, 8, 1)
    state = trainer.init_train_state(ref.cfg, ref.model_config, ref.params, mesh)
    grad_fn = make_grad_fn(ref.cfg, ref.model_config, mesh)

    def collectives(batch):
        hlo = grad_fn.lower(state.params, trainer.shard_batch(batch, mesh)).compile().as_text()
        return {op: hlo.count(op + "(") for op in ("all-gather", "all-to-all", "collective-permute")}

    assert collectives(with_positions(ref.batch)) == collectives(ref.batch)
