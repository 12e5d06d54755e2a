"""`trainer.packed_rows_per_micro_batch`: fewer, larger micro-batches of packed rows train exactly like one
row per device per micro-batch (same gradients, metrics and updated parameters), on 1 and 2 devices."""

import jax
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import trainer
from rljax.trainer.batch import TrainBatch
from rljax.trainer.step import make_grad_fn, num_micro_batches

ROW_LEN = 40  # the reference batch packs into 8 rows: micro-batches of 2 or 4 rows divide them


@pytest.fixture(scope="module")
def ref():
    return C.reference_run()


def prepared(cfg, ref, mesh):
    return trainer.prepare_batch(cfg, ref.batch.inputs, mesh)


def grads_and_metrics(cfg, ref, mesh):
    state = trainer.init_train_state(cfg, ref.model_config, ref.params, mesh)
    sharded, _ = prepared(cfg, ref, mesh)
    batch = TrainBatch(inputs=sharded, old_logp=None, advantages=sharded.advantages)
    grads, metrics = make_grad_fn(cfg, ref.model_config, mesh, on_policy=True)(state.params, batch)
    return C.to_host(grads), C.to_host(metrics)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("rows_per_micro", [0, 2])
def test_larger_micro_batches_equal_one_row_each(ref, devices, rows_per_micro):
    mesh = C.mesh_of(jax.devices()[:devices], 1, devices, 1)
    one = C.with_fields(ref.cfg, trainer__tokens_per_micro_batch=ROW_LEN, algo__beta=0.0)
    many = C.with_fields(one, trainer__packed_rows_per_micro_batch=rows_per_micro)
    rows = prepared(many, ref, mesh)[0].input_ids.shape[0]
    per_device, count = rows // devices, num_micro_batches(many, rows, devices)
    assert per_device % count == 0 and (rows_per_micro == 0 or per_device // count <= rows_per_micro)
    assert num_micro_batches(one, rows, devices) == per_device > count  # really fewer, larger steps
    g1, m1 = grads_and_metrics(one, ref, mesh)
    gm, mm = grads_and_metrics(many, ref, mesh)
    for key, value in m1.items():
        np.testing.assert_allclose(mm[key], value, rtol=1e-6, atol=1e-8, err_msg=key)
    # the same per-token terms, summed in another order (whole rows per micro-batch): float32 rounding
    assert C.max_rel_diff(gm, g1) <= 1e-6


@pytest.mark.parametrize(
    ("rows", "devices", "rows_per_micro", "expected"),
    [(9, 1, 2, 9), (10, 1, 2, 5), (10, 1, 4, 5), (8, 2, 3, 2), (12, 1, 4, 3), (12, 2, 0, 1), (7, 1, 1, 7)],
)
def test_micro_batch_count_divides_rows_without_padding(ref, rows, devices, rows_per_micro, expected):
    cfg = C.with_fields(
        ref.cfg, trainer__tokens_per_micro_batch=ROW_LEN, trainer__packed_rows_per_micro_batch=rows_per_micro
    )
    assert num_micro_batches(cfg, rows, devices) == expected


def test_update_with_whole_minibatch_micro_batch_matches(ref):
    mesh = C.mesh_of(jax.devices()[:1], 1, 1, 1)
    one = C.with_fields(ref.cfg, trainer__tokens_per_micro_batch=ROW_LEN, algo__beta=0.0)
    whole = C.with_fields(one, trainer__packed_rows_per_micro_batch=0)
    out = []
    for cfg in (one, whole):
        state = trainer.init_train_state(cfg, ref.model_config, ref.params, mesh)
        new_state, metrics = trainer.make_update(cfg, ref.model_config, mesh)(
            state, prepared(cfg, ref, mesh)[0]
        )
        out.append((C.to_host(new_state.params), metrics))
    np.testing.assert_allclose(out[1][1]["loss/total"], out[0][1]["loss/total"], rtol=1e-6)
    assert C.max_rel_diff(out[1][0], out[0][0]) <= 1e-6


def test_negative_rows_per_micro_batch_is_rejected(ref):
    from rljax.trainer.accumulate import micro_batch_rows

    cfg = C.with_fields(
        ref.cfg, trainer__tokens_per_micro_batch=ROW_LEN, trainer__packed_rows_per_micro_batch=-1
    )
    with pytest.raises(ValueError, match="packed_rows_per_micro_batch"):
        micro_batch_rows(cfg, 8, 1)
