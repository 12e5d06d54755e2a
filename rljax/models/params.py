"""The parameter table: every decoder weight, its shape, logical axes and Hugging Face name and layout.

One table serves param shapes, logical axes, random init, checkpoint load/save and weight sync, so the
two directions of the HF mapping cannot drift apart.

Params are a nested dict; per-layer weights are stacked with a leading layer axis `L` (scanned):

    embed/embedding          [V, d]          model.embed_tokens.weight
    layers/attn_norm/scale   [L, d]          model.layers.{i}.input_layernorm.weight
    layers/q_proj/kernel     [L, d, H, hd]   model.layers.{i}.self_attn.q_proj.weight  [H*hd, d]
    layers/q_proj/bias       [L, H, hd]      (qwen2, or attention_bias)               [H*hd]
    layers/k_proj, v_proj    [L, d, K, hd]   ...k_proj / v_proj                        [K*hd, d]
    layers/o_proj/kernel     [L, H, hd, d]   ...o_proj.weight                          [d, H*hd]
    layers/q_norm, k_norm    [L, hd]         (qwen3) ...self_attn.q_norm.weight
    layers/mlp_norm/scale    [L, d]          ...post_attention_layernorm.weight
    layers/gate_proj, up_proj[L, d, F]       ...mlp.gate_proj.weight                   [F, d]
    layers/down_proj/kernel  [L, F, d]       ...mlp.down_proj.weight                   [d, F]
    final_norm/scale         [d]             model.norm.weight
    lm_head/kernel           [V, d]          lm_head.weight (untied only; HF layout kept for the kernel)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.config import ModelConfig
from rljax.sharding import LogicalAxes


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """One weight. `shape`/`axes` exclude the layer axis for per-layer weights (`hf_name` has `{}`).

    HF layout = `param.transpose(perm)` with consecutive dims merged in groups of sizes `groups`.
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    hf_name: str
    perm: tuple[int, ...]
    groups: tuple[int, ...]
    init: str  # "normal", "ones" or "zeros"

    @property
    def per_layer(self) -> bool:
        return "{}" in self.hf_name

    @property
    def transposed_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[p] for p in self.perm)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        t, out, pos = self.transposed_shape, [], 0
        for g in self.groups:
            out.append(math.prod(t[pos : pos + g]))
            pos += g
        return tuple(out)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """One (per-layer) param array `[*shape]` -> its HF tensor `[*hf_shape]`."""
        return np.ascontiguousarray(np.transpose(x, self.perm)).reshape(self.hf_shape)

    def from_hf(self, x: np.ndarray) -> np.ndarray:
        """HF tensor `[*hf_shape]` -> the (per-layer) param array `[*shape]`."""
        return np.transpose(np.reshape(x, self.transposed_shape), np.argsort(self.perm))


def _layer_entries(c: ModelConfig) -> list[ParamEntry]:
    d, h, k, hd, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    pre = "model.layers.{}."

    def e(path, shape, axes, hf, perm, groups, init="normal"):
        return ParamEntry(("layers", *path), shape, axes, pre + hf, perm, groups, init)

    out = [e(("attn_norm", "scale"), (d,), ("norm",), "input_layernorm.weight", (0,), (1,), "ones")]
    for name, n, ax in (("q_proj", h, "heads"), ("k_proj", k, "kv"), ("v_proj", k, "kv")):
        hf = f"self_attn.{name}."
        out.append(
            e((name, "kernel"), (d, n, hd), ("embed", ax, "head_dim"), hf + "weight", (1, 2, 0), (2, 1))
        )
        if c.attention_bias:
            out.append(e((name, "bias"), (n, hd), (ax, "head_dim"), hf + "bias", (0, 1), (2,), "zeros"))
    out.append(
        e(
            ("o_proj", "kernel"),
            (h, hd, d),
            ("heads", "head_dim", "embed"),
            "self_attn.o_proj.weight",
            (2, 0, 1),
            (1, 2),
        )
    )
    if c.attention_out_bias:
        out.append(e(("o_proj", "bias"), (d,), ("embed",), "self_attn.o_proj.bias", (0,), (1,), "zeros"))
    if c.qk_norm:
        for name in ("q_norm", "k_norm"):
            out.append(e((name, "scale"), (hd,), ("norm",), f"self_attn.{name}.weight", (0,), (1,), "ones"))
    for name in ("gate_proj", "up_proj"):
        out.append(e((name, "kernel"), (d, f), ("embed", "mlp"), f"mlp.{name}.weight", (1, 0), (1, 1)))
    out.append(e(("down_proj", "kernel"), (f, d), ("mlp", "embed"), "mlp.down_proj.weight", (1, 0), (1, 1)))
    out.append(
        e(("mlp_norm", "scale"), (d,), ("norm",), "post_attention_layernorm.weight", (0,), (1,), "ones")
    )
    return out


