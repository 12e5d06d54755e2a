"""Attention implementations, registered by name in ATTENTION_IMPLS; chosen by `model.attention_impl`.

One signature for every implementation (the mask is described, never passed as a [T, S] array):
    fn(q [B,T,H,hd], k [B,S,K,hd], v [B,S,K,hd], *, q_slots i32[T], k_slots i32[S],
       q_segments i32[B,T], k_segments i32[B,S], block_size int) -> [B,T,H,hd] in q.dtype
Query t sees key s iff `k_slots[s] <= q_slots[t]` (causal, also over a KV cache) and
`q_segments[b, t] == k_segments[b, s]` (packing; segment 0 is padding and only sees padding, so no row is
empty). H is a multiple of K (grouped-query attention: query head h uses KV head h // (H/K)).
Scale 1/sqrt(hd); softmax statistics in float32.

References: Vaswani et al. 2017 (arXiv:1706.03762); Ainslie et al. 2023, GQA (arXiv:2305.13245).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from rljax.models import layers
from rljax.registry import Registry

AttentionFn = Callable[..., jax.Array]
ATTENTION_IMPLS: Registry[AttentionFn] = Registry("attention implementation")


@ATTENTION_IMPLS.register("materialized")
def materialized_attention(q, k, v, *, q_slots, k_slots, q_segments, k_segments, block_size=512):
    """The reference: float32 scores `[B,K,G,T,S]` built at once (memory quadratic in the length)."""
    del block_size
    mask = layers.attention_mask(q_slots, k_slots, q_segments, k_segments)
    return layers.attend(q, k, v, mask)


# Backend -> implementation picked by "auto".
AUTO = {"cpu": "materialized"}


def resolve_attention_impl(name: str) -> str:
    """`name`, or for "auto" the implementation for `jax.default_backend()`; KeyError when unknown."""
    if name == "auto":
        name = AUTO.get(jax.default_backend(), "materialized")
    ATTENTION_IMPLS.get(name)
    return name
