"""Attention implementations side by side: fwd+bwd time and parity against the first one named.

Command (GPU: cuDNN vs blockwise at Qwen2.5-7B's attention shape, 2 x 4096 tokens, bf16):
    python benchmarks/bench_attention.py --impls cudnn,blockwise --batch 2 --length 4096 --heads 28 \
        --kv-heads 4 --head-dim 128 --dtype bfloat16 [--json out.json]
On CPU use small shapes and e.g. --impls blockwise,materialized. Inputs: causal self-attention over rows of
two packed segments each (`rljax.models.ATTENTION_IMPLS` signature). Prints, per impl, the median wall time
of one jitted value_and_grad of sum(out * w) w.r.t. q, k, v, and the largest absolute difference of the
output and the gradients from the first impl's, relative to that impl's largest magnitude.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import ATTENTION_IMPLS


def make_inputs(args: argparse.Namespace):
    """(q, k, v) in the dtype, the mask description, and the output cotangent w (f32)."""
    rng = np.random.default_rng(0)
    b, t = args.batch, args.length
    q, k, v = (
        jnp.asarray(rng.normal(size=(b, t, n, args.head_dim)), args.dtype)
        for n in (args.heads, args.kv_heads, args.kv_heads)
    )
    segments = jnp.asarray(np.repeat([[1, 2]], [t // 2 + t % 2, t // 2], axis=1).repeat(b, 0), jnp.int32)
    slots = jnp.arange(t, dtype=jnp.int32)
    mask = dict(q_slots=slots, k_slots=slots, q_segments=segments, k_segments=segments)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    return (q, k, v), mask, w


def make_step(name: str, block_size: int):
    """jit(q, k, v, mask, w) -> ((loss, out), grads); mask and w are arguments, not closed-over constants
    (XLA would constant-fold transposes of captured arrays at compile time)."""
    fn = ATTENTION_IMPLS.get(name)

    def loss(q, k, v, mask, w):
        out = fn(q, k, v, **mask, block_size=block_size)
        return jnp.sum(out.astype(jnp.float32) * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def rel_max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def measure(args: argparse.Namespace) -> dict:
    """{impl: {"seconds", "rel_diff"} or {"error"}}; rel_diff is against the first impl that ran."""
    qkv, mask, w = make_inputs(args)
    results, outputs, steps = {}, {}, {}
    for name in args.impls.split(","):
        try:
            steps[name] = make_step(name, args.block_size)
            (_, out), grads = steps[name](*qkv, mask, w)
            outputs[name] = jax.device_get((out, grads))
            results[name] = {}
        except Exception as e:  # noqa: BLE001 (one impl failing must not hide the others' figures)
            steps.pop(name, None)
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    times = {name: [] for name in steps}
    for _ in range(args.iters):
        for name, step in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(*qkv, mask, w))
            times[name].append(time.perf_counter() - t0)
    base = next(iter(outputs.values()), None)
    for name in steps:
        results[name]["seconds"] = statistics.median(times[name])
        (out, grads), (out0, grads0) = outputs[name], base
        diffs = [rel_max_diff(out, out0)] + [rel_max_diff(g, g0) for g, g0 in zip(grads, grads0, strict=True)]
        results[name]["rel_diff"] = max(diffs)
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="cudnn,blockwise", help="comma-separated ATTENTION_IMPLS names")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"backend={jax.default_backend()} B={args.batch} T={args.length} H={args.heads} K={args.kv_heads} "
          f"hd={args.head_dim} dtype={args.dtype}")  # fmt: skip
    results = measure(args)
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<13} FAILED: {r['error']}")
        else:
            print(f"{name:<13} fwd+bwd {r['seconds'] * 1e3:9.2f} ms   rel max diff {r['rel_diff']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": jax.default_backend(), **vars(args), "impls": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
