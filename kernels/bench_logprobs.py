"""Benchmark of token_logprobs forward+backward: compiled temporary memory and wall time per impl.

Run: python -m rljax.kernels.bench_logprobs --n 2048 --d 896 --v 151936 --dtype float32
Prints, for each impl available on the default backend, the compiled temp memory
(`jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`) and the median wall time of one
jitted value_and_grad step (w.r.t. hidden and unembed), each also as a ratio against `reference` measured in
the same run. Timed runs of the impls are interleaved so background load hits them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .api import resolve_impl, token_logprobs
from .triton_gpu import triton_available


def default_impls(backend: str) -> list[str]:
    """Impls worth timing on `backend` (Pallas runs only interpreted on CPU: far too slow to time there)."""
    impls = ["reference", "xla"]
    if backend in ("gpu", "tpu"):
        impls.append("pallas")
    if backend == "gpu" and triton_available():
        impls.append("triton")
    return impls


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


def run(n: int, d: int, v: int, dtype: str, impls: list[str], repeats: int, entropy: bool, block_size):
    """Measures every impl; returns {impl: (temp bytes, median seconds)}."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(n, d)), dtype)
    unembed = jnp.asarray(rng.normal(size=(v, d)) / np.sqrt(d), dtype)
    targets = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    cotangent = jnp.asarray(rng.random(n) < 0.8, jnp.float32)  # a loss mask
    steps = {i: make_step(i, targets, cotangent, entropy, block_size) for i in impls}
    memory = {i: temp_bytes(s, hidden, unembed) for i, s in steps.items()}
    for s in steps.values():
        time_once(s, hidden, unembed)  # compile + warm up
    times: dict[str, list[float]] = {i: [] for i in impls}
    for _ in range(repeats):
        for i, s in steps.items():
            times[i].append(time_once(s, hidden, unembed))
    return {i: (memory[i], statistics.median(times[i])) for i in impls}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=896)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--impls", default=None, help="comma-separated (default: those for the backend)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--entropy", action="store_true", help="also return (and differentiate) entropy")
    parser.add_argument("--block-size", type=int, default=None)
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    impls = args.impls.split(",") if args.impls else default_impls(backend)
    impls = ["reference"] + [resolve_impl(i) for i in impls if i != "reference"]
    print(f"backend={backend} N={args.n} d={args.d} V={args.v} dtype={args.dtype} entropy={args.entropy}")
    results = run(args.n, args.d, args.v, args.dtype, impls, args.repeats, args.entropy, args.block_size)
    ref_mem, ref_time = results["reference"]
    print(f"{'impl':<10} {'temp MiB':>10} {'mem ratio (ref/impl)':>21} {'fwd+bwd s':>10} {'time ratio':>11}")
    for impl, (mem, secs) in results.items():
        print(
            f"{impl:<10} {mem / 2**20:>10.1f} {ref_mem / max(mem, 1):>20.1f}x "
            f"{secs:>10.3f} {secs / ref_time:>10.2f}x"
        )


if __name__ == "__main__":
    main()
