"""Old, reference and value passes: micro-batched over the train step's micro-batches, equal to the
whole-batch pass, sharded like a batch, with compiled temporaries that do not grow with the rollout batch.

The memory checks compile from shapes alone (`jax.ShapeDtypeStruct` inputs on 8 simulated devices,
nothing allocated) and read `compiled.memory_analysis()`.
"""

import jax
import jax.numpy as jnp
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import models
from rljax.trainer import init_critic_params, make_logprob_fn, shard_batch
from rljax.trainer.logprobs import pass_micro_batches
from rljax.trainer.ppo import make_values_fn
from rljax.trainer.state import (
    abstract_critic,
    batch_sharding,
    critic_shardings,
    param_shardings,
    put_global,
    resolve_model_config,
)
from rljax.types import LossInputs

MODEL = models.ModelConfig(
    family="qwen2",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
ROWS, MICRO = 32, 8


def config(micro: int, minibatches: int = 1):
    # The layers scanned, as in the deep models this 2-layer one stands in for (auto would unroll it, and
    # the compiler's buffer reuse across straight-line layers blurs the temporaries' growth measured here).
    return C.base_config(
        trainer__micro_batch_size=micro, trainer__minibatches=minibatches, model__unroll_layers=1
    )


@pytest.fixture(scope="module")
def setup():
    """(mesh data=2 x fsdp=2 x tensor=2, sharded params, critic with a non-zero head, sharded batch)."""
    mesh = C.mesh_of(jax.devices(), 2, 2, 2)
    resolved = resolve_model_config(config(0), MODEL)
    params = jax.device_get(models.init_params(resolved, jax.random.key(0), std=0.2))
    critic = init_critic_params(MODEL, params)
    # Values of order 1, so that 1e-6 absolute is a tight bound (the head's f32 dot over another batch
    # shape may round differently in the last bit).
    head = np.random.default_rng(1).normal(size=MODEL.hidden_size).astype(np.float32)
    critic["value_head"]["kernel"] = 0.05 * head
    batch = shard_batch(C.loss_inputs(2, MODEL.vocab_size, rows=ROWS), mesh)
    params = put_global(params, param_shardings(resolved, mesh))
    critic = put_global(critic, critic_shardings(resolved, mesh))
    return mesh, params, critic, batch


def test_pass_micro_batches_follow_the_train_step_micro_batch():
    assert pass_micro_batches(config(8), rows=32, data_parallel=8) == 4
    assert pass_micro_batches(config(0, minibatches=2), rows=32, data_parallel=8) == 2  # the minibatch
    assert pass_micro_batches(config(0), rows=32, data_parallel=8) == 1  # whole
    assert pass_micro_batches(config(8), rows=8, data_parallel=8) == 1  # the canary: one row per device
    assert pass_micro_batches(config(8), rows=2, data_parallel=8) == 1
    # 24 rows on 4 devices (6 each) in micro-batches of at most 4 rows: 6 divides into 2 or 3 -> 3 x 8
    # rows is too big, 6 x 4 rows fits.
    assert pass_micro_batches(config(4), rows=24, data_parallel=4) == 6


def test_micro_batched_logprobs_equal_the_whole_batch(setup):
    mesh, params, _, batch = setup
    whole = make_logprob_fn(config(0), MODEL, mesh)
    micro = make_logprob_fn(config(MICRO), MODEL, mesh)
    loops = lambda fn: fn.lower(params, batch).as_text().count("stablehlo.while")  # noqa: E731
    assert loops(micro) == loops(whole) + 1  # one loop over the micro-batches around the layer scan
    want, got = whole(params, batch), micro(params, batch)
    for w, g in zip(want, got, strict=True):
        assert g.sharding.is_equivalent_to(batch_sharding(mesh), 2)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)
    on_mask = np.asarray(want[0])[np.asarray(batch.loss_mask) > 0]
    assert on_mask.std() > 0.1  # far from uniform (-log V everywhere), so the comparison means something


def test_micro_batched_values_equal_the_whole_batch(setup):
    mesh, _, critic, batch = setup
    want = make_values_fn(config(0), MODEL, mesh)(critic, batch)
    got = make_values_fn(config(MICRO), MODEL, mesh)(critic, batch)
    assert got.sharding.is_equivalent_to(batch_sharding(mesh), 2)
    assert np.abs(np.asarray(want)).max() > 0.1  # the head is non-zero
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def abstract_tree(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def abstract_batch(mesh, rows: int, length: int = 128) -> LossInputs:
    s = batch_sharding(mesh)
    tok = lambda dt: jax.ShapeDtypeStruct((rows, length), dt, sharding=s)  # noqa: E731
    seq = lambda dt: jax.ShapeDtypeStruct((rows,), dt, sharding=s)  # noqa: E731
    return LossInputs(
        *(tok(jnp.int32) for _ in range(4)), tok(jnp.float32), tok(jnp.float32),
        seq(jnp.float32), seq(jnp.float32), seq(jnp.int32), seq(jnp.int32),
    )  # fmt: skip


def temp_bytes(fn, abstract_params, mesh, rows: int) -> int:
    compiled = fn.lower(abstract_params, abstract_batch(mesh, rows)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("which", ["logprobs", "values"])
def test_pass_temporaries_stay_flat_as_the_rollout_batch_grows(which):
    mesh = C.mesh_of(jax.devices(), 1, 8, 1)
    resolved = resolve_model_config(config(0), MODEL)
    if which == "logprobs":
        make = make_logprob_fn
        params = abstract_tree(models.abstract_params(resolved), param_shardings(resolved, mesh))
    else:
        make = make_values_fn
        params = abstract_tree(abstract_critic(resolved), critic_shardings(resolved, mesh))
    micro = make(config(MICRO), MODEL, mesh)
    chunked = [temp_bytes(micro, params, mesh, rows) for rows in (2 * MICRO, 4 * MICRO)]
    assert chunked[1] <= 1.3 * chunked[0], chunked  # 2 -> 4 micro-batches: flat
    whole = make(config(0), MODEL, mesh)
    unchunked = [temp_bytes(whole, params, mesh, rows) for rows in (2 * MICRO, 4 * MICRO)]
    assert unchunked[1] >= 1.8 * unchunked[0], unchunked  # the whole-batch pass grows with the rows
    assert unchunked[1] >= 3 * chunked[1], (chunked, unchunked)
