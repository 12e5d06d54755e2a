"""Golden values for every rljax.algos function, each worked out by hand in the comment beside it.

Tolerances: inputs like exp(log(1.5)) round-trip through float32, so values are compared to ~1e-6
relative (a few float32 ulps), never looser.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algos

TOL = {"rtol": 1e-6, "atol": 1e-6}


def jit_grad(f):
    # One compiled program per gradient: much cheaper on CPU than op-by-op eager differentiation.
    return jax.jit(jax.grad(f))


# ----------------------------------------------------------------------------------------- advantages
# Three groups, interleaved so the group gather is exercised:
#   group 0: rewards 3, 1, 2  mean 2, deviations +1, -1, 0, Bessel var (1+1+0)/2 = 1, std 1
#   group 1: rewards 1, 1     mean 1, deviations 0, 0, std 0
#   group 2: rewards 4, 0     mean 2, deviations +2, -2, Bessel var (4+4)/1 = 8, std 2*sqrt(2)
REWARDS = [3.0, 4.0, 1.0, 1.0, 2.0, 0.0, 1.0]
GROUPS = [0, 2, 0, 1, 0, 2, 1]
DEV = np.array([1.0, 2.0, -1.0, 0.0, 0.0, -2.0, 0.0])  # r - group mean
GROUP_STD = np.array([1.0, 2 * math.sqrt(2), 1.0, 0.0, 1.0, 2 * math.sqrt(2), 0.0])
# Whole batch: mean 12/7; squared deviations * 49 = 81+256+25+25+4+144+25 = 560, so the Bessel variance
# is 560/49/6 = 40/21 and the batch std sqrt(40/21) = 1.38013.
BATCH_STD = math.sqrt(40 / 21)
EPS = 1e-6


def _adv(name, **options):
    fn = algos.ADVANTAGES.get(name)
    return np.asarray(fn(rewards=jnp.array(REWARDS), group_ids=jnp.array(GROUPS), num_groups=3, **options))


def test_grpo_group_std():
    # (r - mean_g) / (std_g + eps): group 0 -> +-1/(1+eps), group 2 -> +-2/(2*sqrt(2)+eps), group 1 -> 0.
    np.testing.assert_allclose(_adv("grpo"), DEV / (GROUP_STD + EPS), **TOL)
    np.testing.assert_allclose(_adv("grpo")[[0, 1, 3]], [1.0, 1 / math.sqrt(2), 0.0], rtol=2e-6)


def test_grpo_batch_std_and_none():
    # batch: (r - mean_g) / sqrt(40/21) = [1, 2, -1, 0, 0, -2, 0] / 1.38013; none: the deviations.
    np.testing.assert_allclose(_adv("grpo", std_scale="batch"), DEV / (BATCH_STD + EPS), **TOL)
    np.testing.assert_allclose(_adv("grpo", std_scale="none"), DEV, **TOL)
    with pytest.raises(ValueError, match="std_scale"):
        _adv("grpo", std_scale="global")


def test_drgrpo():
    # r - mean_g, no scaling.
    np.testing.assert_allclose(_adv("drgrpo"), [1.0, 2.0, -1.0, 0.0, 0.0, -2.0, 0.0], **TOL)


def test_rloo():
    # r_i - mean of the OTHER members: r=3 vs mean(1, 2) = 1.5 -> 1.5; r=4 vs 0 -> 4;
    # r=1 vs mean(3, 2) -> -1.5; group 1: 1 - 1 = 0; r=2 vs mean(3, 1) = 2 -> 0; r=0 vs 4 -> -4.
    # (= n/(n-1) * deviation.)
    np.testing.assert_allclose(_adv("rloo"), [1.5, 4.0, -1.5, 0.0, 0.0, -4.0, 0.0], **TOL)


def test_rloo_and_grpo_give_zero_for_a_group_of_one():
    # A single sequence has no baseline: its own reward is the group mean, so every estimator gives 0.
    for name in ("grpo", "drgrpo", "rloo"):
        out = algos.ADVANTAGES.get(name)(
            rewards=jnp.array([5.0, 1.0, 2.0]), group_ids=jnp.array([0, 1, 1]), num_groups=2
        )
        assert float(out[0]) == 0.0, name


def test_reinforce_pp():
    # (r - 12/7) / sqrt(40/21): deviations [9, 16, -5, -5, 2, -12, -5] / 7.
    expected = np.array([9, 16, -5, -5, 2, -12, -5]) / 7 / (BATCH_STD + EPS)
    np.testing.assert_allclose(_adv("reinforce_pp"), expected, **TOL)


def test_reinforce_pp_baseline():
    # x = r - mean_g = [1, 2, -1, 0, 0, -2, 0]; mean_B(x) = 0; Bessel var (1+4+1+4)/6 = 5/3, std 1.29099.
    np.testing.assert_allclose(_adv("reinforce_pp_baseline"), DEV / (math.sqrt(5 / 3) + EPS), **TOL)


# ------------------------------------------------------------------------------------------ GAE, value
def test_gae_respects_the_mask():
    # gamma = lam = 0.5, so gamma*lam = 0.25.
    # Row 0, mask [0,1,1,0], r [0,0,1,0], V [5,.2,.6,7] (the 5 and 7 off the mask must not leak):
    #   t=2: delta = 1 + 0 - .6 = .4, A = .4, R = 1.0
    #   t=1: delta = 0 + .5*.6 - .2 = .1, A = .1 + .25*.4 = .2, R = .4
    # Row 1, mask all 1, r [0,0,0,2], V all 1:
    #   t=3: delta = 2 - 1 = 1, A = 1, R = 2
    #   t=2: delta = .5 - 1 = -.5, A = -.5 + .25*1 = -.25, R = .75
    #   t=1: A = -.5 + .25*(-.25) = -.5625, R = .4375;  t=0: A = -.5 + .25*(-.5625) = -.640625, R = .359375
    # Row 2, mask [1,0,1,0] (a gap), r [1,0,2,0], V [.5,9,1,9]:
    #   t=2: delta = 2 - 1 = 1, A = 1, R = 2;  t=1 off;  t=0: nothing crosses the gap: A = 1 - .5 = .5, R = 1
    mask = jnp.array([[0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 0]], jnp.float32)
    rewards = jnp.array([[0, 0, 1, 0], [0, 0, 0, 2], [1, 0, 2, 0]], jnp.float32)
    values = jnp.array([[5, 0.2, 0.6, 7], [1, 1, 1, 1], [0.5, 9, 1, 9]], jnp.float32)
    adv, ret = algos.gae(rewards=rewards, values=values, mask=mask, gamma=0.5, lam=0.5)
    np.testing.assert_allclose(adv, [[0, 0.2, 0.4, 0], [-0.640625, -0.5625, -0.25, 1], [0.5, 0, 1, 0]], **TOL)
    np.testing.assert_allclose(ret, [[0, 0.4, 1.0, 0], [0.359375, 0.4375, 0.75, 2], [1, 0, 2, 0]], **TOL)


def test_gae_with_gamma_lam_one_is_monte_carlo():
    # gamma = lam = 1: A_t = sum_{t' >= t} r_t' - V_t and R_t = sum_{t' >= t} r_t' (within the response).
    # r [1, 2, 3] on mask [1,1,1,0], V [.5,.5,.5,*]: returns-to-go 6, 5, 3.
    adv, ret = algos.gae(
        rewards=jnp.array([[1.0, 2, 3, 0]]),
        values=jnp.array([[0.5, 0.5, 0.5, 4]]),
        mask=jnp.array([[1.0, 1, 1, 0]]),
        gamma=1.0,
        lam=1.0,
    )
    np.testing.assert_allclose(ret, [[6, 5, 3, 0]], **TOL)
    np.testing.assert_allclose(adv, [[5.5, 4.5, 2.5, 0]], **TOL)


def test_masked_whiten():
    # Loss tokens 1, 2, 3 (and 6): mean 3, population var (4 + 1 + 0 + 9) / 4 = 3.5; off-mask 100 ignored.
    x = jnp.array([[1.0, 2, 100], [3, 6, 100]])
    mask = jnp.array([[1.0, 1, 0], [1, 1, 0]])
    s = np.sqrt(3.5 + 1e-8)
    np.testing.assert_allclose(algos.masked_whiten(x, mask), [[-2 / s, -1 / s, 0], [0, 3 / s, 0]], **TOL)
    np.testing.assert_array_equal(algos.masked_whiten(x, jnp.zeros_like(mask)), 0.0)


def test_value_loss():
    # t0: V=1, old=1, R=2: (1-2)^2 = 1 either way -> 0.5.
    # t1: V=2, old=1, clip .2 -> V_clip = 1.2; max((2-2.5)^2, (1.2-2.5)^2) = max(.25, 1.69) -> .845
    #     unclipped: .5 * .25 = .125.   t2: off the mask -> 0.
    v, old, ret = jnp.array([[1.0, 2, 0]]), jnp.array([[1.0, 1, 0.5]]), jnp.array([[2.0, 2.5, 9]])
    mask = jnp.array([[1.0, 1, 0]])
    np.testing.assert_allclose(algos.value_loss(v, old, ret, mask, clip=0.2), [[0.5, 0.845, 0]], **TOL)
    np.testing.assert_allclose(algos.value_loss(v, old, ret, mask, clip=None), [[0.5, 0.125, 0]], **TOL)
    np.testing.assert_allclose(algos.value_loss(v, old, ret, mask, clip=0.0), [[0.5, 0.125, 0]], **TOL)


# --------------------------------------------------------------------------------------- policy losses
# Row 0 (A = +1) ratios 1.5, 0.9, 1.1; row 1 (A = -2) ratios 0.5, 4.0, (off mask). clip_low .2, clip_high .28.
PPO_RATIOS = np.array([[1.5, 0.9, 1.1], [0.5, 4.0, 1.0]])
PPO_MASK = jnp.array([[1.0, 1, 1], [1, 1, 0]])
PPO_ADV = jnp.array([1.0, -2.0])


def _ppo(dual_clip_c, advantages=PPO_ADV):
    old = jnp.array([[-1.0, -2.0, -0.5], [-1.5, -3.0, -1.0]])
    logp = old + jnp.log(jnp.asarray(PPO_RATIOS, jnp.float32))
    fn = jax.jit(
        lambda lp: algos.ppo_clip(
            lp, old, advantages, PPO_MASK, clip_low=0.2, clip_high=0.28, dual_clip_c=dual_clip_c
        )
    )
    loss, metrics = fn(logp)
    grad = jit_grad(lambda lp: fn(lp)[0].sum())(logp)
    return np.asarray(loss), metrics, np.asarray(grad)


def test_ppo_clip_golden():
    # loss = max(-A r, -A clip(r, .8, 1.28)):
    #   row 0, A=1:  r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped high, grad 0); r=.9 -> -.9 (grad -A r = -.9);
    #                r=1.1 -> -1.1 (grad -1.1)
    #   row 1, A=-2: r=.5 -> max(1.0, 1.6) = 1.6 (clipped low, grad 0);
    #                r=4 -> max(8, 2.56) = 8 (grad -A r = 8)
    #                off-mask token -> 0
    # metrics over 5 tokens: clip_frac_high 1/5, clip_frac_low 1/5, ratio_mean (1.5+.9+1.1+.5+4)/5 = 1.6
    loss, m, grad = _ppo(None)
    np.testing.assert_allclose(loss, [[-1.28, -0.9, -1.1], [1.6, 8.0, 0.0]], **TOL)
    np.testing.assert_allclose(grad, [[0.0, -0.9, -1.1], [0.0, 8.0, 0.0]], **TOL)
    np.testing.assert_allclose(
        [m["clip_frac_high"], m["clip_frac_low"], m["dual_clip_frac"]], [0.2, 0.2, 0.0]
    )
    np.testing.assert_allclose(m["ratio_mean"], 1.6, **TOL)


def test_ppo_dual_clip_golden():
    # dual clip c = 3 on A < 0 tokens: min(loss, -A c = 6): r=4 -> min(8, 6) = 6 (grad 0); r=.5 -> min(1.6, 6)
    # = 1.6; dual_clip_frac 1/5. dual_clip_c = 0 is "off", like None.
    loss, m, grad = _ppo(3.0)
    np.testing.assert_allclose(loss, [[-1.28, -0.9, -1.1], [1.6, 6.0, 0.0]], **TOL)
    np.testing.assert_allclose(grad, [[0.0, -0.9, -1.1], [0.0, 0.0, 0.0]], **TOL)
    np.testing.assert_allclose(m["dual_clip_frac"], 0.2)
    np.testing.assert_allclose(_ppo(0.0)[0], _ppo(None)[0])
    with pytest.raises(ValueError, match="dual_clip_c"):
        _ppo(0.5)


def test_ppo_clip_token_advantages_equal_broadcast_sequence_advantages():
    # A [B] and the same values as [B,T] give identical losses.
    token_adv = jnp.broadcast_to(PPO_ADV[:, None], (2, 3))
    np.testing.assert_array_equal(_ppo(None, token_adv)[0], _ppo(None)[0])


def test_gspo_golden():
    # Row 0 (A=+1), mask [1,1], log-ratios [ln 2, 0] -> s = exp(ln2 / 2) = sqrt(2) = 1.41421 < 1 + .5:
    #   unclipped, loss -s = -1.41421 on both tokens; GSPO-token grad = -A s = -1.41421 per token.
    # Row 1 (A=-1), mask [1,0], log-ratio ln .5 (the off-mask logp is -inf and must be ignored) -> s = .5
    #   < 1 - .2: loss max(.5, .8) = .8 (clipped, grad 0), 0 off the mask.
    # metrics over 3 tokens: clip_frac_low 1/3, clip_frac_high 0, ratio_mean (2*1.41421 + .5)/3 = 1.10948.
    old = jnp.array([[-1.0, -1.0], [-2.0, -1.0]])
    logp = jnp.array([[-1.0 + math.log(2), -1.0], [-2.0 + math.log(0.5), -jnp.inf]])
    mask, adv = jnp.array([[1.0, 1], [1, 0]]), jnp.array([1.0, -1.0])
    fn = jax.jit(lambda lp: algos.gspo(lp, old, adv, mask, clip_low=0.2, clip_high=0.5))
    loss, m = fn(logp)
    grad = jit_grad(lambda lp: fn(lp)[0].sum())(logp)
    s = math.sqrt(2)
    np.testing.assert_allclose(loss, [[-s, -s], [0.8, 0.0]], **TOL)
    np.testing.assert_allclose(grad, [[-s, -s], [0.0, 0.0]], **TOL)
    np.testing.assert_allclose([m["clip_frac_low"], m["clip_frac_high"]], [1 / 3, 0.0], **TOL)
    np.testing.assert_allclose(m["ratio_mean"], (2 * s + 0.5) / 3, **TOL)


def test_gspo_token_form_has_the_sequence_objective_gradient():
    # With seq_mean_token_mean, GSPO-token's gradient equals that of the sequence-level objective
    # J = mean_b max(-A_b s_b, -A_b clip(s_b)), s_b = exp(mean_t log-ratio), differentiated directly.
    key1, key2 = jax.random.split(jax.random.key(0))
    old = jax.random.normal(key1, (4, 5)) - 2.0
    logp = old + 0.1 * jax.random.normal(key2, (4, 5))
    mask = jnp.array([[1.0] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 1, 1, 1, 1]])
    adv = jnp.array([1.0, -0.5, 2.0, -1.0])
    clip = {"clip_low": 0.05, "clip_high": 0.08}

    def token_form(lp):
        return algos.seq_mean_token_mean(algos.gspo(lp, old, adv, mask, **clip)[0], mask)

    def sequence_form(lp):
        s = jnp.exp(((lp - old) * mask).sum(1) / mask.sum(1))
        return jnp.maximum(-adv * s, -adv * jnp.clip(s, 0.95, 1.08)).mean()

    token_form, sequence_form = jax.jit(token_form), jax.jit(sequence_form)
    np.testing.assert_allclose(token_form(logp), sequence_form(logp), **TOL)
    np.testing.assert_allclose(jit_grad(token_form)(logp), jit_grad(sequence_form)(logp), **TOL)
    assert np.abs(jit_grad(sequence_form)(logp)).max() > 0.01  # not trivially all clipped


# ------------------------------------------------------------------------------------------------- KL
def test_kl_estimators_golden():
    # log r = ref - logp = [-1, 1, 0]: k1 = -log r = [1, -1, 0]; k2 = (log r)^2/2 = [.5, .5, 0];
    # k3 = e^{log r} - 1 - log r = [e^-1, e - 2, 0] = [.367879, .718282, 0].
    logp, ref = jnp.array([[-1.0, -2.0, -0.5]]), jnp.array([[-2.0, -1.0, -0.5]])
    np.testing.assert_allclose(algos.k1(logp, ref), [[1, -1, 0]], **TOL)
    np.testing.assert_allclose(algos.k2(logp, ref), [[0.5, 0.5, 0]], **TOL)
    np.testing.assert_allclose(algos.k3(logp, ref), [[math.exp(-1), math.e - 2, 0]], **TOL)


def test_kl_clamps_the_log_ratio_at_20():
    # log r = -100 -> clamped to -20: k1 = 20, k2 = 200, k3 = e^-20 - 1 + 20 = 19.0;
    # log r = +100 -> +20: k3 = e^20 - 21 = 485165174.4 (finite in float32), k1 = -20, k2 = 200.
    logp, ref = jnp.array([[0.0, -100.0]]), jnp.array([[-100.0, 0.0]])
    np.testing.assert_allclose(algos.k1(logp, ref), [[20, -20]], **TOL)
    np.testing.assert_allclose(algos.k2(logp, ref), [[200, 200]], **TOL)
    np.testing.assert_allclose(algos.k3(logp, ref), [[19.0, math.exp(20) - 21]], rtol=1e-6)
    assert algos.LOG_RATIO_CLAMP == 20.0
    np.testing.assert_array_equal(jit_grad(lambda lp: algos.k3(lp, ref).sum())(logp), [[0.0, 0.0]])


# ---------------------------------------------------------------------------------------- aggregation
# loss [[1,2,3,inf],[5,6,nan,0],[7,0,0,0]], mask [[1,1,1,0],[1,1,0,0],[0,0,0,0]] (row 2: no tokens):
#   token sums per row 6, 11, 0 (off-mask inf/nan ignored); counts 3, 2, 0; 5 tokens in all.
AGG_LOSS = jnp.array([[1.0, 2, 3, jnp.inf], [5, 6, jnp.nan, 0], [7, 0, 0, 0]])
AGG_MASK = jnp.array([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "name,default,given",
    [
        # 17/5 = 3.4; num_tokens=10 -> 1.7
        ("token_mean", 3.4, 1.7),
        # row means 2, 5.5, 0 -> 7.5/3 = 2.5; num_seqs=6 -> 1.25
        ("seq_mean_token_mean", 2.5, 1.25),
        # row sums 6 + 11 + 0 = 17 -> 17/3; num_seqs=6 -> 17/6
        ("seq_mean_token_sum", 17 / 3, 17 / 6),
        # 17 / (3 rows * 4) = 17/12; num_seqs=6, max_len=8 -> 17/48
        ("seq_mean_token_sum_norm", 17 / 12, 17 / 48),
    ],
)
def test_aggregation_golden(name, default, given):
    fn = algos.LOSS_AGGREGATIONS.get(name)
    np.testing.assert_allclose(fn(AGG_LOSS, AGG_MASK), default, **TOL)
    np.testing.assert_allclose(fn(AGG_LOSS, AGG_MASK, num_tokens=10, num_seqs=6, max_len=8), given, **TOL)
    grad = jit_grad(lambda x: fn(x, AGG_MASK))(AGG_LOSS)
    assert np.isfinite(grad).all() and (np.asarray(grad)[AGG_MASK == 0] == 0).all()


def test_drgrpo_aggregation_is_independent_of_the_padded_width():
    # The AGG rows padded from 4 to 8 columns: with max_len the generation budget (say 8), 17 / (3 * 8)
    # = 17/24 at both widths; each token's gradient is 1/24. The default (this batch's T) is not
    # constant: 17/12 at width 4, 17/24 at width 8.
    fn = algos.LOSS_AGGREGATIONS.get("seq_mean_token_sum_norm")
    wide_loss, wide_mask = (jnp.pad(x, ((0, 0), (0, 4))) for x in (AGG_LOSS, AGG_MASK))
    for loss, mask in [(AGG_LOSS, AGG_MASK), (wide_loss, wide_mask)]:
        np.testing.assert_allclose(fn(loss, mask, max_len=8), 17 / 24, **TOL)
        grad = np.asarray(jit_grad(lambda x, m=mask: fn(x, m, max_len=8))(loss))
        np.testing.assert_allclose(grad, np.asarray(mask) / 24, **TOL)
    np.testing.assert_allclose([fn(AGG_LOSS, AGG_MASK), fn(wide_loss, wide_mask)], [17 / 12, 17 / 24], **TOL)


def test_entropy_golden():
    # logits [ln 3, 0] -> p = [3/4, 1/4]: H = .75 ln(4/3) + .25 ln 4 = .215762 + .346574 = .562335;
    # uniform over 4 -> ln 4 = 1.386294.
    ent = algos.token_entropy(jnp.array([[[math.log(3), 0.0, -jnp.inf, -jnp.inf], [0.0, 0, 0, 0]]]))
    np.testing.assert_allclose(ent, [[0.5623351, math.log(4)]], **TOL)
    # bonus = -coef * token_mean(entropy): mean of [1, 2, 3] (4 is off the mask) = 2 -> -.01 * 2 = -.02.
    bonus = algos.entropy_bonus(jnp.array([[1.0, 2], [3, 4]]), jnp.array([[1.0, 1], [1, 0]]), coef=0.01)
    np.testing.assert_allclose(bonus, -0.02, **TOL)
    # with seq_mean_token_sum: row sums 3 and 3 over 2 rows = 3 -> -.03.
    bonus = algos.entropy_bonus(
        jnp.array([[1.0, 2], [3, 4]]),
        jnp.array([[1.0, 1], [1, 0]]),
        coef=0.01,
        aggregation="seq_mean_token_sum",
    )
    np.testing.assert_allclose(bonus, -0.03, **TOL)


# -------------------------------------------------------------------------------------- off-policy IS
# trainer - behaviour log-ratios: row 0 [ln .5, ln 3, ln 1.5], row 1 [ln 1.8, ln .25, (off mask)]; cap 2.
IS_RATIOS = np.array([[0.5, 3.0, 1.5], [1.8, 0.25, 7.0]])
IS_MASK = jnp.array([[1.0, 1, 1], [1, 1, 0]])
G0, G1 = 2.25 ** (1 / 3), math.sqrt(0.45)  # the rows' geometric-mean ratios: 1.310371, .670820


def _is(level, mode):
    behavior = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])
    trainer = behavior + jnp.log(jnp.asarray(IS_RATIOS, jnp.float32))
    w, m = algos.importance_weights(trainer, behavior, IS_MASK, level=level, mode=mode, cap=2.0)
    return np.asarray(w), {k: float(v) for k, v in m.items()}


@pytest.mark.parametrize(
    "level,mode,weights,mean,max_,frac",
    [
        # token: raw [.5, 3, 1.5, 1.8, .25], mean 7.05/5 = 1.41, max 3, 1 of 5 above the cap.
        ("token", "truncate", [[0.5, 2.0, 1.5], [1.8, 0.25, 0]], 1.41, 3.0, 0.2),
        ("token", "mask", [[0.5, 0.0, 1.5], [1.8, 0.25, 0]], 1.41, 3.0, 0.2),
        # sequence: products .5*3*1.5 = 2.25 (row 0, capped) and 1.8*.25 = .45 (row 1), per token;
        # mean (3*2.25 + 2*.45)/5 = 1.53, max 2.25, 3 of 5 tokens capped.
        ("sequence", "truncate", [[2.0, 2.0, 2.0], [0.45, 0.45, 0]], 1.53, 2.25, 0.6),
        ("sequence", "mask", [[0.0, 0.0, 0.0], [0.45, 0.45, 0]], 1.53, 2.25, 0.6),
        # geometric: geometric means 2.25^(1/3) = 1.310371 (row 0) and sqrt(.45) = .670820 (row 1), none
        # capped; mean (3*1.310371 + 2*.670820)/5 = 5.272754/5 = 1.054551, max 1.310371.
        ("geometric", "truncate", [[G0, G0, G0], [G1, G1, 0]], (3 * G0 + 2 * G1) / 5, G0, 0.0),
        ("geometric", "mask", [[G0, G0, G0], [G1, G1, 0]], (3 * G0 + 2 * G1) / 5, G0, 0.0),
        # none: weight 1 on the mask.
        ("none", "truncate", [[1.0, 1.0, 1.0], [1.0, 1.0, 0]], 1.0, 1.0, 0.0),
    ],
)
def test_importance_weights_golden(level, mode, weights, mean, max_, frac):
    w, m = _is(level, mode)
    np.testing.assert_allclose(w, weights, **TOL)
    np.testing.assert_allclose(
        [m["is_weight_mean"], m["is_weight_max"], m["is_frac_capped"]], [mean, max_, frac], **TOL
    )


def test_geometric_level_does_not_saturate_on_long_answers():
    # Row 0: 64 tokens, each log-ratio +.5 -> product exp(32), clamped to exp(20) and capped at 2;
    # geometric exp(.5) = 1.648721. Row 1: 4 tokens at -.25 (then padding) -> product exp(-1) = .367879,
    # geometric exp(-.25) = .778801. Cap 2, truncate.
    mask = jnp.zeros((2, 64)).at[0].set(1.0).at[1, :4].set(1.0)
    behavior = jnp.full((2, 64), -2.0)
    trainer = behavior + jnp.where(jnp.arange(2)[:, None] == 0, 0.5, -0.25) * mask
    weights = {
        level: algos.importance_weights(trainer, behavior, mask, level=level, mode="truncate", cap=2.0)
        for level in ("sequence", "geometric")
    }
    (seq_w, seq_m), (geo_w, geo_m) = weights["sequence"], weights["geometric"]
    np.testing.assert_allclose(seq_w[:, 0], [2.0, math.exp(-1)], **TOL)
    np.testing.assert_allclose(seq_m["is_weight_max"], math.exp(20), **TOL)
    np.testing.assert_allclose(geo_w[:, 0], [math.exp(0.5), math.exp(-0.25)], **TOL)
    np.testing.assert_allclose(geo_w, np.asarray(geo_w[:, :1]) * np.asarray(mask), **TOL)  # per row, 0 off
    np.testing.assert_allclose([seq_m["is_frac_capped"], geo_m["is_frac_capped"]], [64 / 68, 0.0], **TOL)


def test_importance_weights_are_stop_gradient_and_validated():
    for level in algos.IS_LEVELS.names():
        f = lambda lp, level=level: algos.importance_weights(
            lp, jnp.zeros((1, 2)), jnp.ones((1, 2)), level=level, mode="truncate", cap=2.0
        )[0].sum()
        np.testing.assert_array_equal(jit_grad(f)(jnp.array([[0.1, -0.2]])), [[0.0, 0.0]])
    args = (jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)))
    with pytest.raises(KeyError, match="importance-weight level 'seq'.*geometric, none, sequence, token"):
        algos.importance_weights(*args, level="seq", mode="mask", cap=2.0)
    with pytest.raises(KeyError, match="importance-weight mode 'clip'.*mask, truncate"):
        algos.importance_weights(*args, level="token", mode="clip", cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        algos.importance_weights(*args, level="token", mode="mask", cap=0.0)


# --------------------------------------------------------------------------------------------- DAPO
def test_dynamic_sampling_mask_golden():
    # group 0 [1, 1]: all equal -> drop; group 1 [0, 1] -> keep; group 2 [.5, .5] -> drop;
    # group 3 [1] (one sequence) -> drop. 5 of 7 sequences dropped.
    keep, frac = algos.dynamic_sampling_mask(
        jnp.array([1.0, 1, 0, 1, 0.5, 0.5, 1]), jnp.array([0, 0, 1, 1, 2, 2, 3]), 4
    )
    np.testing.assert_array_equal(keep, [False, False, True, True, False, False, False])
    np.testing.assert_allclose(frac, 5 / 7, **TOL)


def test_overlong_penalty_golden():
    # max_len 100, buffer 20: no penalty up to 80; 81 -> -(1/20) = -.05; 90 -> -.5; 100 -> -1; 120 -> -1
    # (capped at -penalty). With penalty .5 everything halves.
    lengths = jnp.array([50, 80, 81, 90, 100, 120], jnp.int32)
    out = algos.overlong_penalty(lengths, max_len=100, buffer=20, penalty=1.0)
    np.testing.assert_allclose(out, [0, 0, -0.05, -0.5, -1, -1], **TOL)
    half = algos.overlong_penalty(lengths, max_len=100, buffer=20, penalty=0.5)
    np.testing.assert_allclose(half, [0, 0, -0.025, -0.25, -0.5, -0.5], **TOL)
    with pytest.raises(ValueError, match="buffer"):
        algos.overlong_penalty(lengths, max_len=100, buffer=0, penalty=1.0)
