"""The LoRA parts of a run (`model.lora_rank > 0`, docs/lora.md): the initial adapter, the frozen base
held beside the train state, the base's identity in every checkpoint, and the weight push.

Until adapter-only sync lands, a LoRA run pushes the merged model (`W + (alpha / r) A B`, in the base's
dtype) through the full push path: the rollout engine and its canary see a plain model of the base's
config, so serving stays exactly the trainer's policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from rljax import models
from rljax.checkpoint import Checkpointer, CheckpointMismatchError, base_identity
from rljax.config import Config
from rljax.models import lora
from rljax.trainer.state import base_shardings


def initial_params(cfg: Config, model_config: models.ModelConfig, params: Any) -> Any:
    """`TrainState.params` at step 0: the checkpoint's params, or with LoRA a fresh adapter (B = 0, A
    from `trainer.seed`: the policy starts as the base model)."""
    if not model_config.lora_rank:
        return params
    return lora.init_adapter(model_config, jax.random.key(cfg.trainer.seed))


def engine_view(cfg: Config, model_config: models.ModelConfig) -> tuple[Config, models.ModelConfig]:
    """(config, model config) the rollout engine is built with: the run's, or with LoRA the base model's
    (the engine serves and checks merged weights, a plain model)."""
    if not model_config.lora_rank:
        return cfg, model_config
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=0))
    return plain, lora.base_config(model_config)


class MergedPushEngine:
    """A rollout engine whose pushes take the adapter (`TrainState.params` of a LoRA run) and send the
    merged model; everything else is the wrapped engine's."""

    def __init__(self, engine: Any, model_config: models.ModelConfig, base: Any, mesh: Mesh):
        self.engine, self.base = engine, base
        merge = lambda b, a: lora.merged_params(model_config, b, a)  # noqa: E731
        self._merge = jax.jit(merge, out_shardings=base_shardings(model_config, mesh))

    def merged(self, adapter: Any) -> Any:
        """The full params `base + adapter` folded (the base's shardings and dtype)."""
        return self._merge(self.base, adapter)

    def push_weights(self, params: Any, version: int) -> dict[str, float]:
        return self.engine.push_weights(self.merged(params), version)

    def start_push(self, params: Any, version: int, on_served: Any = None) -> None:
        self.engine.start_push(self.merged(params), version, on_served=on_served)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def checkpoint_config(cfg: Config, config_dict: dict) -> dict:
    """The config saved with every checkpoint; with LoRA plus `lora_base`, the base's identity."""
    if not cfg.model.lora_rank:
        return config_dict
    return config_dict | {"lora_base": base_identity(cfg.model.path)}


def check_base(checkpointer: Checkpointer, step: int, config_dict: dict) -> None:
    """Raises CheckpointMismatchError when a LoRA checkpoint's base is not this run's base model."""
    if "lora_base" not in config_dict:
        return
    saved = checkpointer.restore_config(step).get("lora_base")  # absent: a full fine-tuning checkpoint
    if saved is None or saved["fingerprint"] != config_dict["lora_base"]["fingerprint"]:
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {checkpointer.directory}: its LoRA base {saved} is not this run's "
            f"base model {config_dict['lora_base']} (the adapter only fits the model it was trained on)"
        )
