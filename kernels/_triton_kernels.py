"""Triton kernels for the fused log-probs (NVIDIA GPUs). Imported lazily by `triton_gpu.py` only.

Their arithmetic and masking are checked in Triton's CPU interpreter (tests/test_kernels_triton_interp.py);
compiled on a GPU they were not run when written: the `gpu` tests in tests/test_kernels.py cover that.

Layout: hidden [N, D] and unembed [V, D] row-major; one program owns a [BN, BV] logit tile, computed by a loop
over D in BD-wide slices. Offsets are int64 so V * D may exceed 2**31.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in f32; IEEE selects true f32 products (f32 inputs; TF32 would break 1e-5 parity)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D: tl.constexpr, BN: tl.constexpr,
                BV: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """f32[BN, BV] = hidden[rows] @ unembed[cols].T (masked rows/cols read as 0)."""
    acc = tl.zeros((BN, BV), dtype=tl.float32)
    for k in range(0, D, BD):
        ks = k + tl.arange(0, BD)
        k_ok = ks < D
        h = tl.load(h_ptr + rows[:, None] * D + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * D + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _dot(h, tl.trans(w), IEEE)
    return acc


@triton.jit
def forward_kernel(h_ptr, w_ptr, m_ptr, s_ptr, u_ptr, N: tl.constexpr, V: tl.constexpr, D: tl.constexpr,
                   SCALE: tl.constexpr, BLOCKS_PER_PROG: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                   BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """Partial online-softmax stats (m, s, u) of row block pid 0 over vocab split pid 1, into [splits, N]."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    row_ok = rows < N
    m = tl.full((BN,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BN,), dtype=tl.float32)
    u = tl.zeros((BN,), dtype=tl.float32)
    for b in range(BLOCKS_PER_PROG):
        cols = ((pid_s * BLOCKS_PER_PROG + b) * BV + tl.arange(0, BV)).to(tl.int64)
        col_ok = cols < V
        z = _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, BN, BV, BD, IEEE) * SCALE
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        zc = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
        if WITH_ENTROPY:
            delta = tl.where(s > 0.0, m - m_new, 0.0)  # s == 0 means m == -inf: nothing to re-centre
            u = alpha * (u + delta * s) + tl.sum(e * zc, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new
    out = pid_s * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(u_ptr + out, u, mask=row_ok)


@triton.jit
def backward_kernel(h_ptr, w_ptr, t_ptr, lse_ptr, g_ptr, c0_ptr, c1_ptr, dh_ptr, dw_ptr, N: tl.constexpr,
                    V: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                    BN: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """Recomputes one logit tile, forms dz, and atomically adds dz @ W into dh and dz.T @ h into dw (f32,
    zero-initialised by the caller)."""
    rows = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    cols = (tl.program_id(1) * BV + tl.arange(0, BV)).to(tl.int64)
    row_ok = rows < N
    col_ok = cols < V
    z = _logit_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, BN, BV, BD, IEEE) * SCALE
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(c0_ptr + rows, mask=row_ok, other=0.0)[:, None]
    logp = z - lse[:, None]
    if WITH_ENTROPY:
        coef = coef + tl.load(c1_ptr + rows, mask=row_ok, other=0.0)[:, None] * logp
    t = tl.load(t_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    dz = tl.where(t[:, None] == cols[None, :], g[:, None], 0.0) - tl.exp(logp) * coef
    dz = tl.where(row_ok[:, None] & col_ok[None, :], dz * SCALE, 0.0).to(h_ptr.dtype.element_ty)
    for k in range(0, D, BD):
        ks = k + tl.arange(0, BD)
        k_ok = ks < D
        h = tl.load(h_ptr + rows[:, None] * D + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * D + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        dh_part = _dot(dz, w, IEEE)
        tl.atomic_add(dh_ptr + rows[:, None] * D + ks[None, :], dh_part, mask=row_ok[:, None] & k_ok[None, :])
        dw_part = _dot(tl.trans(dz), h, IEEE)
        tl.atomic_add(dw_ptr + cols[:, None] * D + ks[None, :], dw_part, mask=col_ok[:, None] & k_ok[None, :])
