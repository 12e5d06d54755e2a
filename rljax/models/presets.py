"""Built-in model shapes of public checkpoints, for sizing and compile-only benchmarks (no weights).

`PRESETS.get(name)` is the `ModelConfig` a checkpoint's `config.json` would parse to (sizes from the
Hugging Face model cards: Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-7B, meta-llama/Llama-3.1-8B). Dtypes,
remat and attention are the ModelConfig defaults; the trainer overrides them from `cfg.model`.
"""

from __future__ import annotations

from rljax.models.config import ModelConfig, RopeScaling
from rljax.registry import Registry

PRESETS: Registry[ModelConfig] = Registry("model preset")
PRESETS.add(
    "qwen2.5-0.5b",
    ModelConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=32768,
    ),
)
PRESETS.add(
    "qwen2.5-7b",
    ModelConfig(
        family="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_bias=True,
        max_position_embeddings=32768,
    ),
)
PRESETS.add(
    "llama3-8b",  # the Llama 3.1 generation: llama3 RoPE scaling for a 128k context
    ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
)
