"""Rematerialisation policies for the scanned decoder layer, registered by name in REMAT_POLICIES.

Each entry is `fn(layer_body) -> layer_body`: the identity (keep every activation) or `jax.checkpoint`
with one of JAX's checkpoint policies. Chosen by `model.remat`; the decoder applies it to the body of its
`lax.scan` over layers, so the saved activations of a step are those of one layer times the layer count.

References: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (arXiv:1604.06174);
`jax.checkpoint_policies`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from rljax.registry import Registry

REMAT_POLICIES: Registry[Callable[[Callable], Callable]] = Registry("remat policy")


def _checkpoint(policy) -> Callable[[Callable], Callable]:
    return lambda body: jax.checkpoint(body, policy=policy, prevent_cse=False)


# Keep every intermediate of the forward pass (fastest; memory grows with layers x tokens x width).
REMAT_POLICIES.add("none", lambda body: body)
# Keep only each layer's input; the backward pass recomputes the layer (about one extra forward).
REMAT_POLICIES.add("full", _checkpoint(jax.checkpoint_policies.nothing_saveable))
# Keep matmul outputs, recompute the element-wise work (norms, RoPE, activations, softmax statistics).
REMAT_POLICIES.add("dots_saveable", _checkpoint(jax.checkpoint_policies.dots_saveable))
# Keep only the weight matmuls (no batch dimensions: projections and MLP), recompute attention scores.
REMAT_POLICIES.add(
    "dots_with_no_batch_dims_saveable",
    _checkpoint(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
)


def remat_layer(name: str, body: Callable) -> Callable:
    """`body` wrapped by the policy `name` (KeyError listing the policies for an unknown name)."""
    return REMAT_POLICIES.get(name)(body)
