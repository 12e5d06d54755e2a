"""Model FLOPs of one update, from the config and the parameter shapes (for `perf/mfu`).

Per token, a forward + backward pass costs 6 N + 12 L T d and a forward alone 2 N + 4 L T d, with N the
parameters that enter a matmul (an untied input embedding is a lookup and does not count; a tied one is
the head), L layers, d = heads x head_dim, and T the row length (for packed rows an upper bound on each
sequence's context). One update runs `trainer.epochs` forward + backward passes over the batch, plus one
forward for the reference log-probs (`algo.beta > 0`) and one for the old log-probs unless the update
takes them from its own forward (`update.on_policy_shortcut`). PPO's critic (a copy of the decoder with a
scalar head) trains alongside: its forward + backward per epoch and its value forward count too, at the
policy's N (its scalar head replaces the vocabulary head: a small overcount).
With LoRA (`lora_rank > 0`) N is the base model's (the adapters' matmuls are rank-r: negligible) and a
forward + backward costs 4 N + 12 L T d: no weight gradients of the frozen base, only the activations'.
Rematerialised recomputation is overhead, not model FLOPs, and is not counted.

References: Kaplan et al. 2020 (arXiv:2001.08361) sec. 2.1; Chowdhery et al. 2022 (PaLM) appendix B.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rljax.config import Config
from rljax.trainer.update import on_policy_shortcut


def matmul_params(params: Any, model_config: Any) -> int:
    """N: the parameter count of `params` (a decoder's tree: the base model's with LoRA, whose adapters'
    rank-r matmuls are left out), less an untied input embedding table."""
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    if not model_config.tie_word_embeddings:
        n -= model_config.vocab_size * model_config.hidden_size
    return n


def update_flops(
    cfg: Config, model_config: Any, num_params: int, tokens: float, row_length: int, *, critic: bool = False
) -> float:
    """Model FLOPs of one update over `tokens` non-padding tokens in rows of `row_length` (module doc);
    `num_params` is `matmul_params` of the policy; `critic`: the state trains a critic (PPO), whose
    update computes old log-probs and old values in passes of their own."""
    attention = model_config.num_layers * model_config.num_heads * model_config.head_dim * row_length
    weight_grads = 0.0 if getattr(model_config, "lora_rank", 0) else 2.0 * num_params  # LoRA: frozen base
    train, forward = 4.0 * num_params + weight_grads + 12.0 * attention, 2.0 * num_params + 4.0 * attention
    policy = cfg.trainer.epochs * train + forward * (
        int(cfg.algo.needs_reference) + int(critic or not on_policy_shortcut(cfg))
    )
    return tokens * (policy + (cfg.trainer.epochs * train + forward if critic else 0.0))
