"""Decoder classes by family, and the pure functional API over a decoder's params.

`DECODERS` maps a family name to an NNX decoder class; `resolve_decoder` also accepts
`package.module:Class` (bring your own model, docs/models.md). A `ModelConfig` names its class by
`decoder` (a family name or `package.module:Class`; empty: the built-in class of `config.family`).

The params that flow through jit, `TrainState`, orbax and weight sync are the module's pure state (a
nested dict of arrays, `nnx.split` + `to_pure_dict`). Every function here takes `(config, params, ...)`,
is jit-able with `config` static, and merges the module from the params inside (`build_model`): the
graph definition comes from `nnx.eval_shape` once per config, so no weights are ever materialised for it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rljax.models import adapters, layers
from rljax.models.config import ModelConfig
from rljax.models.decoder import Decoder
from rljax.models.params import ParamEntry, bind_table, flatten_paths, nest_paths
from rljax.registry import Registry
from rljax.sharding import LogicalAxes

DECODERS: Registry[type] = Registry("decoder family")
for _family in ("qwen2", "qwen3", "llama"):
    DECODERS.add(_family, Decoder)

# What a decoder class must provide (docs/models.md); `cached` (the KV-cache path) is optional.
PROTOCOL = ("__call__", "unembedding", "hf_table")


def resolve_decoder(name: str) -> type:
    """The decoder class of `name`: a `DECODERS` family, or `package.module:Class` (imported). Raises
    ValueError (import failures, missing protocol methods) or KeyError (unknown family, listing them)."""
    if ":" not in name:
        return DECODERS.get(name)
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"decoder {name!r}: cannot import it ({type(e).__name__}: {e})") from e
    missing = [m for m in PROTOCOL if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or not issubclass(cls, nnx.Module) or missing:
        raise ValueError(f"decoder {name!r} is not an nnx.Module class with {', '.join(PROTOCOL)}")
    return cls


def has_rljax_attention(name: str) -> bool:
    """Whether decoder `name` ("auto", a `DECODERS` family or `package.module:Class`) is rljax's own,
    whose attention applies `layers.attention_mask` (so it sees shared prompts)."""
    return name == "auto" or resolve_decoder(name) is Decoder


def decoder_class(config: ModelConfig) -> type:
    """The class that `config` names (`config.decoder`, else the built-in one of `config.family`)."""
    return resolve_decoder(config.decoder or config.family)


def _construct(config: ModelConfig, rngs: nnx.Rngs, **kwargs: Any) -> nnx.Module:
    """A fresh decoder of `config`, with LoRA adapters when `config.lora_rank > 0`."""
    model = decoder_class(config)(config, rngs=rngs, **kwargs)
    return adapters.attach_adapters(model, config, rngs) if config.lora_rank else model


@functools.lru_cache(maxsize=64)
def _template(config: ModelConfig) -> tuple[Any, dict, dict]:
    """(graphdef, abstract params, logical axes) of the decoder, from `nnx.eval_shape` (no weights)."""
    model = nnx.eval_shape(lambda: _construct(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    axes = []
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        axes.append((tuple(str(p) for p in path), LogicalAxes(names, var.shape)))
    return graphdef, nnx.to_pure_dict(state), nest_paths(axes)


def build_model(config: ModelConfig, *, rngs: nnx.Rngs | None = None, params: Any = None) -> nnx.Module:
    """The decoder module: merged from `params` (a pure state, e.g. from `load_hf_checkpoint`; works on
    tracers inside jit), else freshly initialised from `rngs` (default `nnx.Rngs(0)`)."""
    if params is not None:
        return nnx.merge(_template(config)[0], params)
    return _construct(config, rngs or nnx.Rngs(0))


def abstract_params(config: ModelConfig) -> dict:
    """`jax.ShapeDtypeStruct` tree of the params (in `config.param_dtype`)."""
    return jax.tree.map(lambda x: x, _template(config)[1])


def param_logical_axes(config: ModelConfig) -> dict:
    """Tree like the params whose leaves are `LogicalAxes` (the names each parameter carries as NNX
    metadata, e.g. `("layers", "embed", "heads", "head_dim")`, with the shape for divisibility checks)."""
    return jax.tree.map(lambda x: x, _template(config)[2], is_leaf=lambda x: isinstance(x, tuple))


def param_entries(config: ModelConfig) -> list[ParamEntry]:
    """The decoder's HF mapping table bound to its param shapes, in Hugging Face state-dict order (the
    base model's: LoRA adapters are not HF tensors, `rljax.models.lora.peft_tensors` names them)."""
    rows = decoder_class(config).hf_table(config)
    pairs = [(p, x) for p, x in flatten_paths(_template(config)[1]) if not adapters.is_adapter_path(p)]
    return bind_table(rows, nest_paths(pairs), config.num_layers)


def init_params(config: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Random params from the module's initialisers: weights ~ N(0, std^2), norm scales 1, biases 0."""
    model = _construct(config, nnx.Rngs(params=key), init_std=std)
    return nnx.to_pure_dict(nnx.state(model))


def unembed_matrix(config: ModelConfig, params: dict) -> jax.Array:
    """The output projection `[V, d]` (the module's `unembedding()`: tied embedding or `lm_head`)."""
    return build_model(config, params=params).unembedding()


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
    model = build_model(config, params=params)
    return model(input_ids, positions=positions, segment_ids=segment_ids, mesh=mesh)


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
    model = build_model(config, params=params)
    if not callable(getattr(model, "cached", None)):
        raise NotImplementedError(f"{type(model).__name__} has no KV-cache path (`cached`)")
    hidden, cache = model.cached(input_ids, positions=positions, segment_ids=segment_ids, cache=cache)
    return logits_from_hidden(config, params, hidden), cache


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
