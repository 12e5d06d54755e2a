"""A LoRA run end to end (`model.lora_rank > 0`): the loop starts its own vLLM server with runtime LoRA,
pushes only the adapter each step (PEFT tensors, a new adapter name per version), generates with the
adapter of the version each batch was sampled with, and checks every push with the canary at float32's
tolerance. Then the run resumes from its checkpoint in async mode (the adapter pushed in the background)."""

import json
import pathlib
import subprocess
import sys

import pytest
from jax_env import child_env

from rljax import models

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = REPO / "assets" / "tiny_arith"
RANK = 8
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def run_main(workdir, *overrides, timeout=900):
    env = child_env(JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "rljax.main", "--config=configs/grpo.py:smoke", f"--workdir={workdir}"]
    cmd += [f"--config.model.lora_rank={RANK}", "--config.optim.learning_rate=1e-3", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return proc, lines


def adapter_bytes() -> int:
    """float32 bytes of rank-RANK A and B on every attention and MLP projection of the model."""
    config = models.read_model_config(MODEL)
    h, d, heads, kv, mlp = (
        config.hidden_size,
        config.head_dim,
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
    )
    shapes = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, mlp), (h, mlp), (mlp, h)]
    return 4 * RANK * config.num_layers * sum(i + o for i, o in shapes)


def model_bytes() -> int:
    return sum(p.stat().st_size for p in MODEL.glob("*.safetensors"))


def test_lora_run_pushes_the_adapter_only_and_resumes_in_async_mode(tmp_path):
    _, lines = run_main(tmp_path, "--config.trainer.steps=3", "--config.checkpoint.every_steps=3")
    train = [m for m in lines if m["step"] > 0]
    assert len(train) == 3 and adapter_bytes() < 0.25 * model_bytes()
    for m in train:
        assert m["weight_sync/bytes"] == adapter_bytes(), m  # the adapter, not the model
        assert m["weight_sync/canary_logprob_max_abs_diff"] < 1e-3 and m["weight_sync/pause_seconds"] == 0
        assert m["policy/version"] == m["step"] and m["rollout/policy_version"] == m["step"] - 1
        # sampled with the adapter of that version: vLLM's log-probs are the trainer's (base + adapter)
        assert m["logprob/trainer_vs_rollout_abs_diff_max"] < 1e-4, m
    assert train[-1]["optim/grad_norm"] > 0
    config = json.loads((tmp_path / "checkpoints" / "3" / "config" / "metadata").read_text())
    assert config["lora_base"]["path"] == str(MODEL) and config["model"]["lora_rank"] == RANK
    assert not list((tmp_path / "lora_adapters").iterdir())  # every version retired when the run ended

    proc, lines = run_main(tmp_path, "--config.trainer.steps=5", "--config.trainer.max_staleness=1")
    assert "resuming from checkpoint step 3" in proc.stdout
    resumed = [m for m in lines if m["step"] > 3]
    assert [m["step"] for m in resumed] == [4, 5]
    # pushed in the background (step s logs the pushes delivered since s - 1; the last waits for its own)
    assert sum(m.get("weight_sync/bytes", 0) for m in resumed) == 2 * adapter_bytes()
    for m in resumed:  # a batch sampled one version behind is trained on as such (no exact match then)
        assert m["staleness/max"] <= 1 and m["rollout/policy_version"] >= m["step"] - 2, m
        fresh = m["staleness/max"] == 0
        assert not fresh or m["logprob/trainer_vs_rollout_abs_diff_max"] < 1e-4, m
