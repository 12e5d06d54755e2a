# %% [markdown]
# # 04 · RL algorithms on toy data: advantages, clipping, KL estimators
#
# Every function here is the one the trainer uses (`rljax.algos`), called on small hand-made inputs, so the
# plots can be checked by eye and the `assert`s check the math. Runs in well under a minute on a CPU.

# %% [install]

# %%
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import matplotlib

if "ipykernel" not in sys.modules:  # run as a script: no frontend to draw into
    matplotlib.use("Agg")
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from rljax import algos

print("advantages:", algos.ADVANTAGES.names())
print("policy losses:", algos.POLICY_LOSSES.names())
print("KL estimators:", algos.KL_ESTIMATORS.names())
print("aggregations:", algos.LOSS_AGGREGATIONS.names())

# %% [markdown]
# ## 1. Group-relative advantages
#
# Four prompts, eight samples each, with 1, 4, 7 and 8 correct answers (reward 1). GRPO centres each group
# and divides by its std; Dr. GRPO only centres; RLOO uses the leave-one-out mean; REINFORCE++ normalizes
# over the whole batch. A group whose rewards all agree carries no signal: its advantages are exactly 0.

# %%
num_groups, group_size = 4, 8
correct = [1, 4, 7, 8]
rewards = np.concatenate([np.r_[np.ones(c), np.zeros(group_size - c)] for c in correct]).astype(np.float32)
group_ids = np.repeat(np.arange(num_groups), group_size).astype(np.int32)
adv = {
    name: np.asarray(algos.ADVANTAGES.get(name)(rewards=rewards, group_ids=group_ids, num_groups=num_groups))
    for name in algos.ADVANTAGES.names()
}

fig, axes = plt.subplots(1, len(adv), figsize=(3.2 * len(adv), 3), sharey=True)
for ax, (name, a) in zip(axes, adv.items(), strict=True):
    ax.bar(np.arange(rewards.size), a, color=np.where(rewards > 0, "tab:green", "tab:red"))
    for g in range(1, num_groups):
        ax.axvline(g * group_size - 0.5, color="gray", lw=0.5)
    ax.set_title(name)
    ax.set_xlabel("sample (groups of 8)")
axes[0].set_ylabel("advantage (green: correct)")
plt.tight_layout()
plt.show()

for name in ("grpo", "drgrpo", "rloo"):
    per_group = adv[name].reshape(num_groups, group_size)
    assert np.allclose(per_group.mean(axis=1), 0.0, atol=1e-6), name  # group-centred
    assert np.all(per_group[3] == 0.0), name  # all-correct group: exactly zero
np.testing.assert_allclose(adv["rloo"], group_size / (group_size - 1) * adv["drgrpo"], rtol=1e-6)
print("checks passed: group means 0, all-agree group 0, RLOO = n/(n-1) * Dr. GRPO")

# %% [markdown]
# **Difficulty bias.** With std scaling, a correct answer in a group with success rate `p` gets advantage
# `(1-p)/std = sqrt((1-p)/p)` (population std), which explodes for hard prompts; Dr. GRPO's `1-p` does not.

# %%
p = np.arange(1, group_size) / group_size
a_grpo, a_dr = [], []
for k in range(1, group_size):
    r = np.r_[np.ones(k), np.zeros(group_size - k)].astype(np.float32)
    g = np.zeros(group_size, np.int32)
    a_grpo.append(float(algos.grpo(rewards=r, group_ids=g, num_groups=1)[0]))
    a_dr.append(float(algos.drgrpo(rewards=r, group_ids=g, num_groups=1)[0]))
std = np.sqrt(p * (1 - p) * group_size / (group_size - 1))  # the unbiased group std rljax uses
np.testing.assert_allclose(a_grpo, (1 - p) / (std + 1e-6), rtol=1e-5)
np.testing.assert_allclose(a_dr, 1 - p, rtol=1e-6)
plt.figure(figsize=(4.5, 3))
plt.plot(p, a_grpo, "o-", label="grpo (std-scaled)")
plt.plot(p, a_dr, "s-", label="drgrpo (centred only)")
plt.xlabel("group success rate p")
plt.ylabel("advantage of a correct sample")
plt.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2. PPO clipping: loss and gradient as a function of the ratio
#
# `ppo_clip` per token: `max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`. The gradient w.r.t. `logp` is zero
# where the clip is active (ratio beyond `1+eps_high` for A > 0, below `1-eps_low` for A < 0). DAPO's
# clip-higher raises `eps_high`; dual clip bounds the loss of negative-advantage tokens at `-A c`.

