"""Packed batches train exactly like unpacked ones: loss, metrics and gradients of every aggregation, the
sequence-level IS levels and GSPO, on 1 and 8 devices; and the update's layout metrics."""

import jax
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import algos, trainer
from rljax.trainer import packing
from rljax.trainer.batch import TrainBatch
from rljax.trainer.step import make_grad_fn

ROW_LEN = 64  # the reference batch's rows hold 5..32 real positions: 2-6 sequences per packed row


@pytest.fixture(scope="module")
def ref():
    return C.reference_run()


def packed_train_batch(batch: TrainBatch, data_parallel: int) -> TrainBatch:
    """The reference TrainBatch (host) in the packed layout, old/ref log-probs carried along."""
    lengths = packing.sequence_lengths(batch.inputs)
    plan = packing.plan_packing(
        lengths, row_len=ROW_LEN, num_ranks=data_parallel, rows_multiple=data_parallel
    )
    inputs = packing.pack_loss_inputs(batch.inputs, plan)
    extra = packing.pack_token_arrays(
        {"old_logp": batch.old_logp, "ref_logp": batch.ref_logp}, batch.inputs.segment_ids, plan
    )
    assert inputs.input_ids.shape[0] < batch.inputs.input_ids.shape[0]  # it really packs
    return TrainBatch(
        inputs=inputs,
        old_logp=extra["old_logp"],
        advantages=inputs.advantages,
        **{"ref_logp": extra["ref_logp"]},
    )


def grads_and_metrics(cfg, ref, batch, mesh):
    state = trainer.init_train_state(cfg, ref.model_config, ref.params, mesh)
    grads, metrics = make_grad_fn(cfg, ref.model_config, mesh)(state.params, trainer.shard_batch(batch, mesh))
    return C.to_host(grads), C.to_host(metrics)


CASES = [{"algo__aggregation": name} for name in algos.LOSS_AGGREGATIONS.names()] + [
    {"algo__is_level": "sequence", "algo__aggregation": "seq_mean_token_mean"},
    {"algo__is_level": "geometric", "algo__aggregation": "seq_mean_token_mean"},
    {"algo__policy_loss": "gspo", "algo__clip_low": 3e-4, "algo__clip_high": 4e-4},
]


@pytest.mark.parametrize("changes", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_packed_equals_unpacked(ref, changes):
    mesh = C.mesh_of(jax.devices(), 1, 1, 1)
    unpacked_cfg = C.with_fields(ref.cfg, **changes)
    packed_cfg = C.with_fields(unpacked_cfg, trainer__tokens_per_micro_batch=ROW_LEN)
    g_u, m_u = grads_and_metrics(unpacked_cfg, ref, ref.batch, mesh)
    g_p, m_p = grads_and_metrics(packed_cfg, ref, packed_train_batch(ref.batch, 1), mesh)
    for key in ("loss/total", "loss/policy", "loss/kl", "loss/entropy"):
        np.testing.assert_allclose(m_p[key], m_u[key], rtol=1e-6, atol=1e-8, err_msg=key)
    for key, value in m_u.items():
        np.testing.assert_allclose(m_p[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    # Gradients sum the same per-token terms in another order (other rows, other attention lengths):
    # float32 rounding of the sums, not a different objective.
    assert C.max_rel_diff(g_p, g_u) <= 2e-6


def test_packed_on_eight_devices_micro_batched_equals_unpacked(ref):
    mesh = C.mesh_of(jax.devices(), 1, 8, 1)
    cfg = C.with_fields(ref.cfg, algo__aggregation="seq_mean_token_mean")
    packed_cfg = C.with_fields(cfg, trainer__tokens_per_micro_batch=ROW_LEN)
    batch = packed_train_batch(ref.batch, 8)
    rows = batch.inputs.input_ids.shape[0]
    assert rows % 8 == 0 and rows >= 8
    g_u, m_u = grads_and_metrics(cfg, ref, ref.batch, C.mesh_of(jax.devices(), 1, 1, 1))
    g_p, m_p = grads_and_metrics(packed_cfg, ref, batch, mesh)
    np.testing.assert_allclose(m_p["loss/total"], m_u["loss/total"], rtol=1e-6)
    assert C.max_rel_diff(g_p, g_u) <= 1e-5  # 8-way sharded reductions on top of the packed order


def test_update_on_the_prepared_batch_reports_padding(ref):
    mesh = C.mesh_of(jax.devices(), 1, 2, 1)
    cfg = C.with_fields(ref.cfg, trainer__tokens_per_micro_batch=ROW_LEN)
    inputs = ref.batch.inputs
    sharded, layout = trainer.prepare_batch(cfg, inputs, mesh)
    real = float((np.asarray(inputs.segment_ids) > 0).sum())
    rows = sharded.input_ids.shape[0]
    assert layout["batch/rows"] == rows and rows % 2 == 0
    assert layout["batch/pad_fraction"] == pytest.approx(1 - real / (rows * ROW_LEN))
    _, unpacked = trainer.layout_batch(ref.cfg, inputs, 2)
    assert unpacked["batch/pad_fraction"] == pytest.approx(1 - real / inputs.input_ids.size)
    assert layout["batch/pad_fraction"] < unpacked["batch/pad_fraction"]
    state = trainer.init_train_state(cfg, ref.model_config, ref.params, mesh)
    new_state, metrics = trainer.make_update(cfg, ref.model_config, mesh)(state, sharded, ref.params)
    assert np.isfinite(metrics["loss/total"]) and int(new_state.step) == 1
