"""The LoRA parts of a run's set-up (`model.lora_rank > 0`, docs/lora.md): the initial adapter and the
base's identity in every checkpoint. The push of each version as an adapter is `rljax.loop.engine.
AdapterWeights` (snapshots) and `rljax.weight_sync.adapters` (the servers' side)."""

from __future__ import annotations

from typing import Any

import jax

from rljax import models
from rljax.checkpoint import Checkpointer, CheckpointMismatchError, base_identity
from rljax.config import Config
from rljax.models import lora


def initial_params(cfg: Config, model_config: models.ModelConfig, params: Any) -> Any:
    """`TrainState.params` at step 0: the checkpoint's params, or with LoRA a fresh adapter (B = 0, A
    from `trainer.seed`: the policy starts as the base model)."""
    if not model_config.lora_rank:
        return params
    return lora.init_adapter(model_config, jax.random.key(cfg.trainer.seed))


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
