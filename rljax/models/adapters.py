"""LoRA adapters on an NNX decoder: which modules get them, and how they are added (`attach_adapters`).

An adapted module carries `kernel_lora_a [*stack, *in, r]` and `kernel_lora_b [*stack, r, *out]` as
`nnx.LoRAParam`s next to its `kernel` (qwix's naming: `<weight>_lora_a`), with logical axes derived from
the kernel's (`*in` and `*out` keep their names, the rank is replicated), so they shard like the rest.
rljax's `nn.Dense` applies them to its activations (`y + scale * (x A) B`, what PEFT and vLLM compute);
any other module with a `kernel` inside the scanned layer stack (a bring-your-own decoder's own
projections) gets `kernel + scale * A B` per layer inside the scan (`nn.merge_weight_adapters`).
Why not qwix: docs/lora.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models import nn
from rljax.models.config import ModelConfig

SUFFIXES = ("_lora_a", "_lora_b")


def is_adapter_path(path: Sequence[str]) -> bool:
    """Whether a param path (e.g. `("layers", "q_proj", "kernel_lora_a")`) is an adapter leaf."""
    return str(path[-1]).endswith(SUFFIXES)


def targets_pattern(targets: Sequence[str]) -> re.Pattern:
    """One regex that fully matches a module path (`layers/q_proj`) whose last name or whole path fully
    matches one of `targets`. Raises re.error for an invalid pattern."""
    alternatives = "|".join(f"(?:{t})" for t in targets)
    return re.compile(f"(?:.*/)?(?:{alternatives})")


def lora_scale(config: ModelConfig) -> float:
    """`alpha / r`: PEFT's scaling (no rsLoRA)."""
    return config.lora_alpha / config.lora_rank


def _stack_dims(kernel: nnx.Param) -> int:
    names = kernel.get_metadata().get("out_sharding") or ()
    return sum(1 for n in names if n == "layers")


def _input_dims(module: nnx.Module, kernel: nnx.Param, stack: int) -> int:
    if isinstance(module, nn.Dense):
        return module.input_dims
    if kernel.ndim - stack < 2:
        raise ValueError("LoRA needs a kernel with an input and an output dimension")
    return 1  # a plain `x @ kernel` projection: the first per-layer dim is the input


def _add_pair(module: nnx.Module, config: ModelConfig, rngs: nnx.Rngs) -> None:
    kernel = module.kernel
    stack = _stack_dims(kernel)
    n_in = _input_dims(module, kernel, stack)
    shape = tuple(kernel.shape)
    axes = tuple(kernel.get_metadata().get("out_sharding") or (None,) * len(shape))
    s_shape, in_shape, out_shape = shape[:stack], shape[stack : stack + n_in], shape[stack + n_in :]
    s_axes, in_axes, out_axes = axes[:stack], axes[stack : stack + n_in], axes[stack + n_in :]
    r, dtype = config.lora_rank, jnp.dtype(config.param_dtype)
    bound = 1.0 / math.sqrt(math.prod(in_shape))  # PEFT: kaiming_uniform_(a=sqrt(5)) on lora_A
    a = jax.random.uniform(rngs.params(), (*s_shape, *in_shape, r), jnp.float32, -bound, bound)
    b = jnp.zeros((*s_shape, r, *out_shape), dtype)  # zero: step 0 is the base model
    # nnx.data: `nn.Dense` declares these None (a static attribute) until adapted.
    meta = dict(eager_sharding=False)
    module.kernel_lora_a = nnx.data(
        nnx.LoRAParam(a.astype(dtype), out_sharding=(*s_axes, *in_axes, None), **meta)
    )
    module.kernel_lora_b = nnx.data(nnx.LoRAParam(b, out_sharding=(*s_axes, None, *out_axes), **meta))
    module.lora_scale = lora_scale(config)


def attach_adapters(model: nnx.Module, config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """Adds a LoRA pair (B zero, A uniform as PEFT) to every module of `model` whose path matches
    `config.lora_targets` (in place; returns `model`). Raises ValueError when no module matches, or a
    match has no `kernel` or is a non-`Dense` module outside the scanned layer stack."""
    pattern = targets_pattern(config.lora_targets)
    matched = []
    for path, module in nnx.iter_modules(model):
        name = "/".join(map(str, path))
        if not path or not pattern.fullmatch(name):
            continue
        if not isinstance(getattr(module, "kernel", None), nnx.Param):
            raise ValueError(f"LoRA target {name!r} has no `kernel` parameter")
        if not isinstance(module, nn.Dense) and not _stack_dims(module.kernel):
            raise ValueError(f"LoRA target {name!r}: a non-Dense projection must be in the scanned stack")
        matched.append(module)
    if not matched:
        names = sorted("/".join(map(str, p)) for p, m in nnx.iter_modules(model) if p)
        raise ValueError(f"lora_targets {list(config.lora_targets)} match no module; modules: {names}")
    for module in matched:
        _add_pair(module, config, rngs)
    return model
