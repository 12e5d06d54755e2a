"""The prepared GPU acceptance run: scripts/gpu_check.sh skips clearly without a GPU (exit 0, JSON saying so),
both scripts parse, and the pieces it runs (MFU arithmetic, the log-prob bench's ratios, the attention bench)
give the right figures on CPU."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import types

import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_attention  # noqa: E402
import bench_train_step  # noqa: E402
from rljax.kernels.bench_logprobs import summarize  # noqa: E402

from rljax import models  # noqa: E402


def _has_nvidia_gpu() -> bool:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.startswith("GPU ") for line in out.stdout.splitlines())


@pytest.mark.skipif(_has_nvidia_gpu(), reason="a GPU is present: the script would run the real check")
def test_gpu_check_skips_clearly_without_a_gpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "no NVIDIA GPU: skipped" in proc.stdout
    assert "no NVIDIA GPU: skipped" in (out / "gpu_check.log").read_text()
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "skipped" and report["reason"] == "no NVIDIA GPU"


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True, timeout=30)


def test_wheels_folder_is_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", ".whl/x.whl"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, "the carried wheels must not be committed"


def test_model_flops_per_token_by_hand():
    # Qwen2.5-0.5B: 494,032,768 params, tied (the table counts once, as the head); 24 layers, 14 x 64.
    mc = models.ModelConfig(family="qwen2", attention_bias=True, **bench_train_step.MODELS["qwen2.5-0.5b"])
    params = models.abstract_params(mc)
    assert sum(x.size for x in jax.tree.leaves(params)) == 494_032_768
    big = models.ModelConfig(family="qwen2", attention_bias=True, **bench_train_step.MODELS["qwen2.5-1.5b"])
    assert (
        sum(x.size for x in jax.tree.leaves(models.abstract_params(big))) == 1_543_714_304
    )  # the GPU check's
    assert bench_train_step.flops_per_token(mc, params, 1024) == 6 * 494_032_768 + 12 * 24 * 14 * 64 * 1024
    untied = models.ModelConfig(family="qwen2", **bench_train_step.MODELS["small"])
    p = models.abstract_params(untied)
    n = sum(x.size for x in jax.tree.leaves(p)) - 8192 * 256  # the input embedding is a lookup
    assert bench_train_step.flops_per_token(untied, p, 64) == 6 * n + 12 * 4 * 4 * 64 * 64


def test_peak_flops_by_device_kind():
    dev = lambda kind: types.SimpleNamespace(device_kind=kind)
    assert bench_train_step.peak_flops(dev("NVIDIA H200"), None) == 989e12
    assert bench_train_step.peak_flops(dev("NVIDIA H100 80GB HBM3"), None) == 989e12
    assert bench_train_step.peak_flops(dev("cpu"), None) is None
    assert bench_train_step.peak_flops(dev("cpu"), 1e12) == 1e12


def test_logprob_bench_ratios_are_against_the_same_run():
    results = summarize(
        {
            "reference": {"temp_bytes": 1000, "seconds": 2.0},
            "xla": {"temp_bytes": 100, "seconds": 1.0},
            "triton": {"temp_bytes": 50, "seconds": 0.5},
            "pallas": {"error": "ValueError: no"},
        }
    )
    assert results["triton"]["mem_ratio_vs_reference"] == 20 and results["triton"]["speedup_vs_xla"] == 2
    assert results["triton"]["time_ratio_vs_reference"] == 0.25
    assert results["pallas"] == {"error": "ValueError: no"}


def test_attention_bench_runs_and_agrees_on_cpu(tmp_path):
    argv = "--impls blockwise,materialized,cudnn --batch 1 --length 40 --heads 4 --kv-heads 2 --head-dim 8"
    argv += f" --dtype float32 --block-size 16 --iters 1 --json {tmp_path / 'a.json'}"
    results = bench_attention.main(argv.split())
    assert results["materialized"]["rel_diff"] <= 1e-5 and results["blockwise"]["rel_diff"] == 0.0
    assert "bfloat16" in results["cudnn"]["error"]  # cuDNN refuses float32: reported, not fatal
    assert json.loads((tmp_path / "a.json").read_text())["impls"]["materialized"]["seconds"] > 0


def test_memory_share_check_compares_the_pool_with_the_plan():
    import check_memory_share

    assert (
        check_memory_share.planned_share(1, ["--config=configs/grpo.py"]) == 0.80
    )  # 0.95 - the server's 0.15
    gib = 2**30
    assert check_memory_share.compare(0.80, int(0.795 * 80 * gib), 80 * gib, 0.02)["honoured"]
    assert not check_memory_share.compare(0.80, int(0.75 * 80 * gib), 80 * gib, 0.02)["honoured"]  # JAX's own
