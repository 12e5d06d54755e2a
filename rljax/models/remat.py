"""Rematerialisation policies for the scanned decoder layer, registered by name in REMAT_POLICIES.

Each entry is a `RematPolicy`: `wrap(layer_body) -> layer_body`, the identity (keep every activation) or
`jax.checkpoint` with one of JAX's checkpoint policies, and how the hand memory formula reads it. Chosen
by `model.remat`; the decoder applies it to the body of its `lax.scan` over layers, so the saved
activations of a step are those of one layer times the layer count.

References: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (arXiv:1604.06174);
`jax.checkpoint_policies`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from rljax.registry import Registry


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """`wrap(layer_body) -> layer_body`, and the hand memory formula's reading of it (`rljax.memory_formula`):
    `keeps_activations` True where the backward pass keeps every layer's activations; False where it
    keeps each layer's input and recomputes one layer at a time (the dots_* policies keep some matmul
    outputs too: the formula's figure is then a lower bound)."""

    wrap: Callable[[Callable], Callable]
    keeps_activations: bool


REMAT_POLICIES: Registry[RematPolicy] = Registry("remat policy")


def _checkpoint(policy) -> Callable[[Callable], Callable]:
    return lambda body: jax.checkpoint(body, policy=policy, prevent_cse=False)


# Keep every intermediate of the forward pass (fastest; memory grows with layers x tokens x width).
REMAT_POLICIES.add("none", RematPolicy(lambda body: body, keeps_activations=True))
# Keep only each layer's input; the backward pass recomputes the layer (about one extra forward).
REMAT_POLICIES.add("full", RematPolicy(_checkpoint(jax.checkpoint_policies.nothing_saveable), False))
# Keep matmul outputs, recompute the element-wise work (norms, RoPE, activations, softmax statistics).
REMAT_POLICIES.add("dots_saveable", RematPolicy(_checkpoint(jax.checkpoint_policies.dots_saveable), False))
# Keep only the weight matmuls (no batch dimensions: projections and MLP), recompute attention scores.
REMAT_POLICIES.add(
    "dots_with_no_batch_dims_saveable",
    RematPolicy(_checkpoint(jax.checkpoint_policies.dots_with_no_batch_dims_saveable), False),
)


def remat_layer(name: str, body: Callable) -> Callable:
    """`body` wrapped by the policy `name` (KeyError listing the policies for an unknown name)."""
    return REMAT_POLICIES.get(name).wrap(body)
