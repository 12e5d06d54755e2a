"""Flax NNX decoder LLMs with exact Hugging Face interop (Qwen2/Qwen2.5, Qwen3, Llama 3), and the
protocol for bringing your own decoder (docs/models.md).

The decoder is a `flax.nnx.Module` (`build_model`); what flows through jit, `TrainState`, orbax and weight
sync is its pure state, a nested dict of arrays ("params"). `forward(config, params, ...)` and friends are
pure and jit-able with the hashable `ModelConfig` static; they merge the module inside. The HF mapping
table (`params.py`, one per decoder class) drives checkpoint load, save and weight sync.
"""

from rljax.models.attention import ATTENTION_IMPLS, resolve_attention_impl
from rljax.models.config import FAMILIES, ROPE_TYPES, ModelConfig, RopeScaling, rope_inv_freq
from rljax.models.decoder import Decoder
from rljax.models.hf import (
    hf_tensor_specs,
    iter_hf_tensors,
    iter_owned_hf_slices,
    load_hf_checkpoint,
    load_tokenizer,
    read_model_config,
    save_hf_checkpoint,
)
from rljax.models.model import (
    DECODERS,
    abstract_params,
    build_model,
    decode_step,
    decoder_class,
    forward,
    hidden_states,
    init_cache,
    init_params,
    logits_from_hidden,
    param_entries,
    param_logical_axes,
    prefill,
    resolve_decoder,
    unembed_matrix,
)
from rljax.models.nn import AUTO_UNROLL_MAX_LAYERS
from rljax.models.params import HFTensor
from rljax.models.remat import REMAT_POLICIES

__all__ = [
    "ATTENTION_IMPLS",
    "AUTO_UNROLL_MAX_LAYERS",
    "DECODERS",
    "FAMILIES",
    "REMAT_POLICIES",
    "ROPE_TYPES",
    "Decoder",
    "HFTensor",
    "ModelConfig",
    "RopeScaling",
    "abstract_params",
    "build_model",
    "decode_step",
    "decoder_class",
    "forward",
    "hf_tensor_specs",
    "hidden_states",
    "init_cache",
    "init_params",
    "iter_hf_tensors",
    "iter_owned_hf_slices",
    "load_hf_checkpoint",
    "load_tokenizer",
    "read_model_config",
    "logits_from_hidden",
    "param_entries",
    "param_logical_axes",
    "prefill",
    "resolve_attention_impl",
    "resolve_decoder",
    "rope_inv_freq",
    "save_hf_checkpoint",
    "unembed_matrix",
]
