"""On-policy shortcut: the old log-probs from the update's own forward equal the separate pass's.

With one epoch of one minibatch the only train step runs on the parameters that define the old
log-probs, so `make_on_policy_update` takes them from the step's forward under stop-gradient instead
of a separate pass. Each case compares it with the separate-pass path on the tiny Qwen2 model: the
accumulated gradients, the step's loss and every metric, and a whole update (new parameters and
metrics, the trainer-vs-rollout gap included). The behaviour log-probs differ from the trainer's, so
IS weights are non-trivial and hit the cap.

Tolerance 1e-6 relative: both paths run the same math; the separate pass is another jit of the same
forward, so its log-probs may differ from the step's by float32 rounding (ratios 1 +- 1e-7).
"""

import jax
import mp_trainer_common as C
import numpy as np
import pytest

from rljax import trainer
from rljax.trainer import update as update_mod
from rljax.trainer.step import GAP_MAX, GAP_MEAN, make_grad_fn

RTOL, ATOL = 1e-6, 1e-9


@pytest.fixture(scope="module")
def setup():
    """(model_config, host params, host inputs with perturbed behaviour log-probs, host ref_logp)."""
    _, model_config, params = C.tiny_model()
    cfg, mesh = C.base_config(), C.mesh_of(jax.devices(), 1, 1, 1)
    inputs = C.loss_inputs(0, model_config.vocab_size)
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    logprob_fn = trainer.make_logprob_fn(cfg, model_config, mesh)
    logp, _ = logprob_fn(state.params, trainer.shard_batch(inputs, mesh))
    perturbed = C.off_policy_batch(inputs, np.asarray(logp), 0)  # its behaviour and ref log-probs
    return model_config, params, perturbed.inputs, perturbed.ref_logp


def assert_metrics_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=RTOL, atol=ATOL, err_msg=key)


CASES = {
    "token": ({"algo__is_level": "token"}, (1, 1, 1)),
    "sequence": ({"algo__is_level": "sequence"}, (1, 1, 1)),
    "token_micro_8dev": ({"algo__is_level": "token", "trainer__micro_batch_size": C.ROWS // 2}, (2, 2, 2)),
    "sequence_micro_8dev": (
        {"algo__is_level": "sequence", "trainer__micro_batch_size": C.ROWS // 4, "algo__is_mode": "mask"},
        (1, 4, 2),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shortcut_gradients_and_metrics_equal_the_separate_pass(setup, case):
    model_config, params, inputs, ref_logp = setup
    changes, shape = CASES[case]
    cfg, mesh = C.base_config(**changes), C.mesh_of(jax.devices(), *shape)
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    sharded = trainer.shard_batch(inputs, mesh)
    old_logp, _ = trainer.make_logprob_fn(cfg, model_config, mesh)(state.params, sharded)
    batch = trainer.shard_batch(trainer.TrainBatch(inputs, old_logp, inputs.advantages, ref_logp), mesh)
    grads, metrics = make_grad_fn(cfg, model_config, mesh)(state.params, batch)
    metrics = C.to_host(metrics) | C.to_host(update_mod.mismatch_metrics(old_logp, sharded))
    own = batch.replace(old_logp=None)
    own_grads, own_metrics = make_grad_fn(cfg, model_config, mesh, on_policy=True)(state.params, own)
    assert C.max_rel_diff(own_grads, grads) <= RTOL
    assert_metrics_equal(C.to_host(own_metrics), metrics)
    # The case exercises what it claims: IS weights over the cap, a real gap, KL and entropy terms.
    assert metrics["is/frac_capped"] > 0 and metrics["is/weight_max"] > cfg.algo.is_cap
    assert metrics[GAP_MAX] > metrics[GAP_MEAN] > 0.1 and metrics["loss/kl"] > 0
    assert metrics["clip/frac_low"] == metrics["clip/frac_high"] == 0  # on policy: ratio 1


@pytest.mark.parametrize("case", ["token", "sequence_micro_8dev"])
def test_shortcut_update_equals_the_separate_pass_update(setup, case):
    model_config, params, inputs, _ = setup
    changes, shape = CASES[case]
    cfg, mesh = C.base_config(**changes), C.mesh_of(jax.devices(), *shape)
    ref_params = trainer.init_train_state(
        cfg, model_config, jax.tree.map(lambda x: x * 1.01, params), mesh
    ).params
    sharded = trainer.shard_batch(inputs, mesh)
    runs = {}
    for name, make in [
        ("separate", update_mod.make_separate_pass_update),
        ("own", update_mod.make_on_policy_update),
    ]:
        state = trainer.init_train_state(cfg, model_config, params, mesh)
        state, metrics = make(cfg, model_config, mesh)(state, sharded, ref_params)
        runs[name] = (C.to_host(state.params), metrics)
    (p_sep, m_sep), (p_own, m_own) = runs["separate"], runs["own"]
    assert_metrics_equal(m_own, m_sep)
    assert C.max_rel_diff(p_own, p_sep) <= RTOL
    assert C.max_rel_diff(p_sep, params) > 1e-4  # the update moved the params
    assert m_sep["kl/mean"] > 0 and m_sep["is/frac_capped"] > 0 and m_sep["optim/steps"] == 1


def counting_logprob_fns(monkeypatch) -> list:
    """Patches the update's `make_logprob_fn` so every log-prob pass records the params it ran on."""
    calls, make = [], update_mod.make_logprob_fn

    def make_counting(*args, **kwargs):
        fn = make(*args, **kwargs)

        def counting(params, batch):
            calls.append(params)
            return fn(params, batch)

        return counting

    monkeypatch.setattr(update_mod, "make_logprob_fn", make_counting)
    return calls


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_shortcut_runs_no_old_logprob_pass(setup, monkeypatch, beta):
    model_config, params, inputs, _ = setup
    calls = counting_logprob_fns(monkeypatch)
    cfg, mesh = C.base_config(algo__beta=beta), C.mesh_of(jax.devices(), 1, 1, 1)
    ref_params = trainer.init_train_state(cfg, model_config, params, mesh).params
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    state, metrics = trainer.make_update(cfg, model_config, mesh)(
        state, trainer.shard_batch(inputs, mesh), ref_params
    )
    # Only the reference pass (algo.beta > 0) runs, on the reference params; the old log-probs and the
    # gap metrics come out of the step.
    assert len(calls) == (1 if beta > 0 else 0)
    assert all(p is ref_params for p in calls)
    assert metrics[GAP_MAX] > 0 and int(state.step) == 1
    calls.clear()
    separate = C.with_fields(cfg, trainer__epochs=2)
    trainer.make_update(separate, model_config, mesh)(state, trainer.shard_batch(inputs, mesh), ref_params)
    assert len(calls) == (2 if beta > 0 else 1)  # the old log-prob pass is back


def test_shortcut_is_chosen_from_the_config():
    shortcut = update_mod.on_policy_shortcut
    assert shortcut(C.base_config())
    assert shortcut(C.base_config(trainer__max_staleness=2))  # old log-probs still the current params'
    assert not shortcut(C.base_config(trainer__epochs=2))
    assert not shortcut(C.base_config(trainer__minibatches=2))
    with pytest.raises(ValueError, match="epochs == trainer.minibatches == 1"):
        update_mod.make_on_policy_update(C.base_config(trainer__minibatches=2), None, None)
