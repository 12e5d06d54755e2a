"""Attention implementations, registered by name in ATTENTION_IMPLS; chosen by `model.attention_impl`.

One signature for every implementation (the mask is described, never passed as a [T, S] array):
    fn(q [B,T,H,hd], k [B,S,K,hd], v [B,S,K,hd], *, q_slots i32[T], k_slots i32[S],
       q_segments i32[B,T], k_segments i32[B,S], block_size int) -> [B,T,H,hd] in q.dtype
Query t sees key s iff `k_slots[s] <= q_slots[t]` (causal, also over a KV cache) and
`q_segments[b, t] == k_segments[b, s]` (packing; segment 0 is padding and only sees padding, so no row is
empty), or key s belongs to the shared prompt that query t's segment continues (`trainer.share_prompts`;
`layers.attention_mask` is the rule, `rljax.types.BRANCH_SHIFT` the encoding; splash has no such mask).
H is a multiple of K (grouped-query attention: query head h uses KV head h // (H/K)). When T == S the
slots are those of self-attention (`q_slots == k_slots`), which lets cuDNN skip the blocks above the
diagonal. Scale 1/sqrt(hd); softmax statistics in float32.

- "materialized": the reference, float32 scores [B,K,G,T,S] at once (`layers.attend`).
- "blockwise": flash attention in plain JAX (`rljax.models.blockwise`); CPU, and the fallback anywhere.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only, fp16/bf16 only.
- "splash": Pallas TPU splash attention, TPU only.

References: Vaswani et al. 2017 (arXiv:1706.03762); Ainslie et al. 2023, GQA (arXiv:2305.13245).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rljax.models import layers
from rljax.models.blockwise import blockwise_attention
from rljax.registry import Registry

AttentionFn = Callable[..., jax.Array]
ATTENTION_IMPLS: Registry[AttentionFn] = Registry("attention implementation")


@ATTENTION_IMPLS.register("materialized")
def materialized_attention(q, k, v, *, q_slots, k_slots, q_segments, k_segments, block_size=512):
    """The reference: float32 scores `[B,K,G,T,S]` built at once (memory quadratic in the length)."""
    del block_size
    mask = layers.attention_mask(q_slots, k_slots, q_segments, k_segments)
    return layers.attend(q, k, v, mask)


ATTENTION_IMPLS.add("blockwise", blockwise_attention)


def sdpa_attention(
    q, k, v, *, q_slots, k_slots, q_segments, k_segments, block_size=512, implementation="cudnn"
):
    """`jax.nn.dot_product_attention` with the causal + segment mask as its boolean `mask`.

    jax 0.10.2's public function takes a causal flag, per-row lengths (`query_seq_lengths`: padding at
    the end of a row only) and a dense boolean mask; packed segments and left padding need the mask.
    cuDNN turns it into an additive bias `[B,1,T,S]` in the input dtype (2 bytes per query-key pair per
    row, shared by all heads, vs 4 bytes per pair per head for the materialized scores; its backward
    also returns a bias gradient of that shape) and never builds the per-head scores. cuDNN's own
    packed layout (per-segment offsets, no mask) is reachable only through `jax._src.cudnn`.
    With T == S (self-attention) `is_causal` lets cuDNN skip the blocks above the diagonal.
    `implementation="xla"` runs the same call's math anywhere (the CPU parity test).

    References: Dao 2023, FlashAttention-2 (arXiv:2307.08691); `jax.nn.dot_product_attention`.
    """
    del block_size
    if implementation == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"attention_impl 'cudnn' takes bfloat16/float16 inputs, got {q.dtype}: use compute_dtype "
            "bfloat16, or attention_impl 'blockwise' (or 'auto', which picks it for float32)"
        )
    mask = layers.attention_mask(q_slots, k_slots, q_segments, k_segments)[:, None]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    causal = q.shape[1] == k.shape[1]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=implementation)


@ATTENTION_IMPLS.register("cudnn")
def cudnn_attention(q, k, v, *, q_slots, k_slots, q_segments, k_segments, block_size=512):
    """cuDNN flash attention through `jax.nn.dot_product_attention` (NVIDIA GPU; fp16/bf16)."""
    return sdpa_attention(
        q,
        k,
        v,
        q_slots=q_slots,
        k_slots=k_slots,
        q_segments=q_segments,
        k_segments=k_segments,
        block_size=block_size,
        implementation="cudnn",
    )


@ATTENTION_IMPLS.register("splash")
def splash_attention(q, k, v, *, q_slots, k_slots, q_segments, k_segments, block_size=512):
    """Pallas TPU splash attention: causal mask + segment ids, GQA, one kernel per example (vmap).

    Self-attention only (T == S, slots 0..T-1, T a multiple of the block); the KV-cache path (its causal
    offset is the dynamic cache index, splash's is static) runs the blockwise implementation.
    Not wrapped in `shard_map` yet: call it under `shard_map` with the batch and heads sharded.
    Segment equality only: shared prompts (`trainer.share_prompts`) are refused by the config check.

    References: `jax.experimental.pallas.ops.tpu.splash_attention`.
    """
    if jax.default_backend() != "tpu":
        raise NotImplementedError(
            f"attention_impl 'splash' (Pallas TPU splash attention) needs a TPU; this backend is "
            f"{jax.default_backend()!r}: use 'auto' or 'blockwise'"
        )
    mask_args = dict(q_slots=q_slots, k_slots=k_slots, q_segments=q_segments, k_segments=k_segments)
    b, t, h, hd = q.shape
    if t != k.shape[1]:
        return blockwise_attention(q, k, v, **mask_args, block_size=block_size)
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = min(block_size, t)
    sizes = splash.BlockSizes(
        **{f"block_{n}": block for n in ("q", "kv", "q_dkv", "kv_dkv", "q_dq", "kv_dq")}
    )
    mask = splash.MultiHeadMask([splash.CausalMask((t, t)) for _ in range(h)])
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    heads_first = lambda x: jnp.swapaxes(x.astype(q.dtype), 1, 2)
    segments = splash.SegmentIds(q=q_segments, kv=k_segments)
    out = jax.vmap(kernel)(heads_first(q * hd**-0.5), heads_first(k), heads_first(v), segment_ids=segments)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def sees_shared_prompts(name: str) -> bool:
    """Whether implementation `name` applies `layers.attention_mask` (shared prompts included): every one
    but splash, which compares segment ids only."""
    return ATTENTION_IMPLS.get(name) is not splash_attention


# Backend -> implementation picked by "auto".
AUTO = {"gpu": "cudnn", "tpu": "splash", "cpu": "blockwise"}
# cuDNN's flash kernels take fp16/bf16 only: "auto" runs float32 compute on a GPU blockwise.
AUTO_FLOAT32 = {"gpu": "blockwise"}


def resolve_attention_impl(name: str, compute_dtype: str | None = None) -> str:
    """`name`, or for "auto" the implementation for `jax.default_backend()` (and, when given, the compute
    dtype: float32 on a GPU is blockwise); KeyError listing the implementations when unknown."""
    if name == "auto":
        backend = jax.default_backend()
        name = AUTO.get(backend, "blockwise")
        if compute_dtype == "float32":
            name = AUTO_FLOAT32.get(backend, name)
    ATTENTION_IMPLS.get(name)
    return name