# %%
ratios = np.linspace(0.3, 4.0, 400).astype(np.float32)
logp = jnp.log(ratios)[None, :]
old = jnp.zeros_like(logp)
mask = jnp.ones_like(logp)
variants = {
    "ppo 0.2/0.2": dict(clip_low=0.2, clip_high=0.2),
    "clip-higher 0.2/0.28": dict(clip_low=0.2, clip_high=0.28),
    "dual clip c=3": dict(clip_low=0.2, clip_high=0.2, dual_clip_c=3.0),
}


def loss_and_grad(a, options):
    def total(lp):
        per_token, _ = algos.ppo_clip(lp, old, jnp.full((1,), a), mask, **options)
        return per_token.sum(), per_token

    (_, per_token), grad = jax.value_and_grad(total, has_aux=True)(logp)
    return np.asarray(per_token[0]), np.asarray(grad[0])


fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
for col, a in enumerate((1.0, -1.0)):
    for name, options in variants.items():
        loss, grad = loss_and_grad(a, options)
        axes[0, col].plot(ratios, loss, label=name)
        axes[1, col].plot(ratios, grad, label=name)
    axes[0, col].set_title(f"advantage A = {a:+.0f}")
    axes[1, col].set_xlabel("ratio pi / pi_old")
axes[0, 0].set_ylabel("per-token loss")
axes[1, 0].set_ylabel("d loss / d logp")
axes[0, 1].legend()
plt.tight_layout()
plt.show()

loss, grad = loss_and_grad(1.0, variants["ppo 0.2/0.2"])
assert np.all(grad[ratios > 1.2 + 1e-3] == 0) and np.all(grad[ratios < 1.2 - 1e-3] < 0)
loss, grad = loss_and_grad(-1.0, variants["dual clip c=3"])
assert np.all(grad[ratios < 0.8 - 1e-3] == 0) and np.all(grad[ratios > 3.0 + 1e-3] == 0)
np.testing.assert_allclose(loss[ratios > 3.0 + 1e-3], 3.0, rtol=1e-6)  # bounded at -A * c
print("checks passed: zero gradient exactly where the clip is active; dual clip bounds the loss at 3")

# %% [markdown]
# ## 3. KL estimators: bias and spread
#
# Tokens are sampled from the policy `pi`; each estimator turns `(logp, ref_logp)` of a sampled token into
# a per-token estimate of KL(pi || ref). Here `pi` and `ref` are softmaxes over a 64-token vocab whose
# logits differ by `scale * noise`. k1 (`log pi/ref`) and k3 (`r - 1 - log r`, r = ref/pi) are unbiased;
# k3 is never negative and has lower variance; k2 (`(log r)^2 / 2`) is biased but low-variance.

# %%
rng = np.random.default_rng(0)
vocab, samples = 64, 20000
base, noise = rng.normal(size=vocab), rng.normal(size=vocab)
scales = np.linspace(0.05, 1.5, 12)
stats = {name: [] for name in algos.KL_ESTIMATORS.names()}
exact = []
for s in scales:
    logp_all = np.asarray(jax.nn.log_softmax(base + s * noise))
    ref_all = np.asarray(jax.nn.log_softmax(base))
    exact.append(float(np.sum(np.exp(logp_all) * (logp_all - ref_all))))
    tokens = rng.choice(vocab, size=samples, p=np.exp(logp_all) / np.exp(logp_all).sum())
    lp, rp = jnp.asarray(logp_all[tokens])[None], jnp.asarray(ref_all[tokens])[None]
    for name in stats:
        k = np.asarray(algos.KL_ESTIMATORS.get(name)(lp, rp))[0]
        stats[name].append((k.mean(), k.std()))
exact = np.asarray(exact)

fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
axes[0].plot(exact, exact, "k--", label="exact KL")
for name, st in stats.items():
    m, sd = np.asarray(st).T
    axes[0].plot(exact, m, "o-", label=name)
    axes[1].plot(exact, sd, "o-", label=name)
axes[0].set_xlabel("exact KL(pi || ref)")
axes[0].set_ylabel("mean estimate")
axes[1].set_xlabel("exact KL(pi || ref)")
axes[1].set_ylabel("per-token std")
axes[0].legend()
plt.tight_layout()
plt.show()

for name in ("k1", "k3"):  # unbiased: mean within 5 standard errors of the exact value
    m, sd = np.asarray(stats[name]).T
    assert np.all(np.abs(m - exact) < 5 * sd / np.sqrt(samples) + 1e-6), name
k3_sd, k1_sd = np.asarray(stats["k3"])[:, 1], np.asarray(stats["k1"])[:, 1]
assert np.all(k3_sd[:4] < k1_sd[:4])  # near pi = ref, k3 has the smaller spread
print("checks passed: k1 and k3 unbiased; k3 lower variance than k1 for small KL")

