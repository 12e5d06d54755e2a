"""The trainer-vs-rollout KL metric (GAP_KL): the k3 estimate of KL(rollout || trainer) on loss tokens."""

import types

import jax.numpy as jnp
import numpy as np

from rljax.trainer.step import GAP_KL, GAP_MAX, GAP_MEAN
from rljax.trainer.update import mismatch_metrics


def test_kl_is_the_token_mean_of_k3_on_loss_tokens_only():
    behavior = jnp.asarray([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.7, 0.0, 0.0]])
    trainer = jnp.asarray([[-1.1, -1.8, -0.5, 9.0], [-0.3, -1.0, 5.0, 0.0]])  # off-mask values ignored
    mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    batch = types.SimpleNamespace(behavior_logp=behavior, loss_mask=mask)
    got = {k: float(v) for k, v in mismatch_metrics(trainer, batch).items()}
    r = np.asarray([-0.1, 0.2, 0.0, 0.0, -0.3])  # trainer - behavior on the 5 loss tokens
    np.testing.assert_allclose(got[GAP_KL], np.mean(np.expm1(r) - r), rtol=1e-6)
    np.testing.assert_allclose(got[GAP_MEAN], np.mean(np.abs(r)), rtol=1e-6)
    np.testing.assert_allclose(got[GAP_MAX], 0.3, rtol=1e-6)
    same = {k: float(v) for k, v in mismatch_metrics(behavior, batch).items()}
    assert same[GAP_KL] == 0.0 and same[GAP_MAX] == 0.0  # identical policies: no gap, no KL
