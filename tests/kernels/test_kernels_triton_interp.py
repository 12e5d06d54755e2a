"""The Triton kernels' arithmetic, run in Triton's CPU interpreter (TRITON_INTERPRET=1) against the reference.

Needs the `triton` package and torch (the interpreter launches on torch CPU tensors); skipped without them.
This checks the kernels' math and masking, not the jax_triton glue (that needs a GPU: see the `gpu` tests).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import numpy as np, torch, jax, jax.numpy as jnp
from rljax.kernels import _triton_kernels as tk
from rljax.kernels.common import finalize_stats, merge_stats
from rljax.kernels.reference import reference_token_logprobs

def check(n, d, v, temperature, bv, per_prog):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(n, d)).astype(np.float32)
    w = (rng.normal(size=(v, d)) * 0.7).astype(np.float32)
    t = rng.integers(0, v, n).astype(np.int32)
    t[1] = -100  # an ignored target
    g = (rng.normal(size=n) * (rng.random(n) > 0.3)).astype(np.float32)
    g[1] = 0.0  # the wrapper zeroes the logp cotangent of ignored targets
    ge = rng.normal(size=n).astype(np.float32)
    bn = bd = 16
    v_blocks = -(-v // bv)
    per = min(per_prog, v_blocks)
    splits = -(-v_blocks // per)
    m, s, u = (torch.zeros((splits, n)) for _ in range(3))
    meta = dict(N=n, V=v, D=d, SCALE=1.0 / temperature, WITH_ENTROPY=True, BN=bn, BV=bv, BD=bd, IEEE=True)
    tk.forward_kernel[(-(-n // bn), splits)](torch.from_numpy(h), torch.from_numpy(w), m, s, u,
                                             BLOCKS_PER_PROG=per, **meta)
    stats = [tuple(jnp.asarray(x[k].numpy()) for x in (m, s, u)) for k in range(splits)]
    acc = stats[0]
    for part in stats[1:]:
        acc = merge_stats(acc, part)
    lse, ent = (np.asarray(x) for x in finalize_stats(acc))
    dh, dw = torch.zeros((n, d)), torch.zeros((v, d))
    row = lambda x: torch.from_numpy(np.ascontiguousarray(x, np.float32))
    tk.backward_kernel[(-(-n // bn), v_blocks)](
        torch.from_numpy(h), torch.from_numpy(w), torch.from_numpy(t), row(lse), row(g), row(g + ge * ent),
        row(ge), dh, dw, **meta)

    def loss(hh, ww):
        lp, e = reference_token_logprobs(hh, ww, jnp.asarray(t), scale=1.0 / temperature, with_entropy=True)
        return jnp.sum(lp * g) + jnp.sum(e * ge), e

    (_, ent0), (dh0, dw0) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)
    logits = h.astype(np.float64) @ w.T.astype(np.float64) / temperature
    lse0 = np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) + logits.max(1)
    rel = lambda a, b: np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
    errs = [rel(lse, lse0), rel(ent, ent0), rel(dh.numpy(), dh0), rel(dw.numpy(), dw0)]
    assert max(errs) <= 1e-5, errs
    print("ok", n, d, v, errs)

check(37, 24, 301, 0.7, 32, 4)  # ragged N, V and d; several vocab splits to merge
check(20, 40, 130, 1.3, 64, 32)
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs the triton package (and torch) for Triton's CPU interpreter",
)
def test_triton_kernels_match_reference_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 2
