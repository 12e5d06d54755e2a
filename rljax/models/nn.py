"""NNX building blocks shared by the built-in decoder and bring-your-own decoders.

- `param(value, axes)`: an `nnx.Param` carrying its logical axis names as metadata (`out_sharding`;
  eager sharding off: `rljax.sharding`'s rules place params, from `param_logical_axes`).
- `RMSNorm`, `Dense`: parameter groups with the decoder's dtype policy (weights cast to the input's
  compute dtype where used; norms in float32).
- `constrainer`, `attention_fn`, `rope_for`: the activation constraints, the configured attention
  (`ATTENTION_IMPLS`, bound to a mask description) and the RoPE angles of a `ModelConfig`.
- `scan_layers`: runs a module whose params are stacked with a leading layer axis as one `jax.lax.scan`
  (split/merge around the scan, rematerialised by `config.remat`), so compile time does not grow with depth;
  `layer_unroll` runs shallow stacks straight-line (`config.unroll_layers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rljax import sharding
from rljax.models import layers
from rljax.models.attention import ATTENTION_IMPLS, resolve_attention_impl
from rljax.models.config import ModelConfig, rope_inv_freq
from rljax.models.remat import remat_layer

Constrain = Callable[[jax.Array, tuple], jax.Array]
RESIDUAL = ("batch", "length", "act_embed")
QUERIES = ("batch", "length", "heads", "head_dim")
KEYS = ("batch", "length", "kv", "head_dim")
MLP_HIDDEN = ("batch", "length", "mlp")


def param(value: jax.Array, axes: Sequence[str | None]) -> nnx.Param:
    """A parameter whose dimensions carry the logical names `axes` (NNX `out_sharding` metadata)."""
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def init_value(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any, kind: str, std: float) -> jax.Array:
    """`kind` "normal" (N(0, std^2)), "ones" or "zeros", drawn in float32 and cast to `dtype`."""
    if kind == "normal":
        return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return jnp.full(shape, 1.0 if kind == "ones" else 0.0, dtype)


def stacked(stack: tuple[int, ...], shape: tuple[int, ...], axes: Sequence[str | None]):
    """(shape, axes) with the layer axes of `stack` in front (`stack` is `()` or `(L,)`)."""
    return (*stack, *shape), (*("layers",) * len(stack), *axes)


class Params(nnx.Module):
    """A named group of parameters (e.g. `Params(embedding=param(...))`)."""

    def __init__(self, **params: nnx.Param):
        for name, value in params.items():
            setattr(self, name, value)


class RMSNorm(nnx.Module):
    """`scale [*stack, n]` (init 1); `__call__(x, dtype)` normalises the last axis in float32."""

    def __init__(self, size: int, eps: float, *, dtype: Any, stack: tuple[int, ...] = ()):
        shape, axes = stacked(stack, (size,), ("norm",))
        self.scale = param(jnp.ones(shape, dtype), axes)
        self.eps = eps

    def __call__(self, x: jax.Array, dtype: Any = None) -> jax.Array:
        return layers.rms_norm(x, self.scale[...], self.eps, dtype or x.dtype)


class Dense(nnx.Module):
    """`kernel [*stack, *shape]` and optional `bias [*stack, *bias_shape]`; `__call__(x)` is
    `einsum(equation, x, kernel) + bias` in x's dtype (the weights cast to it: the compute dtype)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        axes: Sequence[str | None],
        equation: str,
        *,
        rngs: nnx.Rngs,
        dtype: Any,
        std: float,
        bias_dims: int = 0,
        stack: tuple[int, ...] = (),
    ):
        k_shape, k_axes = stacked(stack, shape, axes)
        self.kernel = param(init_value(rngs, k_shape, dtype, "normal", std), k_axes)
        b_shape, b_axes = stacked(
            stack, shape[len(shape) - bias_dims :], tuple(axes)[len(axes) - bias_dims :]
        )
        self.bias = param(jnp.zeros(b_shape, dtype), b_axes) if bias_dims else None
        self.equation = equation
        # LoRA (`rljax.models.adapters.attach_adapters` sets these): `kernel_lora_a [*stack, *in, r]`,
        # `kernel_lora_b [*stack, r, *out]`, applied to the activations (see `__call__`).
        self.kernel_lora_a = self.kernel_lora_b = None
        self.lora_scale = 0.0

    @property
    def input_dims(self) -> int:
        """How many leading kernel dims `x` contracts with (the rest are output dims)."""
        return len(lora_equations(self.equation)[2])

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum(self.equation, x, self.kernel[...].astype(x.dtype))
        y = y if self.bias is None else y + self.bias[...].astype(x.dtype)
        if self.kernel_lora_a is None:
            return y
        # y + scale * (x A) B, as PEFT and vLLM compute it: the adapter never rounds into W (bf16-safe).
        eq_a, eq_b, _ = lora_equations(self.equation)
        xa = jnp.einsum(eq_a, x, self.kernel_lora_a[...].astype(x.dtype))
        return y + self.lora_scale * jnp.einsum(eq_b, xa, self.kernel_lora_b[...].astype(x.dtype))


