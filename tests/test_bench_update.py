"""Smoke test of benchmarks/bench_update.py at the tiny shape: every run is timed, the ratios are those of
the medians; and the plain floor computes the same GRPO gradient as rljax's update on the same tokens."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax_env import child_env

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_bench_update_times_rljax_against_the_plain_floor(tmp_path):
    out = tmp_path / "update.json"
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "benchmarks/bench_update.py", "--model", "tiny", "--rounds", "2", "--no-tunix"]
    cmd += ["--variant", "scanned:model.unroll_layers=1", "--json", str(out)]
    # a group of 8 sharing its 8-token prompt: 8 + 8 x 33 = 272 tokens in one packed row
    cmd += ["--variant", "shared:trainer.tokens_per_micro_batch=272,trainer.share_prompts=true"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert set(s["seconds"]) == {"rljax", "scanned", "shared", "plain"}
    assert all(len(t) == 2 and min(t) > 0 for t in s["all"].values())
    ratio = s["ratios"]["rljax"]["plain"]
    assert ratio == pytest.approx(s["seconds"]["rljax"] / s["seconds"]["plain"])
    assert "rljax / plain:" in proc.stdout


def test_the_plain_floor_computes_rljax_grpo_gradient(tmp_path):
    """Same loss and gradient (token mean, on-policy clipped surrogate) from both, so the bench times one
    computation two ways: checked on the first layer's query kernel and the embedding."""
    import plain_update

    from rljax import models
    from rljax.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", init_std=0.02)
    cfg, params = plain_update.load_qwen2(path)
    config, ours = models.load_hf_checkpoint(path)
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 512, (4, 12)).astype(np.int32)
    adv = rng.standard_normal(4).astype(np.float32)
    first = 3  # 4 prompt tokens, 8 completion tokens

    def our_loss(p):
        hidden = models.hidden_states(config, p, ids[:, :-1])[:, first:]
        logits = hidden @ models.unembed_matrix(config, p).T
        logp = jax.numpy.take_along_axis(jax.nn.log_softmax(logits), ids[:, first + 1 :, None], -1)[..., 0]
        return -(logp * adv[:, None]).mean()  # the on-policy surrogate's gradient

    g_plain = jax.grad(lambda p: plain_update.grpo_loss(cfg, p, ids, first, adv))(params)
    g_ours = jax.grad(our_loss)(ours)
    np.testing.assert_allclose(g_plain["embed"], g_ours["embed"]["embedding"], rtol=2e-4, atol=1e-7)
    q = np.asarray(g_ours["layers"]["q_proj"]["kernel"][0]).reshape(g_plain["layers"][0]["wq"].shape)
    np.testing.assert_allclose(g_plain["layers"][0]["wq"], q, rtol=2e-4, atol=1e-7)
