"""Numerics that cross the algos/loop boundary: advantage options reach every estimator that takes them.

`make_advantages` is the loop's own path (rljax/loop/setup.py); the options are read from each
estimator's signature, so these tests fail if an option is dropped for any registered estimator.
"""

import dataclasses
import inspect
import math

import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algos
from rljax.config import Config
from rljax.loop.setup import make_advantages

# group 0 [1, 1]: zero variance (advantage 0 under every eps); group 1 [0, 1]: deviations -+1/2, Bessel
# std sqrt(1/2); group 2 [0, 1/2]: deviations -+1/4, std sqrt(1/8).
REWARDS = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.5], np.float32)
GROUPS = np.array([0, 0, 1, 1, 2, 2], np.int32)
# The estimators that declare an eps (read from the registry below, pinned here so a lost one fails).
EPS_ESTIMATORS = ["grpo", "reinforce_pp", "reinforce_pp_baseline"]


def loop_advantages(**algo_fields) -> np.ndarray:
    cfg = Config()
    cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, **algo_fields))
    return make_advantages(cfg)(REWARDS, GROUPS, 3)


def direct(name: str, **options) -> np.ndarray:
    fn = algos.ADVANTAGES.get(name)
    return np.asarray(
        fn(rewards=jnp.asarray(REWARDS), group_ids=jnp.asarray(GROUPS), num_groups=3, **options)
    )


def test_the_estimators_declaring_eps_are_the_documented_ones():
    takes = [
        n for n in algos.ADVANTAGES.names() if "eps" in inspect.signature(algos.ADVANTAGES.get(n)).parameters
    ]
    assert takes == EPS_ESTIMATORS


@pytest.mark.parametrize("name", EPS_ESTIMATORS)
def test_adv_eps_reaches_every_estimator_that_takes_it(name):
    small, large = loop_advantages(advantage=name), loop_advantages(advantage=name, adv_eps=0.5)
    np.testing.assert_allclose(small, direct(name, eps=1e-6), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(large, direct(name, eps=0.5), rtol=1e-6, atol=1e-7)
    assert np.abs(large - small).max() > 0.1  # eps = 1/2 against stds <= 0.5: it shows
    if name == "grpo":  # the zero-variance group stays exactly 0 under every eps
        np.testing.assert_array_equal(large[:2], [0.0, 0.0])


def test_grpo_with_adv_eps_golden():
    # Group std, eps 1/2: group 1 -+(1/2) / (sqrt(1/2) + 1/2) = -+1/(sqrt 2 + 1) = -+(sqrt 2 - 1);
    # group 2 -+(1/4) / (sqrt(1/8) + 1/2) = -+1/(sqrt 2 + 2) = -+(1 - 1/sqrt 2).
    a, b = math.sqrt(2) - 1, 1 - 1 / math.sqrt(2)
    np.testing.assert_allclose(loop_advantages(adv_eps=0.5), [0, 0, -a, a, -b, b], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", algos.ADVANTAGES.names())
def test_every_estimator_builds_through_the_loop_path(name):
    # Every option an estimator declares is offered by the config (or has a default): the loop builds.
    options = algos.advantage_options(algos.ADVANTAGES.get(name), {"std_scale": "batch", "eps": 0.5})
    np.testing.assert_allclose(
        loop_advantages(advantage=name, adv_std_scale="batch", adv_eps=0.5),
        direct(name, **options),
        atol=1e-7,
    )


def test_adv_std_scale_still_reaches_grpo_and_estimators_without_options_get_none():
    np.testing.assert_allclose(loop_advantages(adv_std_scale="none"), direct("drgrpo"), atol=1e-7)
    np.testing.assert_allclose(loop_advantages(advantage="drgrpo", adv_eps=0.5), direct("drgrpo"), atol=1e-7)
    assert algos.advantage_options(algos.drgrpo, {"eps": 0.5, "std_scale": "batch"}) == {}
    assert algos.advantage_options(algos.reinforce_pp, {"eps": 0.5, "std_scale": "batch"}) == {"eps": 0.5}


def test_an_option_without_default_that_is_not_offered_raises():
    def needs_tau(*, rewards, group_ids, num_groups, tau):
        return rewards

    with pytest.raises(ValueError, match=r"needs_tau needs options \['tau'\]; offered: \['eps'\]"):
        algos.advantage_options(needs_tau, {"eps": 0.1})


@pytest.mark.parametrize(
    "field,registry",
    [("is_level", algos.IS_LEVELS), ("is_mode", algos.IS_MODES), ("adv_std_scale", algos.STD_SCALES)],
)
def test_config_choices_are_the_registered_members(field, registry):
    # The config lists its choices (for the one-line error at parse time); they must be the registry's.
    choices = {f.name: f for f in dataclasses.fields(Config().algo)}[field].metadata["choices"]
    assert sorted(choices) == registry.names()
