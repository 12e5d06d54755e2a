"""The built-in decoder (Qwen2/Qwen2.5, Qwen3, Llama 3) as a `flax.nnx.Module`, and its HF mapping table.

`Decoder(config, rngs=...)` holds the embedding, one `Block` whose params are stacked over the layers
(leading axis `L`, scanned by `nn.scan_layers`), the final norm and (untied) the `lm_head`. Its pure state
(`nnx.split` -> pure dict) is the params layout of `rljax.models.params`; the functional API in
`rljax.models.model` merges a module from those params inside jit and calls it.
Attention is `config.attention_impl` from `ATTENTION_IMPLS`, given the mask as slots and segment ids (no
`[B,T,S]` mask is built). With a `mesh`, activations carry logical-axis constraints (residual stream
`(batch, length, act_embed)`, q/k/v heads, the MLP's hidden units), so under FSDP every device computes
its own rows while the layer's weights are gathered one layer at a time.
Dtype policy: params are cast to `config.compute_dtype` where used (float32 master params with bfloat16
compute work); the residual stream is kept in the compute dtype, as in the Hugging Face and vLLM
references; norms, RoPE and the softmax run in float32; the returned hidden states are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rljax.models import layers, nn
from rljax.models.config import ModelConfig
from rljax.models.nn import KEYS, MLP_HIDDEN, QUERIES, RESIDUAL
from rljax.models.params import HFTensor


class Block(nnx.Module):
    """One pre-norm decoder block (attention + SwiGLU MLP); params stacked over `stack = (L,)`.

    References: Shazeer 2020, "GLU Variants Improve Transformer" (arXiv:2002.05202).
    """

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, std: float, stack: tuple[int, ...] = ()):
        d, h, k, hd, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        kw = dict(rngs=rngs, dtype=jnp.dtype(c.param_dtype), std=std, stack=stack)
        norm = lambda n: nn.RMSNorm(n, c.rms_norm_eps, dtype=kw["dtype"], stack=stack)  # noqa: E731
        bias = 2 if c.attention_bias else 0
        self.attn_norm = norm(d)
        self.q_proj = nn.Dense(
            (d, h, hd), ("embed", "heads", "head_dim"), "btd,dnk->btnk", bias_dims=bias, **kw
        )
        self.k_proj = nn.Dense((d, k, hd), ("embed", "kv", "head_dim"), "btd,dnk->btnk", bias_dims=bias, **kw)
        self.v_proj = nn.Dense((d, k, hd), ("embed", "kv", "head_dim"), "btd,dnk->btnk", bias_dims=bias, **kw)
        out_bias = 1 if c.attention_out_bias else 0
        self.o_proj = nn.Dense(
            (h, hd, d), ("heads", "head_dim", "embed"), "btnk,nkd->btd", bias_dims=out_bias, **kw
        )
        self.q_norm = norm(hd) if c.qk_norm else None
        self.k_norm = norm(hd) if c.qk_norm else None
        self.mlp_norm = norm(d)
        self.gate_proj = nn.Dense((d, f), ("embed", "mlp"), "btd,df->btf", **kw)
        self.up_proj = nn.Dense((d, f), ("embed", "mlp"), "btd,df->btf", **kw)
        self.down_proj = nn.Dense((f, d), ("mlp", "embed"), "btf,fd->btd", **kw)

    def qkv(self, h: jax.Array, rope, constrain) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`h [B,T,d]` -> q [B,T,H,hd], k/v [B,T,K,hd], with bias, q/k norm and RoPE."""
        q = constrain(self.q_proj(h), QUERIES)
        k = constrain(self.k_proj(h), KEYS)
        v = constrain(self.v_proj(h), KEYS)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return layers.apply_rope(q, *rope), layers.apply_rope(k, *rope), v

    def __call__(self, x: jax.Array, rope, attn, constrain, kv=None, write_index=None):
        """The block on the residual `x [B,T,d]`; `attn(q, k, v)` from `nn.attention_fn`. With `kv`
        (cache k/v `[B,S,K,hd]`) the new keys and values are written at `write_index` and attention
        runs over the cache. Returns (x, kv)."""
        x = constrain(x, RESIDUAL)
        q, k, v = self.qkv(self.attn_norm(x), rope, constrain)
        if kv is not None:
            k = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), write_index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), write_index, axis=1)
            kv = (k, v)
        x = constrain(x + self.o_proj(attn(q, k, v)), RESIDUAL)
        h = self.mlp_norm(x)
        g = constrain(self.gate_proj(h), MLP_HIDDEN)
        u = constrain(self.up_proj(h), MLP_HIDDEN)
        mlp = self.down_proj(constrain(jax.nn.silu(g) * u, MLP_HIDDEN))
        return constrain(x + mlp, RESIDUAL), kv


