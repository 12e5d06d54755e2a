"""PPO: reward placement, critic init, an update that learns values, micro-batched == whole."""

import jax
import jax.numpy as jnp
import mp_trainer_common as C
import numpy as np
import optax
import pytest

from rljax import algos, trainer
from rljax.trainer.ppo import make_advantages_fn, make_ppo_grad_fn
from rljax.types import LossInputs


def test_token_rewards_sit_on_the_last_loss_token():
    mask = np.array([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 0, 0]], np.float32)
    z = np.zeros(mask.shape, np.int32)
    rewards, zeros = np.array([2.0, -1.0, 0.5], np.float32), np.zeros(3, np.int32)
    batch = LossInputs(z, z, z, z, mask, mask * 0, rewards * 0, rewards, zeros, zeros)
    want = np.zeros(mask.shape, np.float32)
    want[0, 2], want[1, 4], want[2, 2] = 2.0, -1.0, 0.5
    np.testing.assert_array_equal(np.asarray(trainer.token_rewards(batch)), want)


@pytest.fixture(scope="module")
def ppo():
    _, model_config, params = C.tiny_model()
    cfg = C.base_config(
        algo__family="ppo",
        algo__beta=0.0,
        algo__is_level="none",
        algo__lam=0.95,
        algo__vf_coef=0.5,
        algo__value_clip=0.2,
        optim__learning_rate=3e-3,
    )
    mesh = C.mesh_of(jax.devices(), 1, 2, 1)
    inputs = C.loss_inputs(5, model_config.vocab_size)
    inputs = inputs.replace(
        behavior_logp=np.full(inputs.loss_mask.shape, -6.0, np.float32) * inputs.loss_mask
    )
    return cfg, model_config, params, mesh, trainer.shard_batch(inputs, mesh)


def test_critic_is_a_decoder_copy_with_zero_head(ppo):
    cfg, model_config, params, mesh, batch = ppo
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    ptr = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
    # Separate buffers: donating the state must not free one copy through the other.
    assert ptr(state.critic_params["decoder"]["embed"]["embedding"]) != ptr(
        state.params["embed"]["embedding"]
    )
    jax.tree.map(
        np.testing.assert_array_equal, C.to_host(state.critic_params["decoder"]), C.to_host(state.params)
    )
    values = trainer.critic_values(model_config, state.critic_params, batch)
    np.testing.assert_array_equal(np.asarray(values), 0.0)


def test_ppo_micro_batched_gradients_match_whole_batch(ppo):
    cfg, model_config, params, mesh, batch = ppo
    # A non-zero value head, so that gradients reach the critic's decoder too.
    head = np.random.default_rng(0).normal(size=model_config.hidden_size).astype(np.float32)
    critic = trainer.init_critic_params(model_config, params)
    critic["value_head"]["kernel"] = 0.05 * head
    state = trainer.init_train_state(cfg, model_config, params, mesh, critic_params=critic)
    old_logp, _ = trainer.make_logprob_fn(cfg, model_config, mesh)(state.params, batch)
    old_values = trainer.critic_values(model_config, state.critic_params, batch)
    advantages, returns = make_advantages_fn(cfg, mesh)(batch, old_values)
    # Perturbed old log-probs / values so that ratio and value clipping are both active.
    tb = trainer.TrainBatch(
        inputs=batch, old_logp=old_logp + 0.3 * jnp.sin(old_logp), advantages=advantages,
        returns=returns, old_values=old_values + 0.3 * jnp.cos(old_values),
    )  # fmt: skip
    tb = trainer.shard_batch(jax.device_get(tb), mesh)
    params_pair = {"actor": state.params, "critic": state.critic_params}
    whole = make_ppo_grad_fn(cfg, model_config, mesh)(params_pair, tb)
    micro_cfg = C.with_fields(cfg, trainer__micro_batch_size=C.ROWS // 4)
    micro = make_ppo_grad_fn(micro_cfg, model_config, mesh)(params_pair, tb)
    assert C.max_rel_diff(micro[0], whole[0]) <= 1e-6
    for key, value in C.to_host(whole[1]).items():
        # abs 1e-7: whitened advantages sum to ~0, so the policy loss is a small difference of f32 sums.
        assert float(micro[1][key]) == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert float(whole[1]["clip/frac_low"]) + float(whole[1]["clip/frac_high"]) > 0
    assert float(optax.global_norm(whole[0]["critic"]["decoder"])) > 0


def test_ppo_update_learns_values(ppo):
    cfg, model_config, params, mesh, batch = ppo
    update = trainer.make_ppo_update(cfg, model_config, mesh)
    state, metrics = update(trainer.init_train_state(cfg, model_config, params, mesh), batch)
    # Zero initial values: the first value loss is 0.5 * vf_coef * mean(returns^2) over loss tokens > 0.
    assert metrics["loss/value"] > 0 and metrics["optim/critic_grad_norm"] > 0
    assert float(jnp.abs(state.critic_params["value_head"]["kernel"]).max()) > 0
    value_losses = [metrics["loss/value"]]
    for _ in range(4):
        state, metrics = update(state, batch)
        value_losses.append(metrics["loss/value"])
    assert value_losses[-1] < 0.5 * value_losses[0], value_losses  # the critic fits the returns
    assert int(state.step) == 5 and metrics["optim/nonfinite"] == 0
    assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("whiten", [True, False])
def test_advantages_are_whitened_over_loss_tokens(ppo, whiten):
    cfg, model_config, params, mesh, batch = ppo
    cfg = C.with_fields(cfg, algo__whiten_advantages=whiten)
    values = np.random.default_rng(1).normal(size=batch.loss_mask.shape).astype(np.float32)
    values = trainer.shard_batch(values * np.asarray(batch.loss_mask), mesh)
    advantages, returns = jax.device_get(make_advantages_fn(cfg, mesh)(batch, values))
    mask = np.asarray(batch.loss_mask) > 0
    raw, raw_returns = jax.device_get(
        algos.gae(
            rewards=trainer.token_rewards(batch), values=values, mask=batch.loss_mask, gamma=1.0, lam=0.95
        )
    )
    np.testing.assert_allclose(returns, raw_returns, rtol=1e-6, atol=1e-6)  # returns never whitened
    assert np.all(advantages[~mask] == 0)
    if whiten:
        assert abs(advantages[mask].mean()) < 1e-5 and advantages[mask].std() == pytest.approx(1.0, rel=1e-4)
        np.testing.assert_allclose(
            advantages[mask], (raw[mask] - raw[mask].mean()) / raw[mask].std(), rtol=1e-4, atol=1e-5
        )
    else:
        np.testing.assert_allclose(advantages, raw, rtol=1e-6, atol=1e-6)
