"""Memory from the compiler: the train step and log-prob passes compiled for 8 simulated devices."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import pytest

from rljax import memory, models, preflight
from rljax.config import Config
from rljax.models.presets import PRESETS
from rljax.sharding import make_mesh
from rljax.trainer.optim import make_optimizer, total_optimizer_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024**3
TINY = models.ModelConfig(
    family="qwen2",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=True,
    tie_word_embeddings=True,
)


def tiny_cfg(**algo) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg,
        algo=dataclasses.replace(cfg.algo, **algo),
        trainer=dataclasses.replace(cfg.trainer, micro_batch_size=16),
        mesh=dataclasses.replace(cfg.mesh, allow_replication=True),  # 2 KV heads on 8 devices
    )


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(1, -1, 1)


@pytest.fixture(scope="module")
def reports(mesh):
    """Reports for 64 and 128 rows of 64 tokens, with a reference pass (beta > 0)."""
    cfg = tiny_cfg(beta=0.04)
    return {
        rows: memory.compiled_train_memory(cfg, TINY, mesh, memory.TrainShapes(rows, 64, rows))
        for rows in (64, 128)
    }


def test_report_has_every_pass_with_positive_bytes(reports, mesh):
    report = reports[64]
    assert set(report) == {"train_step", "old_logprobs", "ref_logprobs"}
    for name, m in report.items():
        assert m.argument_bytes > 0 and m.temp_bytes > 0 and m.compile_s > 0, (name, m)
        assert m.peak_bytes == m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes
    # The state is donated: its outputs alias its inputs (parameters + adam moments, at least).
    state = memory.abstract_train_state(tiny_cfg(), TINY, mesh, adamw())
    assert report["train_step"].alias_bytes >= memory.device_bytes(state)
    # The reference pass is the old pass's executable; beside it the device holds the whole state.
    ref, old = report["ref_logprobs"], report["old_logprobs"]
    assert ref.peak_bytes == old.peak_bytes and ref.resident_bytes > memory.device_bytes(state)


def adamw():
    cfg = tiny_cfg()
    return make_optimizer(cfg.optim, total_optimizer_steps(cfg))


def test_doubling_rows_raises_the_batch_argument_bytes(reports):
    small, large = reports[64], reports[128]
    for name in ("train_step", "old_logprobs"):
        assert large[name].argument_bytes > small[name].argument_bytes, name
    # The old pass runs over the whole batch: 64 more rows of logp and entropy f32[B,64], split over 8.
    extra = large["old_logprobs"].output_bytes - small["old_logprobs"].output_bytes
    assert extra == 64 // 8 * 64 * 4 * 2


def test_device_bytes_of_sharded_leaves(mesh):
    state = memory.abstract_train_state(tiny_cfg(), TINY, mesh, adamw())
    embed = state.params["embed"]["embedding"]  # [V, d] float32, d split over fsdp=8
    assert memory.device_bytes(embed) == 512 * 64 * 4 // 8
    inputs = memory.abstract_loss_inputs(tiny_cfg(), 64, 32, mesh)  # rows split over 8 devices
    assert memory.device_bytes(inputs.input_ids) == 64 * 32 * 4 // 8


def test_ppo_compiles_actor_and_critic(mesh):
    cfg = tiny_cfg(family="ppo")
    report = memory.compiled_train_memory(cfg, TINY, mesh, memory.TrainShapes(16, 32, 16))
    assert set(report) == {"train_step", "old_logprobs"}
    # The critic is a second decoder with its own adam moments, all in the donated state.
    ppo_state = memory.device_bytes(memory.abstract_train_state(cfg, TINY, mesh, adamw()))
    grpo_state = memory.device_bytes(memory.abstract_train_state(tiny_cfg(), TINY, mesh, adamw()))
    assert ppo_state > 1.8 * grpo_state
    assert report["train_step"].alias_bytes >= ppo_state


def write_tiny_checkpoint_config(path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY.to_hf_dict(), f)
    return str(path)


def test_budget_check_fails_with_the_compiled_numbers(tmp_path):
    cfg = tiny_cfg()
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=write_tiny_checkpoint_config(tmp_path / "tiny")),
        mesh=dataclasses.replace(cfg.mesh, device_memory_gib=0.001),  # 1 MiB
        rollout=dataclasses.replace(
            cfg.rollout, batch_size=32, vllm=dataclasses.replace(cfg.rollout.vllm, urls=("http://x",))
        ),
    )
    logged = []
    lines = preflight.run_preflight(
        cfg, num_devices=8, num_processes=1, device_memory_bytes=80 * GIB, rollout_urls=(), log=logged.append
    )
    memory_lines = [line for line in lines if line.startswith("memory:")]
    assert len(memory_lines) == 1, lines
    line = memory_lines[0]
    for fragment in ("at its peak", "compiled for 32 rows x 512 tokens", "train_step", "old_logprobs",
                     "temp", "argument", "a device has 0.00 GiB (mesh.device_memory_gib)"):  # fmt: skip
        assert fragment in line, (fragment, line)
    assert any(entry.startswith("memory per device") for entry in logged), logged
    # The same setup with the device's own 80 GiB passes.
    ok = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, device_memory_gib=0.0))
    kwargs = dict(num_devices=8, num_processes=1, device_memory_bytes=80 * GIB, rollout_urls=())
    assert preflight.run_preflight(ok, **kwargs) == []


def test_presets_parse_like_their_checkpoints():
    # Published parameter counts (Hugging Face model cards): 494M, 7.62B, 8.03B.
    counts = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "llama3-8b": 8_030_261_248}
    for name, expected in counts.items():
        config = PRESETS.get(name)
        n = sum(math.prod(p.shape) for p in jax.tree.leaves(models.abstract_params(config)))
        assert n == expected, name
        assert models.ModelConfig.from_hf_dict(config.to_hf_dict()) == config, name
    assert PRESETS.get("llama3-8b").rope_scaling.factor == 8.0
    with pytest.raises(KeyError, match="qwen2.5-7b"):
        PRESETS.get("qwen-7b")


def test_bench_memory_smoke(tmp_path):
    out = tmp_path / "mem.json"
    args = "--model qwen2.5-0.5b --devices 8 --mesh fsdp=8 --seq-len 64 --rollouts 16 --beta 0.04"
    cmd = [sys.executable, "benchmarks/bench_memory.py", *args.split(), "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    for key in ("train_step_bytes", "old_logprobs_bytes", "ref_logprobs_bytes", "train_step_temp_bytes"):
        assert result[key] > 0, key
    assert result["micro_batch_size"] == 8 and result["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    # f32 masters of 494M params over 8 devices, plus two adam moments, are in the step's arguments.
    assert result["functions"]["train_step"]["argument_bytes"] > 3 * 494_032_768 * 4 / 8
    assert "train_step" in proc.stdout and "old_logprobs" in proc.stdout
