"""A plain JAX/optax GRPO update for Qwen2 checkpoints, written for speed: bench_update's floor.

No rljax code: the weights are read from the checkpoint's safetensors by name, the layers are an unrolled
Python loop over per-layer dicts (XLA sees one straight-line program), attention materializes its scores
with a causal mask, the head builds the `[B, C, V]` logits of the completion positions only and takes
`log_softmax`, and the loss is GRPO's clipped surrogate with on-policy old log-probs (`stop_gradient` of the
same forward), averaged over the completion tokens. Global-norm clipping + AdamW (optax), parameters and
optimizer state donated. This is what a researcher writes for one model at short lengths; it keeps every
activation (no remat).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax


def load_qwen2(path: str | Path) -> tuple[dict, dict]:
    """(config.json dict, params) of a Qwen2 (or Llama without RoPE scaling: zero q/k/v biases) HF
    checkpoint: float32 arrays, matrices as `x @ w`."""
    from safetensors.numpy import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    t = {}
    for f in sorted(path.glob("*.safetensors")):
        t |= load_file(str(f))
    f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))  # noqa: E731
    zeros = lambda n: jnp.zeros((n,), jnp.float32)  # noqa: E731  (Llama: no q/k/v biases)
    bias = lambda name, n: f32(t[name]) if name in t else zeros(n)  # noqa: E731
    h, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // h
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w = lambda name, p=p: f32(t[p + name + ".weight"].T)  # noqa: E731
        layers.append({
            "ln1": f32(t[p + "input_layernorm.weight"]),
            "ln2": f32(t[p + "post_attention_layernorm.weight"]),
            "wq": w("self_attn.q_proj"), "bq": bias(p + "self_attn.q_proj.bias", h * hd),
            "wk": w("self_attn.k_proj"), "bk": bias(p + "self_attn.k_proj.bias", k * hd),
            "wv": w("self_attn.v_proj"), "bv": bias(p + "self_attn.v_proj.bias", k * hd),
            "wo": w("self_attn.o_proj"),
            "wg": w("mlp.gate_proj"), "wu": w("mlp.up_proj"), "wd": w("mlp.down_proj"),
        })  # fmt: skip
    params = {"embed": f32(t["model.embed_tokens.weight"]), "norm": f32(t["model.norm.weight"])}
    params["layers"] = layers
    if not cfg.get("tie_word_embeddings", False):
        params["head"] = f32(t["lm_head.weight"])
    return cfg, params


def rms_norm(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def forward_logp(cfg: dict, params: dict, ids: jax.Array, first: int = 0) -> jax.Array:
    """f32[B, T-1-first]: log p(ids[:, t+1] | ids[:, :t+1]) for t >= first (the head runs there only)."""
    b, t = ids.shape[0], ids.shape[1] - 1
    h, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = cfg["hidden_size"] // h, cfg["rms_norm_eps"]
    inv = 1.0 / cfg.get("rope_theta", 10000.0) ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[None, :, None, :]
    causal = jnp.tril(jnp.ones((t, t), bool))
    x = params["embed"][ids[:, :-1]]
    for lp in params["layers"]:
        y = rms_norm(x, lp["ln1"], eps)
        q = rope((y @ lp["wq"] + lp["bq"]).reshape(b, t, h, hd), cos, sin)
        kk = rope((y @ lp["wk"] + lp["bk"]).reshape(b, t, k, hd), cos, sin)
        v = (y @ lp["wv"] + lp["bv"]).reshape(b, t, k, hd)
        q = q.reshape(b, t, k, h // k, hd)
        s = jnp.einsum("btkgd,bskd->bkgts", q, kk) * hd**-0.5
        p = jax.nn.softmax(jnp.where(causal, s, -1e30), axis=-1)
        o = jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, h * hd)
        x = x + o @ lp["wo"]
        y = rms_norm(x, lp["ln2"], eps)
        x = x + (jax.nn.silu(y @ lp["wg"]) * (y @ lp["wu"])) @ lp["wd"]
    x = rms_norm(x[:, first:], params["norm"], eps)
    logits = x @ params.get("head", params["embed"]).T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, ids[:, first + 1 :, None], axis=-1)[..., 0]


def grpo_loss(cfg: dict, params: dict, ids, first: int, adv, clip: float = 0.2):
    """GRPO's clipped surrogate over the completion tokens (ids[:, first + 1:]), on-policy (old =
    stop_gradient(logp)), token mean."""
    logp = forward_logp(cfg, params, ids, first)
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
    a = adv[:, None]
    return -jnp.mean(jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a))


def make_plain_update(
    path: str | Path, prompts: np.ndarray, completions: np.ndarray, adv: np.ndarray, lr: float = 1e-6
):
    """`fn()`: one blocking update (value_and_grad + clip + AdamW) on prompts i32[B,P] + completions
    i32[B,C] (no padding: every completion is C tokens)."""
    cfg, params = load_qwen2(path)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))
    first = prompts.shape[1] - 1

    def step(params, opt_state, ids, adv):
        loss, grads = jax.value_and_grad(lambda p: grpo_loss(cfg, p, ids, first, adv))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    held = {"params": params, "opt_state": opt.init(params)}
    batch = jax.device_put((np.concatenate([prompts, completions], axis=1), adv))

    def run() -> None:
        held["params"], held["opt_state"], loss = step(held["params"], held["opt_state"], *batch)
        jax.block_until_ready(loss)

    return run
