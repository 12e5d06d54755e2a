"""Optimizer and schedule from OptimConfig; optimizer-state shardings; the host-side skip check."""

import dataclasses

import jax
import jax.numpy as jnp
import mp_trainer_common as C
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rljax.config import OptimConfig
from rljax.trainer import NonFiniteError, check_nonfinite, make_optimizer, make_schedule
from rljax.trainer.optim import OPTIMIZERS, SCHEDULES
from rljax.trainer.state import opt_state_shardings


def test_cosine_schedule_with_warmup_golden_values():
    lr = make_schedule(OptimConfig(learning_rate=1e-3, schedule="cosine", warmup_steps=10), total_steps=110)
    # linear 0 -> 1e-3 over 10 steps, then 0.5 * (1 + cos(pi * (t - 10) / 100)) * 1e-3
    for t, want in [(0, 0.0), (5, 5e-4), (10, 1e-3), (60, 5e-4), (35, 0.5 * (1 + np.cos(np.pi / 4)) * 1e-3)]:
        assert float(lr(t)) == pytest.approx(want, abs=1e-9), t
    assert float(lr(110)) == pytest.approx(0.0, abs=1e-12)


def test_constant_schedule_with_and_without_warmup():
    lr = make_schedule(OptimConfig(learning_rate=2e-3, warmup_steps=4), total_steps=100)
    assert [float(lr(t)) for t in (0, 2, 4, 50)] == pytest.approx([0.0, 1e-3, 2e-3, 2e-3])
    assert float(make_schedule(OptimConfig(learning_rate=3e-4), 10)(0)) == pytest.approx(3e-4)


def test_global_norm_clipping_bounds_the_update():
    opt = make_optimizer(OptimConfig(name="sgd", learning_rate=1.0, max_grad_norm=1.0), 10)
    params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
    grads = {"w": jnp.full((3, 4), 2.0), "b": jnp.full(4, 2.0)}  # global norm 2 * 4 = 8
    updates, _ = opt.update(grads, opt.init(params), params)
    assert float(jnp.sqrt(sum(jnp.sum(u**2) for u in jax.tree.leaves(updates)))) == pytest.approx(1.0)
    np.testing.assert_allclose(updates["w"], -np.full((3, 4), 0.25), rtol=1e-6)
    unclipped = make_optimizer(OptimConfig(name="sgd", learning_rate=1.0, max_grad_norm=0.0), 10)
    updates, _ = unclipped.update(grads, unclipped.init(params), params)
    np.testing.assert_allclose(updates["w"], -2.0)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_weight_decay_skips_vectors(name):
    cfg = OptimConfig(name=name, learning_rate=0.1, weight_decay=0.5, max_grad_norm=0.0)
    opt = make_optimizer(cfg, 10)
    params = {"w": jnp.ones((2, 2)), "scale": jnp.ones(2)}
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, opt.init(params), params)
    # AdamW: -lr * wd * w (decoupled); SGD: -lr * (g + wd * w) with g = 0. Both: -0.05 on matrices only.
    np.testing.assert_allclose(updates["w"], -0.05, rtol=1e-6)
    np.testing.assert_array_equal(updates["scale"], 0.0)


def test_adamw_first_step_is_lr_times_sign():
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, max_grad_norm=0.0), 10)
    params = {"w": jnp.zeros((2, 3))}
    grads = {"w": jnp.array([[1.0, -2.0, 3.0], [-0.5, 0.25, 4.0]])}
    updates, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -1e-2 * np.sign(grads["w"]), rtol=1e-5)


def test_opt_state_follows_param_shardings():
    mesh = C.mesh_of(jax.devices(), 1, 4, 2)
    shardings = {
        "w": NamedSharding(mesh, PartitionSpec("fsdp", "tensor")),
        "b": NamedSharding(mesh, PartitionSpec()),
    }
    abstract = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32), "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
    opt = make_optimizer(OptimConfig(warmup_steps=2, max_grad_norm=1.0), 10)
    tree = opt_state_shardings(opt, abstract, shardings, mesh)
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    specs = [s.spec for s in leaves]
    assert specs.count(PartitionSpec("fsdp", "tensor")) == 2  # adam mu and nu of "w"
    assert all(s in (PartitionSpec("fsdp", "tensor"), PartitionSpec()) for s in specs)
    state = jax.jit(opt.init, out_shardings=tree)(jax.tree.map(lambda a: jnp.ones(a.shape), abstract))
    assert len(jax.tree.leaves(state)) == len(leaves)


def test_check_nonfinite_raises_at_k():
    check_nonfinite(2, 3)
    with pytest.raises(NonFiniteError, match="3 consecutive.*max_nonfinite_skips=3"):
        check_nonfinite(3, 3)


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_optimizer_moments_count_the_state_buffers(name):
    """`Optimizer.moments` (what preflight's memory formula multiplies the params by) is the number of
    parameter-shaped buffers the real optimizer state holds."""
    params = {"w": jax.ShapeDtypeStruct((3, 5), jnp.float32), "b": jax.ShapeDtypeStruct((5,), jnp.float32)}
    opt = make_optimizer(OptimConfig(name=name), 10)
    state = jax.eval_shape(opt.init, params)
    sizes = [int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state) if leaf.ndim]
    assert sum(sizes) == OPTIMIZERS.get(name).moments * (3 * 5 + 5)


def test_config_choices_are_the_registered_optimizers_and_schedules():
    fields = {f.name: f for f in dataclasses.fields(OptimConfig)}
    assert sorted(fields["name"].metadata["choices"]) == OPTIMIZERS.names()
    assert sorted(fields["schedule"].metadata["choices"]) == SCHEDULES.names()