# %% [markdown]
# ## 4. GAE on one masked trajectory
#
# Outcome reward 1 on the last response token, a critic predicting 0.5 everywhere, and a masked gap (a tool's
# output) in the middle: `gae` bootstraps nothing across the gap. With gamma = lambda = 1 the advantage of
# every token before the gap's end is `return - V`.

# %%
T = 12
mask = np.ones((1, T), np.float32)
mask[0, 5:7] = 0.0  # two inserted (tool) tokens
rewards_t = np.zeros((1, T), np.float32)
rewards_t[0, -1] = 1.0
values = np.full((1, T), 0.5, np.float32)
plt.figure(figsize=(6, 3))
for lam in (0.0, 0.9, 1.0):
    a, ret = algos.gae(rewards=rewards_t, values=values, mask=mask, gamma=1.0, lam=lam)
    plt.plot(np.arange(T), np.asarray(a)[0], "o-", label=f"lambda={lam}")
plt.bar(np.arange(T), 1 - mask[0], color="lightgray", label="masked (tool output)")
plt.xlabel("token")
plt.ylabel("advantage")
plt.legend()
plt.tight_layout()
plt.show()
a1, _ = algos.gae(rewards=rewards_t, values=values, mask=mask, gamma=1.0, lam=1.0)
np.testing.assert_allclose(np.asarray(a1)[0, 7:], 0.5, rtol=1e-6)  # R - V after the gap
assert np.all(np.asarray(a1)[0, 5:7] == 0.0)
print("checks passed: gamma = lambda = 1 gives R - V; masked tokens get 0")

# %% [markdown]
# ## 5. Trainer-vs-rollout importance weights
#
# `importance_weights` corrects for the rollout engine's log-probs differing from the trainer's. Token level:
# `w = exp(trainer - behavior)`; "truncate" caps it at `cap`, "mask" drops tokens above it.

# %%
log_ratio = np.linspace(-2.0, 2.0, 201).astype(np.float32)[None]
trainer_lp, behavior_lp, m = (
    jnp.asarray(log_ratio) - 1.0,
    jnp.full_like(log_ratio, -1.0),
    jnp.ones_like(log_ratio),
)
plt.figure(figsize=(5, 3))
for mode in ("truncate", "mask"):
    w, _ = algos.importance_weights(trainer_lp, behavior_lp, m, level="token", mode=mode, cap=2.0)
    plt.plot(np.exp(log_ratio[0]), np.asarray(w)[0], label=mode)
plt.xlabel("raw ratio pi_trainer / pi_rollout")
plt.ylabel("weight used")
plt.legend()
plt.tight_layout()
plt.show()
w, metrics = algos.importance_weights(trainer_lp, behavior_lp, m, level="token", mode="truncate", cap=2.0)
assert float(jnp.max(w)) <= 2.0 + 1e-6
print({k: round(float(v), 4) for k, v in metrics.items()})

# %% [markdown]
# ## 6. Loss aggregation: who weighs what
#
# A short (4-token) and a long (16-token) response with the same per-token loss 1. `token_mean` weighs every
# token alike (the long answer counts 4x), `seq_mean_token_mean` weighs every sequence alike, and
# `seq_mean_token_sum_norm` (Dr. GRPO) divides by a constant budget.

# %%
mask2 = np.zeros((2, 16), np.float32)
mask2[0, :4], mask2[1, :] = 1.0, 1.0
weights = {}
for name in algos.LOSS_AGGREGATIONS.names():
    agg = algos.LOSS_AGGREGATIONS.get(name)
    # d(aggregate)/d(per-token loss): the weight each token gets
    weights[name] = np.asarray(jax.grad(lambda x, agg=agg: agg(x, jnp.asarray(mask2)))(jnp.ones((2, 16))))
plt.figure(figsize=(6, 3))
names = list(weights)
plt.bar(np.arange(len(names)) - 0.2, [weights[n][0, 0] for n in names], 0.4, label="token of short answer")
plt.bar(np.arange(len(names)) + 0.2, [weights[n][1, 0] for n in names], 0.4, label="token of long answer")
plt.xticks(np.arange(len(names)), names, rotation=20)
plt.ylabel("weight per token")
plt.legend()
plt.tight_layout()
plt.show()
np.testing.assert_allclose(weights["token_mean"][0, 0], 1 / 20, rtol=1e-6)
np.testing.assert_allclose(weights["seq_mean_token_mean"][0, 0], 1 / (2 * 4), rtol=1e-6)
np.testing.assert_allclose(weights["seq_mean_token_mean"][1, 0], 1 / (2 * 16), rtol=1e-6)
print("checks passed: token weights of each aggregation")