def param_table(config: ModelConfig) -> tuple[list[ParamEntry], list[ParamEntry], list[ParamEntry]]:
    """(leading, per-layer, trailing) entries in Hugging Face state-dict order."""
    v, d = config.vocab_size, config.hidden_size
    lead = [
        ParamEntry(
            ("embed", "embedding"),
            (v, d),
            ("vocab", "embed"),
            "model.embed_tokens.weight",
            (0, 1),
            (1, 1),
            "normal",
        )
    ]
    tail = [ParamEntry(("final_norm", "scale"), (d,), ("norm",), "model.norm.weight", (0,), (1,), "ones")]
    if not config.tie_word_embeddings:
        tail.append(
            ParamEntry(
                ("lm_head", "kernel"), (v, d), ("vocab", "embed"), "lm_head.weight", (0, 1), (1, 1), "normal"
            )
        )
    return lead, _layer_entries(config), tail


def param_entries(config: ModelConfig) -> list[ParamEntry]:
    lead, layer, tail = param_table(config)
    return lead + layer + tail


def global_shape(config: ModelConfig, entry: ParamEntry) -> tuple[int, ...]:
    """Shape of the param array (with the layer axis `L` for per-layer weights)."""
    return (config.num_layers, *entry.shape) if entry.per_layer else entry.shape


def nest_paths(pairs: list[tuple[tuple[str, ...], Any]]) -> dict:
    tree: dict = {}
    for path, value in pairs:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def get_path(params: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        params = params[key]
    return params


def param_logical_axes(config: ModelConfig) -> dict:
    """Tree like the params whose leaves are `LogicalAxes` (tuples of names, e.g. `("layers", "embed",
    "heads", "head_dim")`, that also carry the shape for divisibility checks)."""
    pairs = []
    for e in param_entries(config):
        axes = ("layers", *e.axes) if e.per_layer else e.axes
        pairs.append((e.path, LogicalAxes(axes, global_shape(config, e))))
    return nest_paths(pairs)


def abstract_params(config: ModelConfig) -> dict:
    """`jax.ShapeDtypeStruct` tree of the params (in `config.param_dtype`)."""
    dtype = jnp.dtype(config.param_dtype)
    return nest_paths(
        [(e.path, jax.ShapeDtypeStruct(global_shape(config, e), dtype)) for e in param_entries(config)]
    )


def init_params(config: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Random params: weights ~ N(0, std^2), norm scales 1, biases 0 (for tests and from-scratch runs)."""
    entries = param_entries(config)
    keys = jax.random.split(key, len(entries))
    dtype = jnp.dtype(config.param_dtype)
    pairs = []
    for e, k in zip(entries, keys, strict=True):
        shape = global_shape(config, e)
        if e.init == "normal":
            x = std * jax.random.normal(k, shape, jnp.float32)
        else:
            x = jnp.full(shape, 1.0 if e.init == "ones" else 0.0, jnp.float32)
        pairs.append((e.path, x.astype(dtype)))
    return nest_paths(pairs)


def unembed_matrix(config: ModelConfig, params: dict) -> jax.Array:
    """The output projection `[V, d]`: the embedding table when tied, else `lm_head` (HF layout)."""
    if config.tie_word_embeddings:
        return params["embed"]["embedding"]
    return params["lm_head"]["kernel"]
