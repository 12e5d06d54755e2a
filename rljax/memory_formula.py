"""The hand formula for the trainer's per-device memory: the fallback where the train step cannot be
compiled (`rljax.memory` reads the real numbers from the compiler; `rljax.preflight` prefers those).

`read_model_shape` reads a checkpoint's sizes from its config.json; `estimate_train_memory` splits the
bytes one device holds into parts; `estimated_peak` adds them up. The remat policy, optimizer and algorithm
family enter through their registries (`rljax.models.REMAT_POLICIES`, `rljax.trainer.optim.OPTIMIZERS`,
`rljax.algos.FAMILIES`). Checked against compiled numbers in tests/test_preflight.py.
"""

from __future__ import annotations

import dataclasses

from rljax import config as config_lib
from rljax.config import Config
from rljax.hf_config import read_hf_config

LOGPROB_CHUNK = 4096  # vocab chunk width of rljax.kernels' fused log-prob impls (kernels/xla.py)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder read from a Hugging Face config.json."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    serve_bytes: int  # bytes per parameter of the checkpoint's torch_dtype (what vLLM loads)

    @property
    def num_params(self) -> int:
        """Parameter count: embeddings, per-layer attention + SwiGLU MLP + norms, final norm, lm_head."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * d * self.intermediate + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        return self.vocab * d * (1 if self.tied else 2) + self.layers * layer + d


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def read_model_shape(model_path: str) -> ModelShape:
    """ModelShape from `<model_path>/config.json` (Qwen2, Qwen3, Llama field names)."""
    c = read_hf_config(model_path)
    heads = int(c["num_attention_heads"])
    return ModelShape(
        vocab=int(c["vocab_size"]),
        hidden=int(c["hidden_size"]),
        intermediate=int(c["intermediate_size"]),
        layers=int(c["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),  # HF: absent means multi-head attention
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),  # HF: absent means hidden / heads
        tied=bool(c.get("tie_word_embeddings", False)),  # HF PretrainedConfig default
        qkv_bias=c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)),
        qk_norm=c.get("model_type") == "qwen3",
        serve_bytes=_DTYPE_BYTES.get(str(c.get("torch_dtype") or c.get("dtype") or "bfloat16"), 2),
    )


def keeps_activations(remat: str) -> bool:
    """Whether the remat policy `remat` keeps every layer's activations for the backward pass: the formula's
    reading of it, registered with the policy itself (`rljax.models.remat.RematPolicy`)."""
    from rljax.models.remat import REMAT_POLICIES  # imports jax: after initialize_jax

    return REMAT_POLICIES.get(remat).keeps_activations


def _layer_activation_bytes(cfg: Config, shape: ModelShape, seqs: int, seq_len: int, tensor: int) -> float:
    """One layer's activations for `seqs` rows of `seq_len` tokens (Korthikanti et al. 2022, sec. 4:
    s*b*h*(34 + 5*a*s/h) bytes in 16-bit); the attention term spans one key block instead of the whole
    row unless attention is materialized."""
    from rljax.models.attention import resolve_attention_impl  # imports jax: after initialize_jax

    scale = _DTYPE_BYTES[cfg.model.compute_dtype] / 2  # the reference counts 16-bit activations
    keys = seq_len
    if resolve_attention_impl(cfg.model.attention_impl) != "materialized":
        keys = min(seq_len, cfg.model.attention_block_size)
    d = shape.hidden
    return seqs * seq_len * d * (34 + 5 * shape.heads * keys / d) * scale / tensor


def estimate_train_memory(cfg: Config, shape: ModelShape, num_devices: int) -> dict[str, float]:
    """Bytes per device of the trainer by part, the fallback where the step cannot be compiled.

    Held throughout: params, optimizer, reference, critic (parameters shard over fsdp*tensor). The train
    step adds grads, activations and logprob_chunks for one micro-batch per device; the old/reference
    log-prob pass adds logprob_pass over its rows (the whole rollout batch). `estimated_peak(parts)` is
    the larger of the two phases. Checked against compiled numbers in tests/test_preflight.py.

    References: activations per layer ~ s*b*h*(34 + 5*a*s/h) bytes in 16-bit, 2*s*b*h with full remat
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4).
    """
    sizes = config_lib.mesh_shape(cfg.mesh, num_devices)
    model_shards, data_parallel = sizes["fsdp"] * sizes["tensor"], sizes["data"] * sizes["fsdp"]
    params = shape.num_params * _DTYPE_BYTES[cfg.model.param_dtype] / model_shards
    minibatch = cfg.rollout.batch_size // cfg.trainer.minibatches
    seqs = max(1, (cfg.trainer.micro_batch_size or minibatch) // data_parallel)
    seq_len = cfg.rollout.vllm.max_model_len  # the longest length bucket
    tokens, layer = seqs * seq_len, _layer_activation_bytes(cfg, shape, seqs, seq_len, sizes["tensor"])
    if keeps_activations(cfg.model.remat):
        activations = shape.layers * layer
    else:  # layer inputs kept, one layer recomputed at a time
        activations = shape.layers * tokens * shape.hidden * _DTYPE_BYTES[cfg.model.compute_dtype] + layer
    chunk = min(shape.vocab, LOGPROB_CHUNK)
    pass_seqs = max(1, cfg.rollout.batch_size // data_parallel)
    from rljax.trainer.optim import OPTIMIZERS  # imports jax: after initialize_jax

    moments = OPTIMIZERS.get(cfg.optim.name).moments  # e.g. adam's mu and nu
    return {
        "params": params,
        "optimizer": moments * params,
        "reference": params if cfg.algo.needs_reference else 0.0,
        # its params, grads and optimizer moments
        "critic": (2 + moments) * params if config_lib.algo_family(cfg).critic else 0.0,
        "grads": params,
        "activations": activations,
        "logprob_chunks": 3 * tokens * chunk * 4,  # f32 logits, softmax and its gradient for one chunk
        # forward only: one layer at a time, f32 final hidden states, logits and softmax of one chunk
        "logprob_pass": _layer_activation_bytes(cfg, shape, pass_seqs, seq_len, sizes["tensor"])
        + pass_seqs * seq_len * (shape.hidden + 2 * chunk) * 4,
    }


def estimated_peak(parts: dict[str, float]) -> float:
    """Peak bytes per device from `estimate_train_memory` parts: held parts + the larger phase."""
    held = parts["params"] + parts["optimizer"] + parts["reference"] + parts["critic"]
    return held + max(parts["grads"] + parts["activations"] + parts["logprob_chunks"], parts["logprob_pass"])
