"""The decoder forward pass (Qwen2/Qwen2.5, Qwen3, Llama 3) and its KV-cache prefill/decode path.

Pure functions of `(config, params, ...)`, jit-able with `config` static. Layers are stacked and run
with `jax.lax.scan` (rematerialised per layer by `config.remat`, a `REMAT_POLICIES` name). Attention is
`config.attention_impl` from `ATTENTION_IMPLS`, given the mask as slots and segment ids (no `[B,T,S]`
mask is built here; "auto" resolves by backend when the function is traced). With a `mesh`, activations
carry logical-axis constraints (residual stream `(batch, length, act_embed)`, q/k/v heads, the MLP's
hidden units), so under FSDP every device computes its own rows while the layer's weights are gathered
one layer at a time, instead of XLA gathering the batch to keep the weights split.
Dtype policy: params are cast to `config.compute_dtype` where used (so float32 master params with
bfloat16 compute work); the residual stream is kept in the compute dtype, as in the Hugging Face and
vLLM references; norms, RoPE and the softmax run in float32; logits and the returned hidden states are
float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax import sharding
from rljax.models import layers
from rljax.models.attention import ATTENTION_IMPLS, resolve_attention_impl
from rljax.models.config import ModelConfig, rope_inv_freq
from rljax.models.params import unembed_matrix
from rljax.models.remat import remat_layer

Constrain = Callable[[jax.Array, tuple], jax.Array]
RESIDUAL = ("batch", "length", "act_embed")
QUERIES = ("batch", "length", "heads", "head_dim")
KEYS = ("batch", "length", "kv", "head_dim")
MLP_HIDDEN = ("batch", "length", "mlp")


def _constrainer(mesh: Mesh | None) -> Constrain:
    """`constrain(x, logical_names)`: a sharding constraint on `mesh`, or the identity without one."""
    if mesh is None:
        return lambda x, names: x
    return lambda x, names: sharding.logical_constraint(x, names, mesh)


def _qkv(config: ModelConfig, lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array, constrain: Constrain):
    """Projections of `h [B,T,d]` -> q [B,T,H,hd], k/v [B,T,K,hd], with bias, q/k norm and RoPE."""
    dtype = h.dtype
    out = []
    for name in ("q_proj", "k_proj", "v_proj"):
        x = jnp.einsum("btd,dnk->btnk", h, lp[name]["kernel"].astype(dtype))
        if config.attention_bias:
            x = x + lp[name]["bias"].astype(dtype)
        out.append(constrain(x, QUERIES if name == "q_proj" else KEYS))
    q, k, v = out
    if config.qk_norm:
        q = layers.rms_norm(q, lp["q_norm"]["scale"], config.rms_norm_eps, dtype)
        k = layers.rms_norm(k, lp["k_norm"]["scale"], config.rms_norm_eps, dtype)
    return layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin), v


def _attention(config: ModelConfig, q_slots, k_slots, q_segments, k_segments) -> Callable:
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


def _layer(config: ModelConfig, lp: dict, x: jax.Array, rope, attn, constrain, kv=None, write_index=None):
    """One pre-norm block on the residual `x [B,T,d]`; `attn(q, k, v)` from `_attention`, `constrain`
    from `_constrainer`. With `kv` (cache k/v `[B,S,K,hd]`) the new keys and values are written at
    `write_index` and attention runs over the cache. Returns (x, kv)."""
    eps, dtype = config.rms_norm_eps, x.dtype
    x = constrain(x, RESIDUAL)
    h = layers.rms_norm(x, lp["attn_norm"]["scale"], eps, dtype)
    q, k, v = _qkv(config, lp, h, *rope, constrain)
    if kv is not None:
        k = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), write_index, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), write_index, axis=1)
        kv = (k, v)
    o = jnp.einsum("btnk,nkd->btd", attn(q, k, v), lp["o_proj"]["kernel"].astype(dtype))
    if config.attention_out_bias:
        o = o + lp["o_proj"]["bias"].astype(dtype)
    x = constrain(x + o, RESIDUAL)
    h = layers.rms_norm(x, lp["mlp_norm"]["scale"], eps, dtype)
    hidden = functools.partial(constrain, names=MLP_HIDDEN)
    mlp = layers.swiglu_mlp(
        h, lp["gate_proj"]["kernel"], lp["up_proj"]["kernel"], lp["down_proj"]["kernel"], hidden
    )
    return constrain(x + mlp, RESIDUAL), kv


def _run_layers(config: ModelConfig, params: dict, x, rope, attn, constrain, cache_kv=None, write_index=None):
    """Scans `_layer` over the stacked layer params (and the stacked cache `[L,B,S,K,hd]`)."""

    def body(x, xs):
        lp, kv = xs
        x, kv = _layer(config, lp, x, rope, attn, constrain, kv, write_index)
        return x, kv

    return jax.lax.scan(remat_layer(config.remat, body), x, (params["layers"], cache_kv))


def _embed(config: ModelConfig, params: dict, input_ids: jax.Array) -> jax.Array:
    table = params["embed"]["embedding"]
    return jnp.take(table, input_ids, axis=0).astype(jnp.dtype(config.compute_dtype))


def _defaults(input_ids: jax.Array, positions, segment_ids):
    if segment_ids is None:
        segment_ids = jnp.ones(input_ids.shape, jnp.int32)
    if positions is None:
        positions = layers.positions_from_segments(segment_ids)
    return positions.astype(jnp.int32), segment_ids.astype(jnp.int32)


def hidden_states(
    config: ModelConfig,
    params: dict,
    input_ids: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Final-norm hidden states `f32[B,T,d]` of `input_ids i32[B,T]`.

    segment_ids i32[B,T]: a token attends causally to earlier tokens of its own segment only; id 0 is
    padding (its outputs are finite but meaningless). Default: one segment per row.
    positions i32[B,T]: RoPE positions; default restarts at 0 with every segment (so packed rows and
    left/right padding need no positions argument).
    mesh: constrain activations to the logical-axis layout on this mesh (inside a sharded jit).
    """
    positions, segment_ids = _defaults(input_ids, positions, segment_ids)
    slots = jnp.arange(input_ids.shape[1], dtype=jnp.int32)
    attn = _attention(config, slots, slots, segment_ids, segment_ids)
    rope = layers.rope_angles(jnp.asarray(rope_inv_freq(config)), positions)
    constrain = _constrainer(mesh)
    x = constrain(_embed(config, params, input_ids), RESIDUAL)
    x, _ = _run_layers(config, params, x, rope, attn, constrain)
    hidden = layers.rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps, jnp.float32)
    return constrain(hidden, RESIDUAL)


