"""Bring your own model: a Qwen2 decoder with its own parameter layout, outside the rljax package.

Fused q/k/v (`qkv/kernel [L, d, H+2K, hd]`) and fused gate/up (`gate_up/kernel [L, d, 2F]`) projections,
a flat output projection `[L, H*hd, d]`, an untied head stored `[d, V]`, and names of its own. Its
`hf_table` maps every param (or part of one) onto Hugging Face `Qwen2ForCausalLM` tensor names; that
one table drives checkpoint load, save and weight sync to vLLM. Select it with

    python -m rljax.main --config=configs/grpo.py --config.model.family=examples.fused_qwen:FusedQwen2

(run from the repository root, or anywhere `examples` is importable). See docs/models.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models import HFTensor, ModelConfig, layers, nn


class FusedBlock(nnx.Module):
    """One Qwen2 block with fused projections; params stacked over `stack = (L,)`."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs, std: float, stack: tuple[int, ...]):
        d, h, k, hd, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        dtype = jnp.dtype(c.param_dtype)

        def weight(shape, axes, kind="normal"):
            shape, axes = nn.stacked(stack, shape, axes)
            return nn.param(nn.init_value(rngs, shape, dtype, kind, std), axes)

        self.ln1 = nn.RMSNorm(d, c.rms_norm_eps, dtype=dtype, stack=stack)
        # The fused head axis mixes q, k and v heads: no logical name (replicated over `tensor`).
        self.qkv = nn.Params(
            kernel=weight((d, h + 2 * k, hd), ("embed", None, "head_dim")),
            bias=weight((h + 2 * k, hd), (None, "head_dim"), "zeros"),
        )
        self.out = nn.Params(kernel=weight((h * hd, d), (None, "embed")))
        self.ln2 = nn.RMSNorm(d, c.rms_norm_eps, dtype=dtype, stack=stack)
        self.gate_up = nn.Params(kernel=weight((d, 2 * f), ("embed", None)))
        self.down = nn.Params(kernel=weight((f, d), ("mlp", "embed")))
        self.heads = (h, k)

    def __call__(self, x: jax.Array, rope, attn) -> jax.Array:
        h, k = self.heads
        dtype = x.dtype
        qkv = jnp.einsum("btd,dnk->btnk", self.ln1(x), self.qkv.kernel[...].astype(dtype))
        qkv = qkv + self.qkv.bias[...].astype(dtype)
        q, kk, v = qkv[:, :, :h], qkv[:, :, h : h + k], qkv[:, :, h + k :]
        o = attn(layers.apply_rope(q, *rope), layers.apply_rope(kk, *rope), v)
        x = x + o.reshape(*o.shape[:2], -1) @ self.out.kernel[...].astype(dtype)
        gate, up = jnp.split(self.ln2(x) @ self.gate_up.kernel[...].astype(dtype), 2, axis=-1)
        return x + (jax.nn.silu(gate) * up) @ self.down.kernel[...].astype(dtype)


class FusedQwen2(nnx.Module):
    """The decoder: `wte`, stacked `blocks`, `ln_f`, and (untied) `head` `[d, V]`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        if config.family != "qwen2":
            raise ValueError(f"FusedQwen2 maps onto Qwen2 checkpoints, not {config.family!r}")
        c, dtype = config, jnp.dtype(config.param_dtype)
        self.config = config
        table = nn.init_value(rngs, (c.vocab_size, c.hidden_size), dtype, "normal", init_std)
        self.wte = nn.Params(table=nn.param(table, ("vocab", "embed")))
        self.blocks = FusedBlock(c, rngs=rngs, std=init_std, stack=(c.num_layers,))
        self.ln_f = nn.RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        head = None
        if not c.tie_word_embeddings:
            kernel = nn.init_value(rngs, (c.hidden_size, c.vocab_size), dtype, "normal", init_std)
            head = nn.Params(kernel=nn.param(kernel, ("embed", "vocab")))
        self.head = head

    def __call__(self, input_ids, *, positions, segment_ids, mesh=None) -> jax.Array:
        """Final-norm hidden states `f32[B,T,d]` (the protocol's hidden-state accessor)."""
        c = self.config
        slots = jnp.arange(input_ids.shape[1], dtype=jnp.int32)
        attn = nn.attention_fn(c, slots, slots, segment_ids, segment_ids)
        rope, constrain = nn.rope_for(c, positions), nn.constrainer(mesh)
        x = jnp.take(self.wte.table[...], input_ids, axis=0).astype(jnp.dtype(c.compute_dtype))
        x = constrain(x, nn.RESIDUAL)

        def step(block, x, _):
            return constrain(block(x, rope, attn), nn.RESIDUAL), None

        x, _ = nn.scan_layers(c, self.blocks, step, x)
        return constrain(self.ln_f(x, jnp.float32), nn.RESIDUAL)

    def unembedding(self) -> jax.Array:
        """The output projection in HF layout `[V, d]` (what the fused log-prob kernels take)."""
        return self.wte.table[...] if self.head is None else self.head.kernel[...].T

    @staticmethod
    def hf_table(config: ModelConfig) -> list[HFTensor]:
        """Every HF `Qwen2ForCausalLM` tensor, in state-dict order, as (a part of) one of our params."""
        h, k = config.num_heads, config.num_kv_heads
        f = config.intermediate_size
        pre = "model.layers.{}."
        spans = {"q_proj": (0, h), "k_proj": (h, h + k), "v_proj": (h + k, h + 2 * k)}
        rows = [
            HFTensor(("wte", "table"), "model.embed_tokens.weight"),
            HFTensor(("blocks", "ln1", "scale"), pre + "input_layernorm.weight"),
        ]
        for name, (lo, hi) in spans.items():
            w = pre + f"self_attn.{name}."
            rows.append(HFTensor(("blocks", "qkv", "kernel"), w + "weight", (1, 2, 0), (2, 1), (1, lo, hi)))
            rows.append(HFTensor(("blocks", "qkv", "bias"), w + "bias", None, (2,), (0, lo, hi)))
        rows += [
            HFTensor(("blocks", "out", "kernel"), pre + "self_attn.o_proj.weight", (1, 0)),
            HFTensor(("blocks", "gate_up", "kernel"), pre + "mlp.gate_proj.weight", (1, 0), None, (1, 0, f)),
            HFTensor(
                ("blocks", "gate_up", "kernel"), pre + "mlp.up_proj.weight", (1, 0), None, (1, f, 2 * f)
            ),
            HFTensor(("blocks", "down", "kernel"), pre + "mlp.down_proj.weight", (1, 0)),
            HFTensor(("blocks", "ln2", "scale"), pre + "post_attention_layernorm.weight"),
            HFTensor(("ln_f", "scale"), "model.norm.weight"),
        ]
        if not config.tie_word_embeddings:
            rows.append(HFTensor(("head", "kernel"), "lm_head.weight", (1, 0)))
        return rows
