"""Update-step throughput of the GRPO train step and the share of time spent in log-prob computation.

Command (CPU or GPU; ~1-2 minutes on 2 CPU cores):
    .venv/bin/python benchmarks/bench_train_step.py [--rows 32] [--length 64] [--iters 5] [--impl auto]
Model: a random Qwen2-family decoder (vocab 8192, hidden 256, 4 layers, MLP 2048, untied head: ~11M
params) built with rljax.models.init_params. Prints tokens/s of one optimizer step (fwd+bwd+AdamW) and
the time of the head's fwd+bwd through rljax.kernels.token_logprobs alone, as a ratio of the step
measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax import kernels, models, trainer
from rljax.config import Config, TrainerConfig
from rljax.sharding import make_mesh
from rljax.types import LossInputs


def timed(fn, iters: int) -> float:
    """Median wall seconds of `fn()` (which must block) after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def make_batch(rows: int, length: int, vocab: int, seed: int = 0) -> trainer.TrainBatch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(rows, length)).astype(np.int32)
    tgt = np.concatenate([ids[:, 1:], np.zeros((rows, 1), np.int32)], axis=1)
    mask = np.zeros((rows, length), np.float32)
    mask[:, length // 4 : length - 1] = 1.0  # a quarter prompt, the rest sampled
    logp = (-5.0 * mask).astype(np.float32)
    li = LossInputs(
        input_ids=ids,
        target_ids=tgt,
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
        segment_ids=np.ones((rows, length), np.int32),
        loss_mask=mask,
        behavior_logp=logp,
        advantages=rng.normal(size=rows).astype(np.float32),
        rewards=np.zeros(rows, np.float32),
        group_ids=np.zeros(rows, np.int32),
        policy_version=np.zeros(rows, np.int32),
    )
    return trainer.TrainBatch(inputs=li, old_logp=logp, advantages=li.advantages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--impl", default="auto")
    args = ap.parse_args()
    mc = models.ModelConfig(
        family="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=2048, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=64, attention_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    params = jax.device_get(models.init_params(mc, jax.random.key(0)))
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    cfg = dataclasses.replace(Config(), trainer=TrainerConfig(logprob_impl=args.impl))
    mesh = make_mesh(1, -1, 1)
    state = trainer.init_train_state(cfg, mc, params, mesh)
    step = trainer.make_train_step(cfg, mc, mesh)
    batch = trainer.shard_batch(make_batch(args.rows, args.length, mc.vocab_size), mesh)
    holder = {"state": state}

    def run_step():
        holder["state"], m = step(holder["state"], batch)
        jax.block_until_ready(m)

    step_s = timed(run_step, args.iters)
    n = args.rows * args.length
    hidden = jax.random.normal(jax.random.key(1), (n, mc.hidden_size), jnp.float32)
    unembed = jnp.asarray(params["lm_head"]["kernel"])
    targets = jnp.asarray(batch.inputs.target_ids).reshape(n)

    def head_loss(h, u):
        logp, ent = kernels.token_logprobs(h, u, targets, return_entropy=True, impl=args.impl)
        return logp.sum() + 0.01 * ent.sum()

    head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
    head_s = timed(lambda: jax.block_until_ready(head(hidden, unembed)), args.iters)
    print(
        f"backend={jax.default_backend()} devices={jax.device_count()} impl={kernels.resolve_impl(args.impl)}"
    )
    print(f"model params={n_params / 1e6:.1f}M  batch={args.rows}x{args.length} ({n} tokens)")
    print(f"update step: {step_s * 1e3:.1f} ms  -> {n / step_s:,.0f} tokens/s")
    print(
        f"log-prob head fwd+bwd (token_logprobs): {head_s * 1e3:.1f} ms = {head_s / step_s:.1%} of the step"
    )


if __name__ == "__main__":
    main()