def lora_equations(equation: str) -> tuple[str, str, str]:
    """(x -> x A, x A -> x A B, the kernel's input subscripts) for a Dense `equation` whose kernel lists
    its input dims first (e.g. "btd,dnk->btnk": A `[d, r]`, B `[r, n, k]`)."""
    lhs, out = equation.split("->")
    x_subs, k_subs = lhs.split(",")
    rank = next(c for c in "rqzyxwvu" if c not in equation)
    in_subs = "".join(c for c in k_subs if c in x_subs)
    if not k_subs.startswith(in_subs):
        raise ValueError(f"Dense {equation!r}: LoRA needs the kernel's input dims first")
    batch = "".join(c for c in x_subs if c not in k_subs)
    out_subs = k_subs[len(in_subs) :]
    return f"{x_subs},{in_subs}{rank}->{batch}{rank}", f"{batch}{rank},{rank}{out_subs}->{out}", in_subs


def merge_weight_adapters(module: nnx.Module) -> None:
    """In place, on one layer's module (inside the scan body): every non-`Dense` submodule that carries
    `kernel_lora_a/b` (a bring-your-own decoder's own projections) gets `kernel + scale * A B`."""
    for _, sub in nnx.iter_modules(module):
        if isinstance(sub, Dense) or getattr(sub, "kernel_lora_a", None) is None:
            continue
        kernel = sub.kernel[...]
        delta = layers.lora_weight_delta(sub.kernel_lora_a[...], sub.kernel_lora_b[...])
        sub.kernel.set_value((kernel.astype(jnp.float32) + sub.lora_scale * delta).astype(kernel.dtype))


def constrainer(mesh: Mesh | None) -> Constrain:
    """`constrain(x, logical_names)`: a sharding constraint on `mesh`, or the identity without one."""
    if mesh is None:
        return lambda x, names: x
    return lambda x, names: sharding.logical_constraint(x, names, mesh)


def attention_fn(config: ModelConfig, q_slots, k_slots, q_segments, k_segments) -> Callable:
    """`attn(q, k, v)`: the configured implementation (`ATTENTION_IMPLS`) bound to the mask description
    (slots i32[T] / i32[S], segments i32[B,T] / i32[B,S]; see `rljax.models.attention`)."""
    impl = ATTENTION_IMPLS.get(resolve_attention_impl(config.attention_impl, config.compute_dtype))
    return functools.partial(
        impl,
        q_slots=q_slots,
        k_slots=k_slots,
        q_segments=q_segments,
        k_segments=k_segments,
        block_size=config.attention_block_size,
    )


def rope_for(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) `f32[B,T,hd]` of `positions i32[B,T]` with the config's RoPE (incl. Llama 3 scaling)."""
    return layers.rope_angles(jnp.asarray(rope_inv_freq(config)), positions)


def scan_layers(config: ModelConfig, stack: nnx.Module, step: Callable, x: Any, xs: Any = None):
    """Runs `step(layer, x, xs_l) -> (x, ys_l)` over the layers of `stack` (a module whose params all
    carry a leading layer axis `L`) as one `jax.lax.scan`; returns `(x, ys [L, ...])`.

    The module is split into its graph (static) and stacked state once; the scan body merges one layer's
    slice back into a module. The body is rematerialised by `config.remat` (`REMAT_POLICIES`), so a
    step saves one layer's activations times `L`, and the compiled program has one layer body.
    """
    graphdef, state = nnx.split(stack)

    def body(carry, inputs):
        layer_state, xs_l = inputs
        layer = nnx.merge(graphdef, layer_state)
        if config.lora_rank:
            merge_weight_adapters(layer)
        return step(layer, carry, xs_l)

    scanned = (nnx.to_pure_dict(state), xs)
    return jax.lax.scan(remat_layer(config.remat, body), x, scanned, unroll=layer_unroll(config))


# Stacks up to this deep run straight-line under `unroll_layers=0` (auto). Measured on 2 CPU cores
# (benchmarks/bench_update.py, GRPO update, 32 x 40 tokens): 2 and 4 layers 7-9% faster than the scanned
# body; compile time grows with the depth, so deep stacks (7B: 28 layers) keep one compiled body.
AUTO_UNROLL_MAX_LAYERS = 8


def layer_unroll(config: ModelConfig) -> int:
    """Layers per scan iteration: `config.unroll_layers`, or for 0 the whole stack when it has at most
    AUTO_UNROLL_MAX_LAYERS layers, else 1."""
    if config.unroll_layers:
        return min(config.unroll_layers, config.num_layers)
    return config.num_layers if config.num_layers <= AUTO_UNROLL_MAX_LAYERS else 1
