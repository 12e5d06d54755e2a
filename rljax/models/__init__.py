"""Flax decoder LLMs with exact Hugging Face interop (Qwen2/Qwen2.5, Qwen3, Llama 3).

Plain jnp functions over a params dict (no Module objects): `forward(config, params, ...)` is pure and
jit-able with the hashable `ModelConfig` static. See `params.py` for the parameter table.
"""

from rljax.models.attention import ATTENTION_IMPLS, resolve_attention_impl
from rljax.models.config import FAMILIES, ROPE_TYPES, ModelConfig, RopeScaling, rope_inv_freq
from rljax.models.decoder import (
    decode_step,
    forward,
    hidden_states,
    init_cache,
    logits_from_hidden,
    prefill,
)
from rljax.models.hf import (
    hf_tensor_specs,
    iter_hf_tensors,
    load_hf_checkpoint,
    load_tokenizer,
    save_hf_checkpoint,
)
from rljax.models.params import abstract_params, init_params, param_logical_axes, unembed_matrix
from rljax.models.remat import REMAT_POLICIES

__all__ = [
    "ATTENTION_IMPLS",
    "FAMILIES",
    "REMAT_POLICIES",
    "ROPE_TYPES",
    "ModelConfig",
    "RopeScaling",
    "abstract_params",
    "decode_step",
    "forward",
    "hf_tensor_specs",
    "hidden_states",
    "init_cache",
    "init_params",
    "iter_hf_tensors",
    "load_hf_checkpoint",
    "load_tokenizer",
    "logits_from_hidden",
    "param_logical_axes",
    "prefill",
    "resolve_attention_impl",
    "rope_inv_freq",
    "save_hf_checkpoint",
    "unembed_matrix",
]
