"""Update-step throughput and MFU of the GRPO train step, and the share of time spent in log-prob computation.

Command (CPU or GPU; ~1-2 minutes on 2 CPU cores with the default small model):
    .venv/bin/python benchmarks/bench_train_step.py [--model small|qwen2.5-0.5b] [--rows 32] [--length 64]
        [--iters 5] [--impl auto] [--compute-dtype float32|bfloat16] [--remat full] [--attention-impl auto]
        [--num-layers N] [--json out.json]
Models: random Qwen2-family decoders built with rljax.models.init_params: `small` (vocab 8192, hidden 256,
4 layers, MLP 2048, untied head: ~11M params) or `qwen2.5-0.5b` (Qwen2.5-0.5B's shape: vocab 151936, hidden
896, 24 layers, 14 heads / 2 KV heads, MLP 4864, tied embeddings: 494M params). Prints tokens/s of one
optimizer step (fwd+bwd+AdamW), its MFU, and the time of the head's fwd+bwd through
rljax.kernels.token_logprobs alone, as a ratio of the step measured in the same run, and the step's compile
time (`compile_s`: lower + compile; the layers are one scanned body, so it should not grow with
--num-layers). The decoder is the NNX module of rljax.models, run through its pure params.

MFU = model FLOP/s / the device's peak dense bf16 FLOP/s (`PEAK_BF16_FLOPS` by device kind, or
--peak-flops). Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): 6 * N + 12 * L * H * T, with N
the parameters that enter a matmul (the input embedding table counts only when tied, as the head), L layers,
H = heads * head_dim, T the row length; rematerialised recomputation is not counted (it is overhead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax import kernels, models, trainer
from rljax.config import Config, TrainerConfig
from rljax.sharding import make_mesh
from rljax.types import LossInputs

MODELS = {
    "small": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=2048, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, tie_word_embeddings=False,
    ),
    # Qwen2.5-0.5B's config.json (hidden 896, 24 layers, 14 query / 2 KV heads of 64, MLP 4864, tied).
    "qwen2.5-0.5b": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, tie_word_embeddings=True, rope_theta=1000000.0,
    ),
    # Qwen2.5-1.5B's config.json (hidden 1536, 28 layers, 12 query / 2 KV heads of 128, MLP 8960, tied).
    "qwen2.5-1.5b": dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0,
    ),
}  # fmt: skip

# Peak dense bf16 FLOP/s by `device_kind` substring (NVIDIA datasheets, SXM parts, without sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device: jax.Device, override: float | None) -> float | None:
    """The device's peak dense bf16 FLOP/s (None when unknown, e.g. on CPU)."""
    if override:
        return override
    return next((f for k, f in PEAK_BF16_FLOPS.items() if k in device.device_kind), None)


def flops_per_token(mc: models.ModelConfig, params: dict, length: int) -> float:
    """Training FLOPs per token: 6 * matmul params + 12 * layers * heads * head_dim * length (docstring)."""
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    if not mc.tie_word_embeddings:
        n_params -= mc.vocab_size * mc.hidden_size  # an untied input embedding is a lookup, not a matmul
    return 6.0 * n_params + 12.0 * mc.num_layers * mc.num_heads * mc.head_dim * length


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--impl", default="auto", help="log-prob kernel (rljax.kernels IMPLS, or auto)")
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remat", default="full", help="a name in rljax.models.REMAT_POLICIES")
    ap.add_argument(
        "--attention-impl", default="auto", help="a name in rljax.models.ATTENTION_IMPLS, or auto"
    )
    ap.add_argument("--num-layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU (default: by device)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return ap.parse_args(argv)


def build(args: argparse.Namespace):
    """(model config, host params, train step, state, sharded batch) for the chosen model and options."""
    shape = dict(MODELS[args.model], **({"num_layers": args.num_layers} if args.num_layers else {}))
    mc = models.ModelConfig(family="qwen2", attention_bias=True, **shape)
    params = jax.device_get(models.init_params(mc, jax.random.key(0)))
    model = dataclasses.replace(
        Config().model, compute_dtype=args.compute_dtype, remat=args.remat, attention_impl=args.attention_impl
    )
    cfg = dataclasses.replace(Config(), model=model, trainer=TrainerConfig(logprob_impl=args.impl))
    mesh = make_mesh(1, -1, 1)
    state = trainer.init_train_state(cfg, mc, params, mesh)
    step = trainer.make_train_step(cfg, mc, mesh)
    batch = trainer.shard_batch(make_batch(args.rows, args.length, mc.vocab_size), mesh)
    return mc, params, step, state, batch


def time_head(args, mc, params, batch) -> float:
    """Median seconds of the log-prob head's fwd+bwd alone, at the step's tokens and compute dtype."""
    n = args.rows * args.length
    dtype = jnp.dtype(args.compute_dtype)
    hidden = jax.random.normal(jax.random.key(1), (n, mc.hidden_size), dtype)
    unembed = jnp.asarray(models.unembed_matrix(mc, params), dtype)
    targets = jnp.asarray(batch.inputs.target_ids).reshape(n)

    def head_loss(h, u):
        logp, ent = kernels.token_logprobs(h, u, targets, return_entropy=True, impl=args.impl)
        return logp.sum() + 0.01 * ent.sum()

    head = jax.jit(jax.grad(head_loss, argnums=(0, 1)))
    return timed(lambda: jax.block_until_ready(head(hidden, unembed)), args.iters)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    mc, params, step, state, batch = build(args)
    t0 = time.perf_counter()
    step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def run_step():
        holder["state"], m = step(holder["state"], batch)
        jax.block_until_ready(m)

    step_s = timed(run_step, args.iters)
    head_s = time_head(args, mc, params, batch)
    n = args.rows * args.length
    peak = peak_flops(jax.devices()[0], args.peak_flops)
    model_flops = flops_per_token(mc, params, args.length) * n / step_s
    out = {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "model": args.model,
        "params": sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)),
        "num_layers": mc.num_layers,
        "compile_s": compile_s,
        "rows": args.rows,
        "length": args.length,
        "compute_dtype": args.compute_dtype,
        "remat": args.remat,
        "impl": kernels.resolve_impl(args.impl),
        "attention_impl": models.resolve_attention_impl(args.attention_impl, args.compute_dtype),
        "step_s": step_s,
        "tokens_per_s": n / step_s,
        "model_tflops_per_s": model_flops / 1e12,
        "mfu": None if peak is None else model_flops / peak,
        "head_s": head_s,
        "head_share": head_s / step_s,
    }
    mfu = "n/a (unknown peak)" if out["mfu"] is None else f"{out['mfu']:.1%}"
    print(f"backend={out['backend']} ({out['device_kind']}) devices={out['devices']} impl={out['impl']} "
          f"attention={out['attention_impl']} dtype={args.compute_dtype} remat={args.remat}")  # fmt: skip
    print(
        f"model {args.model} layers={mc.num_layers} params={out['params'] / 1e6:.1f}M  "
        f"batch={args.rows}x{args.length} ({n} tokens)  compile {compile_s:.2f} s"
    )
    print(f"update step: {step_s * 1e3:.1f} ms  -> {n / step_s:,.0f} tokens/s, "
          f"{model_flops / 1e12:.1f} model TFLOP/s, MFU {mfu}")  # fmt: skip
    print(
        f"log-prob head fwd+bwd (token_logprobs): {head_s * 1e3:.1f} ms = {head_s / step_s:.1%} of the step"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
