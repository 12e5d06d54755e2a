"""Tunix's GRPO update on a Qwen2 checkpoint, as its trainer runs it: bench_update's peer.

`google-tunix` is a benchmark dependency only (installed beside the environment: bench_update.py's
docstring; rljax never imports it). The update is
Tunix's own pieces: `tunix.models.qwen2` loaded from the checkpoint's safetensors, the registered "grpo"
policy loss (`tunix.rl.algo_core.grpo_loss_fn`: log-probs of the completion positions only, token-mean,
on-policy old log-probs = stop_gradient of the same forward), and `PeftTrainer._train_step`'s body
(`nnx.value_and_grad`, global norm, `nnx.Optimizer.update`) under `nnx.jit` with the optimizer donated.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax


def tunix_available() -> bool:
    try:
        import tunix.models.qwen2.params  # noqa: F401
    except ImportError:
        return False
    return True


def tunix_config(path: Path):
    from tunix.models.qwen2 import model as qwen2

    c = json.loads((path / "config.json").read_text())
    return qwen2.ModelConfig(
        num_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"],
        head_dim=c["hidden_size"] // c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        rope_theta=int(c.get("rope_theta", 10000)),
        norm_eps=c["rms_norm_eps"],
        use_tied_embedding=c.get("tie_word_embeddings", False),
    )


def make_tunix_update(
    path: str | Path, prompts: np.ndarray, completions: np.ndarray, adv: np.ndarray, lr: float = 1e-6
):
    """`fn()`: one blocking Tunix GRPO update on prompts i32[B,P] + completions i32[B,C] (no padding)."""
    from flax import nnx
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl import algo_core, common

    path = Path(path)
    model = qwen2_params.create_model_from_safe_tensors(str(path), tunix_config(path), dtype=jnp.float32)
    optimizer = nnx.Optimizer(
        model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0)), wrt=nnx.Param
    )
    algo = types.SimpleNamespace(
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_algo="grpo", loss_agg_mode="token-mean", temperature=1.0
    )
    pad_id = eos_id = -1  # no padding in the batch: every id counts

    def loss_fn(model, example):
        return algo_core.grpo_loss_fn(model, example, algo, pad_id, eos_id)

    def train_step(model, optimizer, example):  # PeftTrainer._train_step
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, example)
        grad_norm = optax.global_norm(grads)
        optimizer.update(model, grads)
        return loss, aux, grad_norm

    step = nnx.jit(train_step, donate_argnames=("optimizer",))
    example = common.TrainExample(
        prompt_ids=jnp.asarray(prompts),
        prompt_mask=jnp.ones(prompts.shape, jnp.int32),
        completion_ids=jnp.asarray(completions),
        completion_mask=jnp.ones(completions.shape, jnp.int32),
        advantages=jnp.asarray(adv),
        ref_per_token_logps=None,
        old_per_token_logps=None,
    )

    def run() -> None:
        loss, _, _ = step(model, optimizer, example)
        jax.block_until_ready(loss)

    return run
