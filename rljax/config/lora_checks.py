"""Config checks of the LoRA fields (`model.lora_rank`, `lora_alpha`, `lora_targets`; docs/lora.md)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rljax.config.schema import FP8_SERVING, Config, ConfigError

MAX_VLLM_LORA_RANK = 512  # vLLM's largest --max-lora-rank (rljax.weight_sync.adapters.VLLM_MAX_RANKS)

if TYPE_CHECKING:
    from rljax.algos import Family


def validate_lora(cfg: Config, family: Family) -> None:
    """With `model.lora_rank > 0`: alpha > 0, targets non-empty valid regexes, and a family without a
    critic (PPO's critic is a second full decoder; adapters for it are not built). Raises ConfigError."""
    m = cfg.model
    if not m.lora_rank:
        return
    if m.lora_rank > MAX_VLLM_LORA_RANK:
        raise ConfigError(
            "model.lora_rank", f"vLLM serves ranks up to {MAX_VLLM_LORA_RANK}, got {m.lora_rank}"
        )
    if cfg.rollout.weight_sync.dtype == FP8_SERVING:
        raise ConfigError(
            "rollout.weight_sync.dtype",
            "float8_e4m3 pushes fp8 model weights; a LoRA run pushes only its adapter (leave it unset)",
        )
    if not m.lora_alpha > 0:
        raise ConfigError("model.lora_alpha", f"must be > 0 with model.lora_rank > 0, got {m.lora_alpha!r}")
    if not m.lora_targets or not all(isinstance(t, str) and t for t in m.lora_targets):
        raise ConfigError(
            "model.lora_targets", f"must be non-empty module name patterns, got {m.lora_targets!r}"
        )
    for target in m.lora_targets:
        try:
            re.compile(target)
        except re.error as e:
            raise ConfigError("model.lora_targets", f"{target!r} is not a valid regex: {e}") from None
    if family.critic:
        raise ConfigError(
            "model.lora_rank",
            f"LoRA trains the GRPO family only (algo.family={cfg.algo.family!r} has a critic)",
        )
