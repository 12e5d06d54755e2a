"""perf/mfu: the update's model FLOPs from the config and parameter shapes, over the configured peak."""

import types

import jax
import numpy as np
import pytest
from mp_trainer_common import with_fields

from rljax.config import Config
from rljax.loop import train
from rljax.loop.train import mfu_metrics
from rljax.metrics import peak_flops
from rljax.trainer.flops import matmul_params, update_flops
from rljax.trainer.state import TrainState

MC = types.SimpleNamespace(
    num_layers=2,
    num_heads=4,
    head_dim=8,
    vocab_size=100,
    hidden_size=16,
    tie_word_embeddings=False,
    lora_rank=0,
)
PARAMS = {"embed": np.zeros((100, 16)), "layer": {"w": np.zeros((16, 64))}, "head": np.zeros((16, 100))}


def test_matmul_params_leave_out_an_untied_embedding():
    assert matmul_params(PARAMS, MC) == 16 * 64 + 16 * 100
    tied = types.SimpleNamespace(**{**vars(MC), "tie_word_embeddings": True})
    assert matmul_params({"embed": PARAMS["embed"], "layer": PARAMS["layer"]}, tied) == 100 * 16 + 16 * 64


def test_update_flops_counts_each_pass():
    n, tokens, t = 1000, 50.0, 32
    attn = 2 * 4 * 8 * t  # L * heads * head_dim * T
    train, fwd = 6 * n + 12 * attn, 2 * n + 4 * attn
    on_policy = Config()  # epochs = minibatches = 1, beta 0: the one train pass, old log-probs from it
    assert update_flops(on_policy, MC, n, tokens, t) == tokens * train
    kl = with_fields(on_policy, algo__beta=0.1)  # + the reference forward
    assert update_flops(kl, MC, n, tokens, t) == tokens * (train + fwd)
    two = with_fields(on_policy, trainer__epochs=2)  # two train passes + a separate old log-prob pass
    assert update_flops(two, MC, n, tokens, t) == tokens * (2 * train + fwd)
    # A critic (PPO): the policy's old log-prob forward, the critic's train pass and value forward.
    assert update_flops(on_policy, MC, n, tokens, t, critic=True) == tokens * (2 * train + 2 * fwd)


def mfu(peak: float, batch, update_s: float) -> dict:
    cfg = with_fields(Config(), metrics__peak_flops_per_device=peak)
    state = TrainState(step=np.int32(0), params=PARAMS, opt_state=(), nonfinite_count=np.int32(0))
    return mfu_metrics(cfg, MC, state, batch, update_s)


def test_mfu_against_the_configured_peak_and_left_out_on_cpu(monkeypatch):
    segments = np.zeros((2, 32), np.int32)
    segments[0, :20], segments[1, :12] = 1, 1  # 32 real tokens, the rest padding
    batch = types.SimpleNamespace(segment_ids=segments)
    n = matmul_params(PARAMS, MC)
    want = update_flops(Config(), MC, n, 32.0, 32) / (0.5 * 1e9 * jax.device_count())
    assert mfu(1e9, batch, update_s=0.5) == {"perf/mfu": pytest.approx(want)}
    # No datasheet peak for a CPU ("cpu" is not in PEAK_BF16_FLOPS): left out unless configured.
    monkeypatch.setattr(train, "peak_flops", lambda kind: peak_flops("cpu"))
    assert mfu(0.0, batch, update_s=0.5) == {}


def test_lora_counts_the_base_models_matmuls_without_its_weight_gradients():
    """LoRA: N is the base model's (the loop passes its params, not the adapter), and a train pass costs
    4 N (forward, activation gradients): the frozen base has no weight gradients."""
    import dataclasses

    from rljax import models
    from rljax.models import lora
    from rljax.models.config import ModelConfig
    from rljax.models.tiny import tiny_hf_config

    config = ModelConfig.from_hf_dict(tiny_hf_config("qwen2", tie_word_embeddings=False).to_dict())
    config = dataclasses.replace(config, lora_rank=4, lora_alpha=8.0)
    n = matmul_params(models.abstract_params(lora.base_config(config)), config)
    full = sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(models.abstract_params(lora.base_config(config)))
    )
    assert n == full - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    attn = config.num_layers * config.num_heads * config.head_dim * 32
    plain = dataclasses.replace(config, lora_rank=0)
    assert update_flops(Config(), config, n, 10.0, 32) == 10.0 * (4 * n + 12 * attn)
    assert update_flops(Config(), plain, n, 10.0, 32) == 10.0 * (6 * n + 12 * attn)