class Decoder(nnx.Module):
    """Qwen2/Qwen2.5, Qwen3 and Llama 3 (the family's options are `ModelConfig` fields).

    The protocol of a decoder class (see docs/models.md): `__call__` (hidden states), `unembedding`,
    `hf_table`; `cached` for the KV-cache path.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        c, dtype = config, jnp.dtype(config.param_dtype)
        self.config = config
        table = lambda: nn.param(  # noqa: E731
            nn.init_value(rngs, (c.vocab_size, c.hidden_size), dtype, "normal", init_std), ("vocab", "embed")
        )
        self.embed = nn.Params(embedding=table())
        self.layers = Block(c, rngs=rngs, std=init_std, stack=(c.num_layers,))
        self.final_norm = nn.RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.lm_head = None if c.tie_word_embeddings else nn.Params(kernel=table())

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        table = self.embed.embedding[...]
        return jnp.take(table, input_ids, axis=0).astype(jnp.dtype(self.config.compute_dtype))

    def __call__(
        self, input_ids: jax.Array, *, positions: jax.Array, segment_ids: jax.Array, mesh: Mesh | None = None
    ) -> jax.Array:
        """Final-norm hidden states `f32[B,T,d]` of `input_ids i32[B,T]` (positions / segment ids
        i32[B,T] as in `rljax.models.hidden_states`); `mesh` constrains the activations."""
        slots = jnp.arange(input_ids.shape[1], dtype=jnp.int32)
        attn = nn.attention_fn(self.config, slots, slots, segment_ids, segment_ids)
        rope, constrain = nn.rope_for(self.config, positions), nn.constrainer(mesh)
        x = constrain(self.embed_tokens(input_ids), RESIDUAL)
        x, _ = nn.scan_layers(
            self.config, self.layers, lambda layer, x, _: layer(x, rope, attn, constrain), x
        )
        return constrain(self.final_norm(x, jnp.float32), RESIDUAL)

    def cached(self, input_ids, *, positions, segment_ids, cache: dict) -> tuple[jax.Array, dict]:
        """Runs `input_ids [B,T]` at cache slots index..index+T-1 (cache from `rljax.models.init_cache`)
        -> (hidden f32[B,T,d], updated cache)."""
        t, max_len = input_ids.shape[1], cache["segment_ids"].shape[1]
        index = cache["index"]
        seg_all = jax.lax.dynamic_update_slice_in_dim(cache["segment_ids"], segment_ids, index, axis=1)
        q_slots = index + jnp.arange(t, dtype=jnp.int32)
        attn = nn.attention_fn(
            self.config, q_slots, jnp.arange(max_len, dtype=jnp.int32), segment_ids, seg_all
        )
        rope, constrain = nn.rope_for(self.config, positions), nn.constrainer(None)

        def step(layer, x, kv):
            return layer(x, rope, attn, constrain, kv, index)

        x = self.embed_tokens(input_ids)
        x, (k, v) = nn.scan_layers(self.config, self.layers, step, x, (cache["k"], cache["v"]))
        new_cache = {
            "k": k,
            "v": v,
            "segment_ids": seg_all,
            "index": index + t,
            "next_position": positions[:, -1] + 1,
            "segment": segment_ids[:, -1],
        }
        return self.final_norm(x, jnp.float32), new_cache

    def unembedding(self) -> jax.Array:
        """The output projection `[V, d]`: the embedding table when tied, else `lm_head` (HF layout)."""
        return (self.embed.embedding if self.lm_head is None else self.lm_head.kernel)[...]

    @staticmethod
    def hf_table(config: ModelConfig) -> list[HFTensor]:
        """Rows in Hugging Face state-dict order (see `rljax.models.params` for the layouts)."""
        pre = "model.layers.{}."
        layer = lambda path, hf, perm=None, groups=None: HFTensor(("layers", *path), pre + hf, perm, groups)  # noqa: E731
        rows = [
            HFTensor(("embed", "embedding"), "model.embed_tokens.weight"),
            layer(("attn_norm", "scale"), "input_layernorm.weight"),
        ]
        for name in ("q_proj", "k_proj", "v_proj"):
            rows.append(layer((name, "kernel"), f"self_attn.{name}.weight", (1, 2, 0), (2, 1)))
            if config.attention_bias:
                rows.append(layer((name, "bias"), f"self_attn.{name}.bias", None, (2,)))
        rows.append(layer(("o_proj", "kernel"), "self_attn.o_proj.weight", (2, 0, 1), (1, 2)))
        if config.attention_out_bias:
            rows.append(layer(("o_proj", "bias"), "self_attn.o_proj.bias"))
        if config.qk_norm:
            rows += [layer((n, "scale"), f"self_attn.{n}.weight") for n in ("q_norm", "k_norm")]
        for name in ("gate_proj", "up_proj", "down_proj"):
            rows.append(layer((name, "kernel"), f"mlp.{name}.weight", (1, 0)))
        rows.append(layer(("mlp_norm", "scale"), "post_attention_layernorm.weight"))
        rows.append(HFTensor(("final_norm", "scale"), "model.norm.weight"))
        if not config.tie_word_embeddings:
            rows.append(HFTensor(("lm_head", "kernel"), "lm_head.weight"))
        return rows
