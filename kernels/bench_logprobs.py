"""Benchmark of token_logprobs forward+backward: compiled temporary memory and wall time per impl.

Run: python -m rljax.kernels.bench_logprobs --n 2048 --d 896 --v 151936 --dtype float32 [--json out.json]
Prints, for each impl available on the default backend, the compiled temp memory
(`jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`) and the median wall time of one
jitted value_and_grad step (w.r.t. hidden and unembed), each also as a ratio against `reference` measured in
the same run (and the speed-up over `xla`), plus each impl's relative error against `reference` (loss and both
gradients). Timed runs of the impls are interleaved so background load hits them alike. An impl that fails
to build or run is reported with its error; the others are still measured.
GPU acceptance shape (Qwen2.5-7B's head, 8k tokens): --n 8192 --d 3584 --v 152064 --dtype bfloat16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .api import RUNS_ON, resolve_impl, token_logprobs
from .triton_gpu import triton_available


def default_impls(backend: str) -> list[str]:
    """Impls worth timing on `backend` (Pallas runs only interpreted on CPU: far too slow to time there)."""
    compiled = [name for name, on in RUNS_ON.items() if on is not None and backend in on and backend != "cpu"]
    return ["reference", "xla"] + [n for n in compiled if n != "triton" or triton_available()]


def make_step(impl: str, targets: jax.Array, cotangent: jax.Array, entropy: bool, block_size: int | None):
    """Jitted fwd+bwd step: (hidden [N,d], unembed [V,d]) -> (loss, (d hidden, d unembed))."""

    def loss(hidden, unembed):
        out = token_logprobs(
            hidden, unembed, targets, return_entropy=entropy, impl=impl, block_size=block_size
        )
        if entropy:
            return jnp.sum(out[0] * cotangent) + 0.01 * jnp.sum(out[1] * cotangent)
        return jnp.sum(out * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def temp_bytes(step: Callable, *args) -> int:
    """Compiled temporary memory of `step` (no execution)."""
    return int(step.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def time_once(step: Callable, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(n: int, d: int, v: int, dtype: str, impls: list[str], repeats: int, entropy: bool, block_size):
    """Measures every impl; returns {impl: {"temp_bytes", "seconds", "rel_err"} or {"error": message}}."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(n, d)), dtype)
    unembed = jnp.asarray(rng.normal(size=(v, d)) / np.sqrt(d), dtype)
    targets = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    cotangent = jnp.asarray(rng.random(n) < 0.8, jnp.float32)  # a loss mask
    steps, results, outputs = {}, {}, {}
    for i in impls:
        try:
            step = make_step(i, targets, cotangent, entropy, block_size)
            memory = temp_bytes(step, hidden, unembed)
            outputs[i] = jax.device_get(step(hidden, unembed))  # compile + warm up
            steps[i], results[i] = step, {"temp_bytes": memory}
        except Exception as e:  # noqa: BLE001 (one impl failing must not hide the others' figures)
            results[i] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    times: dict[str, list[float]] = {i: [] for i in steps}
    for _ in range(repeats):
        for i, s in steps.items():
            times[i].append(time_once(s, hidden, unembed))
    ref = outputs.get("reference")
    for i in steps:
        results[i]["seconds"] = statistics.median(times[i])
        if ref is not None:
            (loss, grads), (loss0, grads0) = outputs[i], ref
            errs = [rel_err(loss, loss0)] + [rel_err(g, g0) for g, g0 in zip(grads, grads0, strict=True)]
            results[i]["rel_err"] = max(errs)
    return results


def summarize(results: dict) -> dict:
    """Adds the ratios against `reference` (memory, time) and `xla` (speed-up) measured in the same run."""
    ref, xla = results.get("reference", {}), results.get("xla", {})
    for r in results.values():
        if "seconds" not in r:
            continue
        if "temp_bytes" in ref:
            r["mem_ratio_vs_reference"] = ref["temp_bytes"] / max(r["temp_bytes"], 1)
            r["time_ratio_vs_reference"] = r["seconds"] / ref["seconds"]
        if "seconds" in xla:
            r["speedup_vs_xla"] = xla["seconds"] / r["seconds"]
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=896)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--impls", default=None, help="comma-separated (default: those for the backend)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--entropy", action="store_true", help="also return (and differentiate) entropy")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    impls = args.impls.split(",") if args.impls else default_impls(backend)
    impls = ["reference"] + [resolve_impl(i) for i in impls if i != "reference"]
    print(f"backend={backend} N={args.n} d={args.d} V={args.v} dtype={args.dtype} entropy={args.entropy}")
    results = summarize(
        run(args.n, args.d, args.v, args.dtype, impls, args.repeats, args.entropy, args.block_size)
    )
    print(
        f"{'impl':<10} {'temp MiB':>10} {'mem ratio (ref/impl)':>21} {'fwd+bwd s':>10} {'time ratio':>11} "
        f"{'vs xla':>7} {'rel err':>8}"
    )
    for impl, r in results.items():
        if "error" in r:
            print(f"{impl:<10} FAILED: {r['error']}")
            continue
        print(
            f"{impl:<10} {r['temp_bytes'] / 2**20:>10.1f} {r.get('mem_ratio_vs_reference', 0):>20.1f}x "
            f"{r['seconds']:>10.3f} {r.get('time_ratio_vs_reference', 0):>10.2f}x "
            f"{r.get('speedup_vs_xla', 0):>6.2f}x {r.get('rel_err', 0):>8.1e}"
        )
    if args.json:
        meta = dict(backend=backend, n=args.n, d=args.d, v=args.v, dtype=args.dtype, entropy=args.entropy)
        with open(args.json, "w") as f:
            json.dump({**meta, "impls": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
