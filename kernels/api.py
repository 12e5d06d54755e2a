"""The public entry point `token_logprobs`: argument checks, backend-aware `auto`, registry dispatch."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from . import pallas as _pallas  # noqa: F401  (registers "pallas")
from . import reference as _reference  # noqa: F401  (registers "reference")
from . import triton_gpu as _triton_gpu  # noqa: F401  (registers "triton")
from . import xla as _xla  # noqa: F401  (registers "xla")
from .common import IMPLS

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# The backends each impl runs on (None: all). pallas: Mosaic on TPU, interpret mode on CPU; its Triton
# lowering for NVIDIA GPUs (deprecated from JAX 0.11) needs power-of-two array sizes, and on an H200
# (2026-12-04) it failed 4 of the 5 parity cases and Qwen2.5-7B's head (d=3584). triton: NVIDIA GPUs.
RUNS_ON: dict[str, tuple[str, ...] | None] = {
    "reference": None,
    "xla": None,
    "pallas": ("tpu", "cpu"),
    "triton": ("gpu",),
}


def check_backend(impl: str, backend: str | None = None) -> None:
    """Raises ValueError naming the impls that run on `backend` (default: JAX's) when `impl` does not."""
    backend = backend or jax.default_backend()
    backend = "gpu" if backend == "cuda" else backend
    runs_on = RUNS_ON.get(impl)
    if runs_on is not None and backend not in runs_on:
        valid = sorted(name for name, on in RUNS_ON.items() if on is None or backend in on)
        raise ValueError(
            f"log-prob impl {impl!r} does not run on {backend} (it runs on {', '.join(runs_on)}); "
            f"valid there: auto, {', '.join(valid)}"
        )


def resolve_impl(impl: str = "auto", backend: str | None = None) -> str:
    """Registered impl name for `impl` ("auto": pallas on TPU, xla elsewhere). Unknown names raise KeyError
    listing the valid names.

    xla on NVIDIA GPUs too: on one H200 at Qwen2.5-7B's head (N=8192, d=3584, V=152064, bf16, fwd+bwd with
    entropy; `scripts/gpu_check.sh`, 2026-12-04) xla took 0.059 s (about 600 TFLOP/s, near the chip's
    dense bf16 peak) and 327 MiB of temporaries, the hand-written triton kernel 0.688 s and 2079 MiB.
    "triton" stays selectable by name."""
    if impl != "auto":
        IMPLS.get(impl)  # raises with the valid names
        check_backend(impl, backend)
        return impl
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return "pallas"
    return "xla"


def _check_args(hidden, unembed, targets, temperature, block_size) -> None:
    for name, x in (("hidden", hidden), ("unembed", unembed)):
        if jnp.ndim(x) != 2:
            raise ValueError(f"{name} must be 2-D, got shape {jnp.shape(x)}")
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")
    if hidden.shape[1] != unembed.shape[1]:
        raise ValueError(f"hidden [N,d]={hidden.shape} and unembed [V,d]={unembed.shape} disagree on d")
    if hidden.dtype != unembed.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and unembed ({unembed.dtype}) must share a dtype")
    if jnp.shape(targets) != (hidden.shape[0],):
        raise ValueError(f"targets must have shape [N]=({hidden.shape[0]},), got {jnp.shape(targets)}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be an integer array, got {targets.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a Python float (static), got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")


def token_logprobs(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    impl: str = "auto",
    block_size: int | None = None,
    mesh: Mesh | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probability of each target token (and the softmax entropy) without building [N, V] logits.

    logits = hidden @ unembed.T / temperature; logp[i] = log_softmax(logits[i])[targets[i]], clamped <= 0.

    Args:
      hidden: f32|bf16[N, d] final hidden states (one row per token).
      unembed: [V, d], same dtype (embedding-table / HF `lm_head.weight` layout).
      targets: i32[N] token ids; ids outside [0, V) (e.g. an ignore index) give logp = 0, no gradient.
      temperature: static Python float > 0 dividing the logits.
      return_entropy: also return entropy f32[N] of softmax(logits).
      impl: "auto", or a registered name ("reference", "xla", "pallas", "triton").
      block_size: vocab chunk width for the fused impls (None: the impl's default).
      mesh: the device mesh of the caller's sharded jit (None: no partitioning, the kernel sees whole
        arrays). With it the fused impls run under `shard_map`: rows split over ("data", "fsdp"), a
        vocab-parallel log-sum-exp over "tensor", unembed's d gathered over "fsdp" (`rljax.kernels.fused`).
    Returns:
      logp f32[N], or (logp f32[N], entropy f32[N]). Differentiable w.r.t. hidden and unembed
      (float32 accumulation; gradients come back in the input dtype).

    References: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024);
      Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018).
    """
    _check_args(hidden, unembed, targets, temperature, block_size)
    fn = IMPLS.get(resolve_impl(impl))
    logp, entropy = fn(
        hidden,
        unembed,
        targets.astype(jnp.int32),
        scale=1.0 / float(temperature),
        with_entropy=bool(return_entropy),
        block_size=block_size,
        mesh=mesh,
    )
    return (logp, entropy) if return_entropy else logp
