"""LoRA training: only the adapter trains (the base unchanged bit for bit) and carries optimizer state,
the reference policy is the base, 8 simulated devices (fsdp 4 x tensor 2) equal one, and an orbax
checkpoint of a LoRA state restores exactly."""

import dataclasses

import jax
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import trainer
from rljax.checkpoint import Checkpointer, abstract_like
from rljax.config import Config
from rljax.models import lora
from rljax.models.config import LORA_TARGETS
from rljax.trainer.state import base_shardings, put_global, resolve_model_config
from rljax.trainer.update import make_update


def lora_cfg(**changes):
    return C.base_config(model__lora_rank=4, model__lora_alpha=8.0, optim__learning_rate=1e-2, **changes)


def setup(cfg, mesh):
    """(model config, state over the adapter, base params on the mesh, host copy of the base)."""
    _, model_config, params = C.tiny_model()
    resolved = resolve_model_config(cfg, model_config)
    adapter = lora.init_adapter(resolved, jax.random.key(0))
    state = trainer.init_train_state(cfg, model_config, adapter, mesh)
    base = put_global(params, base_shardings(resolved, mesh))
    return model_config, state, base, params


def test_config_default_targets_are_the_model_default():
    assert tuple(Config().model.lora_targets) == LORA_TARGETS


@pytest.mark.parametrize("epochs", [1, 2], ids=["on_policy", "separate_pass"])
def test_updates_train_the_adapter_only(epochs):
    cfg, mesh = lora_cfg(trainer__epochs=epochs), C.mesh_of(jax.devices(), 1, 1, 1)
    model_config, state, base, host_base = setup(cfg, mesh)
    adapter_shapes = {x.shape for x in jax.tree.leaves(state.params)}
    assert {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim} <= adapter_shapes
    start = C.to_host(state.params)
    update = make_update(cfg, model_config, mesh)
    inputs = trainer.shard_batch(C.loss_inputs(0, model_config.vocab_size), mesh)
    for _ in range(3):
        state, metrics = update(state, inputs, None, base)
    assert int(state.step) == 3 * epochs and metrics["optim/nonfinite"] == 0
    assert metrics["loss/kl"] > 0  # beta > 0: the reference is the base, and the policy left it
    for a, b in zip(jax.tree.leaves(C.to_host(base)), jax.tree.leaves(host_base), strict=True):
        np.testing.assert_array_equal(a, b)  # the frozen base, bit for bit
    assert C.max_rel_diff(C.to_host(state.params), start) > 1e-3
    q = C.to_host(state.params)["layers"]["q_proj"]
    assert np.abs(q["kernel_lora_b"]).max() > 0  # B left zero: the policy moved off the base


def test_eight_devices_fsdp4_tensor2_match_one_device():
    cfg = lora_cfg()
    one = C.mesh_of(jax.devices(), 1, 1, 1)
    model_config, state, base, _ = setup(cfg, one)
    inputs = C.loss_inputs(0, model_config.vocab_size)
    logp = np.asarray(
        trainer.make_logprob_fn(cfg, model_config, one)(
            lora.combine(base, state.params), trainer.shard_batch(inputs, one)
        )[0]
    )
    batch = C.off_policy_batch(inputs, logp, 0)
    ref_state, ref_metrics = trainer.make_train_step(cfg, model_config, one)(
        state, trainer.shard_batch(batch, one), base
    )
    ref_params = C.to_host(ref_state.params)
    mesh = C.mesh_of(jax.devices(), 1, 4, 2)
    _, state8, base8, _ = setup(cfg, mesh)
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(state8.params)}
    assert any("fsdp" in str(s) for s in specs), specs
    new_state, metrics = trainer.make_train_step(cfg, model_config, mesh)(
        state8, trainer.shard_batch(batch, mesh), base8
    )
    for key, value in C.to_host(metrics).items():
        np.testing.assert_allclose(value, C.to_host(ref_metrics)[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert C.max_rel_diff(C.to_host(new_state.params), ref_params) <= 1e-4


def test_lora_checkpoint_restores_exactly(tmp_path):
    cfg, mesh = lora_cfg(), C.mesh_of(jax.devices(), 1, 1, 1)
    model_config, state, base, _ = setup(cfg, mesh)
    inputs = trainer.shard_batch(C.loss_inputs(0, model_config.vocab_size), mesh)
    state, _ = make_update(cfg, model_config, mesh)(state, inputs, None, base)
    ck = Checkpointer(str(tmp_path), async_save=False)
    ck.save(1, state, {"k": 1}, {"lora_base": {"fingerprint": "x"}})
    step, restored, _ = ck.restore_latest(abstract_like(state))
    ck.close()
    assert step == 1
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(C.to_host(restored)), jax.tree.leaves(C.to_host(state)), strict=True):
        np.testing.assert_array_equal(a, b)
    # Only the adapter is stored: the checkpoint is a small fraction of the model.
    size = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    model_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(C.tiny_model()[2]))
    assert size < 0.5 * model_bytes


def test_full_fine_tuning_state_is_unchanged():
    cfg = C.base_config()
    resolved = resolve_model_config(cfg, C.tiny_model()[1])
    assert resolved.lora_rank == 0
    assert dataclasses.replace(resolved, lora_rank=0) == resolved
