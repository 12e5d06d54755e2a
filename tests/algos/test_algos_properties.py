"""Properties over every registry member, registry errors, docstrings, and exact micro-batching."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algos

B, T, G = 8, 6, 3  # rows, tokens, prompt groups
REGISTRIES = {
    "ADVANTAGES": algos.ADVANTAGES,
    "POLICY_LOSSES": algos.POLICY_LOSSES,
    "KL_ESTIMATORS": algos.KL_ESTIMATORS,
    "LOSS_AGGREGATIONS": algos.LOSS_AGGREGATIONS,
    "IS_LEVELS": algos.IS_LEVELS,
    "IS_MODES": algos.IS_MODES,
}
MEMBERS = [(reg, name) for reg, r in REGISTRIES.items() for name in r.names()]
EXPECTED = {
    "ADVANTAGES": ["drgrpo", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"],
    "POLICY_LOSSES": ["gspo", "ppo_clip"],
    "KL_ESTIMATORS": ["k1", "k2", "k3"],
    "LOSS_AGGREGATIONS": [
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
        "token_mean",
    ],
    "IS_LEVELS": ["geometric", "none", "sequence", "token"],
    "IS_MODES": ["mask", "truncate"],
}


def _mask():
    # Rows of different lengths (1..6 tokens, one empty row), prompt positions at the front masked out.
    lengths = np.array([6, 3, 1, 0, 5, 2, 4, 6])
    start = np.array([0, 2, 4, 0, 1, 3, 0, 0])
    t = np.arange(T)
    return jnp.asarray((t >= start[:, None]) & (t < (start + lengths)[:, None]), jnp.float32)


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    old = jax.nn.log_sigmoid(jax.random.normal(k[0], (B, T)))
    logp = old + 0.3 * jax.random.normal(k[1], (B, T))
    adv = jax.random.normal(k[2], (B,))
    return logp, old, adv, _mask()


def test_registries_hold_exactly_the_documented_members():
    assert {k: r.names() for k, r in REGISTRIES.items()} == EXPECTED


@pytest.mark.parametrize("reg", sorted(REGISTRIES))
def test_duplicate_and_unknown_names_raise(reg):
    registry = REGISTRIES[reg]
    name = registry.names()[0]
    before = registry.get(name)
    with pytest.raises(ValueError, match="duplicate"):
        registry.register(name)(lambda *a, **k: None)
    assert registry.get(name) is before  # the failed registration changed nothing
    with pytest.raises(KeyError) as err:
        registry.get("no_such_thing")
    assert all(n in str(err.value) for n in registry.names())


@pytest.mark.parametrize("reg,name", MEMBERS)
def test_docstrings_have_shapes_and_references(reg, name):
    doc = inspect.getdoc(REGISTRIES[reg].get(name))
    assert doc and "References:" in doc and "f32[" in doc, (reg, name)


@pytest.mark.parametrize(
    "fn",
    [
        algos.gae,
        algos.value_loss,
        algos.importance_weights,
        algos.dynamic_sampling_mask,
        algos.overlong_penalty,
        algos.token_entropy,
        algos.entropy_bonus,
        algos.clipped_objective,
    ],
)
def test_plain_functions_have_shapes_and_references(fn):
    doc = inspect.getdoc(fn)
    assert "References:" in doc and ("f32[" in doc or "i32[" in doc), fn.__name__


# --------------------------------------------------------------------- one property test per member
def _check_advantage(fn):
    rewards = jax.random.normal(jax.random.key(1), (B,))
    groups = jnp.array([0, 0, 0, 1, 1, 2, 2, 2])
    f = jax.jit(functools.partial(fn, num_groups=G))
    out = f(rewards=rewards, group_ids=groups)
    grad = jax.jit(jax.grad(lambda r: (f(rewards=r, group_ids=groups) * jnp.arange(B)).sum()))
    assert out.shape == (B,) and np.isfinite(out).all() and np.isfinite(grad(rewards)).all()
    assert np.abs(out).max() > 0.1  # non-trivial on varied rewards
    # EXACTLY zero advantage when every reward is equal (0.7 is not exact in float32: a plain mean leaves
    # ~6e-8 of rounding that a batch std of ~6e-8 would blow up to 0.06), with finite gradients.
    flat = jnp.full((B,), 0.7)
    np.testing.assert_array_equal(f(rewards=flat, group_ids=groups), np.zeros(B))
    assert np.isfinite(grad(flat)).all()


def _check_policy_loss(fn):
    logp, old, adv, mask = _inputs()
    f = jax.jit(fn)
    loss, metrics = f(logp, old, adv, mask)
    grad = jax.jit(jax.grad(lambda lp, a: f(lp, old, a, mask)[0].sum()))
    assert loss.shape == (B, T) and np.isfinite(loss).all() and np.isfinite(grad(logp, adv)).all()
    assert {"clip_frac_low", "clip_frac_high"} <= set(metrics)
    assert all(m.shape == () and np.isfinite(m) for m in metrics.values())
    assert (np.asarray(loss)[mask == 0] == 0).all()
    # Ratio 1 (logp == old) and zero advantage: exactly zero loss and zero gradient.
    zero_loss, _ = f(old, old, jnp.zeros(B), mask)
    np.testing.assert_array_equal(zero_loss, np.zeros((B, T)))
    np.testing.assert_array_equal(grad(old, jnp.zeros(B)), np.zeros((B, T)))
    # ... and for token-level [B,T] advantages too.
    np.testing.assert_array_equal(f(old, old, jnp.zeros((B, T)), mask)[0], np.zeros((B, T)))


def _check_kl(name, fn):
    logp, ref, _, mask = _inputs()
    f = jax.jit(fn)
    grad = jax.jit(jax.grad(lambda lp: (f(lp, ref) * mask).sum()))
    assert f(logp, ref).shape == (B, T) and np.isfinite(f(logp, ref)).all() and np.isfinite(grad(logp)).all()
    # At ratio 1 every estimator is 0. k2 and k3 have zero gradient there; k1 = logp - ref has gradient 1
    # per token (its pathwise gradient is not the KL's gradient, which is why k1 is rarely used as a loss).
    np.testing.assert_array_equal(f(ref, ref), np.zeros((B, T)))
    np.testing.assert_array_equal(grad(ref), mask if name == "k1" else np.zeros((B, T)))
    # Far off-policy (log-ratio -80 / +80) stays finite thanks to the clamp.
    assert np.isfinite(f(ref - 80.0, ref)).all() and np.isfinite(f(ref + 80.0, ref)).all()


def _check_aggregation(fn):
    logp, old, adv, mask = _inputs()
    f = jax.jit(fn)
    per_token = (logp - old) * adv[:, None] * mask
    grad = jax.jit(jax.grad(lambda x: f(x, mask)))
    assert f(per_token, mask).shape == () and np.isfinite(f(per_token, mask))
    g = grad(per_token)
    assert np.isfinite(g).all() and (np.asarray(g)[3] == 0).all()  # row 3 has an empty mask
    np.testing.assert_array_equal(f(jnp.zeros((B, T)), mask), 0.0)
    # A batch of empty rows gives 0, not NaN.
    np.testing.assert_array_equal(f(per_token, jnp.zeros((B, T))), 0.0)
    zero_norms = {"num_tokens": 0.0, "num_seqs": 0, "max_len": 0}  # explicit zeros for an empty batch
    np.testing.assert_array_equal(
        jax.jit(functools.partial(fn, **zero_norms))(per_token, jnp.zeros((B, T))), 0.0
    )
    assert np.isfinite(grad(per_token)).all()


def _check_importance_weights(**options):
    logp, behavior, _, mask = _inputs()
    f = jax.jit(functools.partial(algos.importance_weights, cap=1.5, **options))
    weights, metrics = f(logp, behavior, mask)
    assert weights.shape == (B, T) and np.isfinite(weights).all() and (np.asarray(weights) >= 0).all()
    assert (np.asarray(weights)[mask == 0] == 0).all() and all(np.isfinite(v) for v in metrics.values())
    # Stop-gradient: no gradient reaches either log-prob.
    grad = jax.jit(jax.grad(lambda lp, bp: f(lp, bp, mask)[0].sum(), argnums=(0, 1)))(logp, behavior)
    assert all((np.asarray(g) == 0).all() for g in grad)
    # Exactly weight 1 on the mask where trainer and rollout engine agree, with nothing capped.
    same, same_metrics = f(behavior, behavior, mask)
    np.testing.assert_array_equal(same, np.asarray(mask))
    assert float(same_metrics["is_frac_capped"]) == 0.0
    # Far off-policy (log-ratio -80 / +80 on every token) stays finite thanks to the clamp.
    for shift in (-80.0, 80.0):
        assert np.isfinite(f(behavior + shift, behavior, mask)[0]).all()


@pytest.mark.parametrize("reg,name", MEMBERS)
def test_every_member_jits_is_finite_and_vanishes_at_zero_advantage(reg, name):
    fn = REGISTRIES[reg].get(name)
    if reg == "ADVANTAGES":
        _check_advantage(fn)
    elif reg == "POLICY_LOSSES":
        _check_policy_loss(fn)
    elif reg == "KL_ESTIMATORS":
        _check_kl(name, fn)
    elif reg == "IS_LEVELS":  # members are checked through the function the trainer calls
        _check_importance_weights(level=name, mode="truncate")
    elif reg == "IS_MODES":
        _check_importance_weights(level="token", mode=name)
    else:
        _check_aggregation(fn)


# ---------------------------------------------------------------------------------- micro-batching
D, V = 5, 7  # features and vocab of a tiny linear policy


def _problem():
    k = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(k[0], (B, T, D))
    targets = jax.random.randint(k[1], (B, T), 0, V)
    w0 = 0.5 * jax.random.normal(k[2], (D, V))
    w = w0 + 0.2 * jax.random.normal(k[3], (D, V))
    rewards = jax.random.normal(k[4], (B,))
    adv = algos.grpo(rewards=rewards, group_ids=jnp.arange(B) // 3, num_groups=G)
    return x, targets, w0, w, adv


def _logp(w, x, targets):
    logits = jnp.einsum("btd,dv->btv", x, w)
    return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0], logits


def _make_loss(aggregation, policy_loss):
    aggregate = algos.LOSS_AGGREGATIONS.get(aggregation)
    pg_fn = functools.partial(algos.POLICY_LOSSES.get(policy_loss), clip_low=0.1, clip_high=0.15)
    if policy_loss == "gspo":
        pg_fn = functools.partial(pg_fn, clip_low=0.02, clip_high=0.03)

    def loss(w, x, targets, old, ref, behavior, adv, mask, norms):
        logp, logits = _logp(w, x, targets)
        is_w, _ = algos.importance_weights(old, behavior, mask, level="token", mode="truncate", cap=1.5)
        pg, metrics = pg_fn(logp, old, adv, mask)
        total = aggregate(pg * is_w, mask, **norms) + 0.1 * aggregate(algos.k3(logp, ref), mask, **norms)
        total += algos.entropy_bonus(
            algos.token_entropy(logits), mask, coef=0.01, aggregation=aggregation, **norms
        )
        return total, metrics

    return loss


# Every aggregation with ppo_clip; gspo (whose ratio couples a row's tokens) with the aggregation it is
# defined with. Each case compiles two value-and-grad programs, so the grid is kept to what adds coverage.
MICRO_CASES = [(agg, "ppo_clip") for agg in EXPECTED["LOSS_AGGREGATIONS"]] + [("seq_mean_token_mean", "gspo")]


@pytest.mark.parametrize("aggregation,policy_loss", MICRO_CASES)
def test_four_micro_batches_give_the_whole_batch_gradient(aggregation, policy_loss):
    x, targets, w0, w, adv = _problem()
    old, _ = _logp(w0, x, targets)
    behavior = old + 0.2 * jax.random.normal(jax.random.key(9), (B, T))
    # Host arrays: slicing them into micro-batches costs no compilation.
    args = tuple(np.asarray(a) for a in (x, targets, old, old - 0.3, behavior, adv, _mask()))
    mask = args[-1]
    value_grad = jax.jit(jax.value_and_grad(_make_loss(aggregation, policy_loss), has_aux=True))
    norms = {"num_tokens": mask.sum(), "num_seqs": B, "max_len": T}  # global: the whole batch's
    micro = lambda i, n: value_grad(w, *(a[i : i + 2] for a in args), n)

    (whole, whole_metrics), whole_grad = value_grad(w, *args, norms)
    parts = [micro(i, norms) for i in range(0, B, 2)]
    np.testing.assert_allclose(sum(p[0][0] for p in parts), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sum(np.asarray(p[1]) for p in parts), whole_grad, rtol=1e-6, atol=1e-6)
    # Metrics are masked means, so token-weighting recombines them exactly (as the trainer does).
    ntok = [mask[i : i + 2].sum() for i in range(0, B, 2)]
    for key, value in whole_metrics.items():
        recombined = sum(float(p[0][1][key]) * n for p, n in zip(parts, ntok, strict=True)) / mask.sum()
        np.testing.assert_allclose(recombined, value, rtol=1e-6, atol=1e-6, err_msg=key)
    # The test can fail: with each micro-batch's own normalizers, summing (or, for token_mean, averaging)
    # the micro-batch gradients is far off. (Averaging is right for the seq_mean_* ones: equal row counts.)
    local = [
        np.asarray(micro(i, {"num_tokens": max(mask[i : i + 2].sum(), 1.0), "num_seqs": 2, "max_len": T})[1])
        for i in range(0, B, 2)
    ]
    assert np.abs(sum(local) - whole_grad).max() > 1e-3
    if aggregation == "token_mean":
        assert np.abs(sum(local) / len(local) - whole_grad).max() > 1e-3
    assert np.abs(whole_grad).max() > 1e-3
    assert float(whole_metrics["clip_frac_low"] + whole_metrics["clip_frac_high"]) > 0  # clipping happens


def test_plain_functions_jit_with_options_bound_outside():
    logp, old, adv, mask = _inputs()
    rewards, groups = jax.random.normal(jax.random.key(2), (B,)), jnp.arange(B) % G
    iw = jax.jit(functools.partial(algos.importance_weights, level="sequence", mode="mask", cap=2.0))
    weights, metrics = iw(logp, old, mask)
    assert weights.shape == (B, T) and all(np.isfinite(v) for v in metrics.values())
    adv_t, ret = jax.jit(functools.partial(algos.gae, gamma=0.9, lam=0.95))(
        rewards=logp, values=old, mask=mask
    )
    assert np.isfinite(adv_t).all() and np.isfinite(ret).all() and (np.asarray(adv_t)[mask == 0] == 0).all()
    keep, frac = jax.jit(algos.dynamic_sampling_mask, static_argnums=2)(rewards, groups, G)
    assert keep.dtype == bool and 0.0 <= float(frac) <= 1.0
    shaped = jax.jit(functools.partial(algos.overlong_penalty, max_len=8, buffer=4, penalty=1.0))(
        jnp.arange(B)
    )
    np.testing.assert_allclose(shaped, [0, 0, 0, 0, 0, -0.25, -0.5, -0.75])  # (4 - L)/4 for L = 5, 6, 7