def logits_from_hidden(config: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """`f32[..., V]` logits of hidden states `[..., d]` (matmul in the compute dtype, f32 accumulation)."""
    dtype = jnp.dtype(config.compute_dtype)
    w = unembed_matrix(config, params).astype(dtype)
    return jnp.einsum("...d,vd->...v", hidden.astype(dtype), w, preferred_element_type=jnp.float32)


def forward(
    config: ModelConfig,
    params: dict,
    input_ids: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Next-token logits `f32[B,T,V]` of `input_ids i32[B,T]` (positions / segment_ids / mesh as in
    `hidden_states`)."""
    hidden = hidden_states(config, params, input_ids, positions=positions, segment_ids=segment_ids, mesh=mesh)
    return logits_from_hidden(config, params, hidden)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> dict:
    """An empty KV cache for `batch` rows of up to `max_len` tokens (in the compute dtype by default).

    k, v [L,B,S,K,hd]; segment_ids i32[B,S] of the written slots; index i32[] (next slot, shared by all
    rows: prompts are left-padded); next_position i32[B] and segment i32[B] of the next token per row.
    Writing past `max_len` is not detected inside jit (slots clamp): size the cache for prompt + steps.
    """
    dtype = jnp.dtype(dtype or config.compute_dtype)
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return {
        "k": jnp.zeros(shape, dtype),
        "v": jnp.zeros(shape, dtype),
        "segment_ids": jnp.zeros((batch, max_len), jnp.int32),
        "index": jnp.zeros((), jnp.int32),
        "next_position": jnp.zeros((batch,), jnp.int32),
        "segment": jnp.ones((batch,), jnp.int32),
    }


def _cached_forward(config, params, cache, input_ids, positions, segment_ids):
    """Runs `input_ids [B,T]` at cache slots index..index+T-1; returns (logits f32[B,T,V], cache)."""
    t, max_len = input_ids.shape[1], cache["segment_ids"].shape[1]
    index = cache["index"]
    seg_all = jax.lax.dynamic_update_slice_in_dim(cache["segment_ids"], segment_ids, index, axis=1)
    q_slots = index + jnp.arange(t, dtype=jnp.int32)
    attn = _attention(config, q_slots, jnp.arange(max_len, dtype=jnp.int32), segment_ids, seg_all)
    rope = layers.rope_angles(jnp.asarray(rope_inv_freq(config)), positions)
    x = _embed(config, params, input_ids)
    x, (k, v) = _run_layers(
        config, params, x, rope, attn, _constrainer(None), (cache["k"], cache["v"]), index
    )
    hidden = layers.rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps, jnp.float32)
    new_cache = {
        "k": k,
        "v": v,
        "segment_ids": seg_all,
        "index": index + t,
        "next_position": positions[:, -1] + 1,
        "segment": segment_ids[:, -1],
    }
    return logits_from_hidden(config, params, hidden), new_cache


def prefill(
    config: ModelConfig,
    params: dict,
    cache: dict,
    input_ids: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Writes the (left-padded) prompts `input_ids i32[B,T]` into `cache` -> (logits f32[B,T,V], cache).

    segment_ids i32[B,T]: 0 for padding, 1 for prompt tokens (default all 1). Positions default to
    restarting at each segment; pass them explicitly when continuing a row across prefill calls.
    """
    positions, segment_ids = _defaults(input_ids, positions, segment_ids)
    return _cached_forward(config, params, cache, input_ids, positions, segment_ids)


def decode_step(
    config: ModelConfig, params: dict, cache: dict, token_ids: jax.Array
) -> tuple[jax.Array, dict]:
    """Feeds one token per row `token_ids i32[B]` -> (next-token logits f32[B,V], cache)."""
    logits, cache = _cached_forward(
        config,
        params,
        cache,
        token_ids[:, None],
        cache["next_position"][:, None],
        cache["segment"][:, None],
    )
    return logits[:, 0], cache
