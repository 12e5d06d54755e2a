"""`ModelConfig` (static, hashable) and its two-way translation to Hugging Face `config.json` dicts.

Families and RoPE variants are registries: a new family is a registered parser, not a string switch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from rljax.registry import Registry

FAMILIES: Registry[FamilySpec] = Registry("model family")
ROPE_TYPES: Registry[Any] = Registry("rope type")
DTYPES = ("float32", "bfloat16", "float16")
# The attention and MLP projections of the built-in decoder (also their Hugging Face module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder's shapes and math depend on. Hashable: pass it as a static jit argument.

    `hf_config_json` keeps the source `config.json` (excluded from equality and hashing) so a saved
    checkpoint keeps fields the model does not use (token ids, generation defaults, ...).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool = False  # bias on the output projection (Llama/Qwen3 `attention_bias`)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"  # a name in rljax.models.REMAT_POLICIES, applied to the scanned layer body
    attention_impl: str = "auto"  # a name in rljax.models.ATTENTION_IMPLS, or "auto" (by backend)
    attention_block_size: int = 512  # query/key block of the blockwise attention
    unroll_layers: int = 0  # layers per scan iteration; 0: `nn.layer_unroll`'s choice by depth
    # The decoder class: "" (the built-in one of `family`), a name in rljax.models.DECODERS, or
    # "package.module:Class" (bring your own model; docs/models.md).
    decoder: str = ""
    # LoRA (rljax.models.lora): rank 0 is full fine-tuning (no adapter params). Targets are module-name
    # patterns (regexes matched against the module's last name or its whole path, e.g. `layers/q_proj`).
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    hf_config_json: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        FAMILIES.get(self.family)
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; valid: {', '.join(DTYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf_dict(
        cls,
        d: dict[str, Any],
        *,
        param_dtype: str | None = None,
        compute_dtype: str | None = None,
        remat: str = "none",
        decoder: str = "",
    ) -> ModelConfig:
        """Parses a Hugging Face `config.json` dict. `param_dtype` defaults to the checkpoint's dtype
        (float32 when absent), `compute_dtype` to `param_dtype`. Unknown architectures and unsupported
        options raise, naming the supported ones."""
        family = family_of(d)
        _check_supported(d)
        rope_theta, rope_scaling = _parse_rope(d)
        param_dtype = param_dtype or str(d.get("dtype") or d.get("torch_dtype") or "float32")
        num_heads = int(d["num_attention_heads"])
        return cls(
            family=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            param_dtype=param_dtype,
            compute_dtype=compute_dtype or param_dtype,
            remat=remat,
            decoder=decoder,
            hf_config_json=json.dumps(d, sort_keys=True),
            **FAMILIES.get(family).options(d),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict for this config (source fields kept, model fields set)."""
        d = json.loads(self.hf_config_json) if self.hf_config_json else {}
        for legacy in ("rope_scaling", "rope_theta", "torch_dtype"):
            d.pop(legacy, None)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(dataclasses.asdict(self.rope_scaling))
        fam = FAMILIES.get(self.family)
        d.update(
            architectures=[fam.architecture],
            model_type=fam.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            dtype=self.param_dtype,
        )
        d.update(fam.hf_options(self))
        return d


def family_of(d: dict[str, Any]) -> str:
    """Family name of a Hugging Face config dict, from `architectures[0]` (or `model_type`)."""
    by_arch = {FAMILIES.get(n).architecture: n for n in FAMILIES.names()}
    by_type = {FAMILIES.get(n).model_type: n for n in FAMILIES.names()}
    archs = d.get("architectures") or []
    if archs:
        if archs[0] in by_arch:
            return by_arch[archs[0]]
        raise ValueError(f"unknown architecture {archs[0]!r}; supported: {', '.join(sorted(by_arch))}")
    if d.get("model_type") in by_type:
        return by_type[d["model_type"]]
    raise ValueError(
        f"unknown architecture (model_type={d.get('model_type')!r}, no `architectures`); "
        f"supported: {', '.join(sorted(by_arch))}"
    )


def _check_supported(d: dict[str, Any]) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; supported: silu")
    if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or []):
        raise ValueError("sliding-window attention is not supported (use_sliding_window / layer_types)")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")


def _parse_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers-5 `rope_parameters` or the legacy `rope_theta`/`rope_scaling`."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return theta, ROPE_TYPES.get(rope_type)(rope)


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """How one Hugging Face architecture maps onto `ModelConfig`.

    `options(hf_dict)` gives the family's `ModelConfig` fields; `hf_options(config)` the family's own
    `config.json` fields when saving.
    """

    architecture: str
    model_type: str
    options: Callable[[dict[str, Any]], dict[str, Any]]
    hf_options: Callable[[ModelConfig], dict[str, Any]]


FAMILIES.add(
    "qwen2",  # Qwen2 / Qwen2.5: q/k/v always carry a bias, o_proj never does
    FamilySpec(
        "Qwen2ForCausalLM",
        "qwen2",
        options=lambda d: dict(attention_bias=True, attention_out_bias=False, qk_norm=False),
        hf_options=lambda c: dict(use_sliding_window=False),
    ),
)
FAMILIES.add(
    "qwen3",  # Qwen3 dense: per-head q/k RMSNorm; `attention_bias` covers q/k/v and o
    FamilySpec(
        "Qwen3ForCausalLM",
        "qwen3",
        options=lambda d: dict(
            attention_bias=bool(d.get("attention_bias", False)),
            attention_out_bias=bool(d.get("attention_bias", False)),
            qk_norm=True,
        ),
        hf_options=lambda c: dict(attention_bias=c.attention_bias, use_sliding_window=False),
    ),
)
FAMILIES.add(
    "llama",  # Llama 2/3: `attention_bias` covers q/k/v and o
    FamilySpec(
        "LlamaForCausalLM",
        "llama",
        options=lambda d: dict(
            attention_bias=bool(d.get("attention_bias", False)),
            attention_out_bias=bool(d.get("attention_bias", False)),
            qk_norm=False,
        ),
        hf_options=lambda c: dict(attention_bias=c.attention_bias, mlp_bias=False),
    ),
)


@ROPE_TYPES.register("default")
def _parse_default_rope(rope: dict[str, Any]) -> None:
    return None


@ROPE_TYPES.register("llama3")
def _parse_llama3_rope(rope: dict[str, Any]) -> RopeScaling:
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies `f32[head_dim/2]`, with Llama 3 scaling when configured.

    Llama 3: wavelengths longer than `original_max / low_freq_factor` are slowed by `factor`, shorter
    than `original_max / high_freq_factor` kept, and those in between interpolated linearly in
    `original_max / wavelength`.

    References: Su et al. 2021 (RoFormer, arXiv:2104.09864); Llama 3 herd paper (arXiv:2407.21783).
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    s = config.rope_scaling
    if s is not None:
        wavelen = 2 * math.pi / inv_freq
        ratio = s.original_max_position_embeddings / wavelen
        smooth = np.clip((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor), 0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return inv_freq.astype(np.float32)
