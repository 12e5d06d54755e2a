"""The "triton" impl: hand-written Triton kernels called through `jax_triton.triton_call` on NVIDIA GPUs.

jax_triton and triton are imported lazily (only when this impl is traced), so the package imports anywhere.
Forward: a [row blocks, vocab splits] grid writes partial online-softmax stats that are merged in JAX.
Backward: one kernel over [row blocks, vocab blocks] tiles, accumulating d(hidden) and d(unembed) with f32
atomics (Cut Cross-Entropy style), so each logit tile is recomputed once.

The kernels' math is checked in Triton's CPU interpreter; this jax_triton glue and the compiled kernels
were not run on a GPU when written (no GPU was available): see the `gpu` tests in tests/test_kernels.py.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from .common import IMPLS, finalize_stats, merge_stats
from .fused import make_fused

BN, BV, BD = 64, 64, 64  # tile sizes; tl.dot needs each >= 16
BLOCKS_PER_PROG = 32  # vocab blocks one forward program streams over (fewer partial stats to merge)
NUM_WARPS = 4


@functools.cache
def triton_available() -> bool:
    """True when jax_triton and triton import (a GPU is still needed to run the kernels)."""
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _triton_call(kernel, *args, out, grid, zeroed=(), **meta):
    """jax_triton.triton_call across its versions (`out_shape` before 0.4, `out_type` after)."""
    import jax_triton as jt

    out_key = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
    extra = {"zeroed_outputs": tuple(zeroed)} if zeroed else {}
    return jt.triton_call(
        *args, kernel=kernel, grid=grid, num_warps=NUM_WARPS, **{out_key: out}, **extra, **meta
    )


def _vocab_tile(block_size: int | None) -> int:
    """BV: tl.arange needs a power of two and tl.dot at least 16."""
    return max(16, 1 << (max(block_size or BV, 1) - 1).bit_length())


def _ieee(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.float32  # f32 parity needs real f32 products, not TF32


def triton_forward_stats(hidden, unembed, scale, with_entropy, block_size):
    """(lse f32[N], entropy f32[N] | None); `block_size` overrides the vocab tile BV."""
    from . import _triton_kernels as tk

    (n_rows, dim), vocab = hidden.shape, unembed.shape[0]
    bv = _vocab_tile(block_size)
    v_blocks = -(-vocab // bv)
    per_prog = min(BLOCKS_PER_PROG, v_blocks)
    splits = -(-v_blocks // per_prog)
    f32 = jax.ShapeDtypeStruct((splits, n_rows), jnp.float32)
    m, s, u = _triton_call(
        tk.forward_kernel, hidden, unembed, out=[f32, f32, f32], grid=(-(-n_rows // BN), splits),
        N=n_rows, V=vocab, D=dim, SCALE=float(scale), BLOCKS_PER_PROG=per_prog, WITH_ENTROPY=with_entropy,
        BN=BN, BV=bv, BD=BD, IEEE=_ieee(hidden.dtype),
    )  # fmt: skip
    stats = (m[0], s[0], u[0])
    for k in range(1, splits):  # splits is small (V / (BV * BLOCKS_PER_PROG)); a static unrolled merge
        stats = merge_stats(stats, (m[k], s[k], u[k]))
    lse, entropy = finalize_stats(stats)
    return lse, entropy if with_entropy else None


def triton_backward_grads(hidden, unembed, targets, lse, g_logp, c0, c1, scale, block_size):
    """(d hidden f32[N,d], d unembed f32[V,d]) from one atomically-accumulating kernel."""
    from . import _triton_kernels as tk

    (n_rows, dim), vocab = hidden.shape, unembed.shape[0]
    bv = _vocab_tile(block_size)
    dh, dw = _triton_call(
        tk.backward_kernel, hidden, unembed, targets, lse, g_logp, c0, c0 if c1 is None else c1,
        out=[jax.ShapeDtypeStruct((n_rows, dim), jnp.float32),
             jax.ShapeDtypeStruct((vocab, dim), jnp.float32)],
        grid=(-(-n_rows // BN), -(-vocab // bv)), zeroed=(0, 1),
        N=n_rows, V=vocab, D=dim, SCALE=float(scale), WITH_ENTROPY=c1 is not None,
        BN=BN, BV=bv, BD=BD, IEEE=_ieee(hidden.dtype),
    )  # fmt: skip
    return dh, dw


IMPLS.add("triton", make_fused(triton_forward_stats, triton_backward_grads))
