"""`python -m rljax.eval`: pass@k arithmetic (golden values), the report, bad input, and a real run through
vLLM that reproduces the default job's own step-0 evaluation."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from jax_env import child_env

from rljax.eval import ks_for, pass_at_k, summarize

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (4, 1, 2, 0.5),  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2, 2) / C(4, 2) = 1 - 1/6
        (4, 0, 4, 0.0),
        (4, 1, 4, 1.0),  # n - c < k: some draw of k holds the correct one
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7, 5) / C(10, 5)
    ],
)
def test_pass_at_k_golden(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts_and_ks_cover_the_samples():
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(4, 1, 5)
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def test_summarize_golden():
    correct = np.array([[True, False], [False, False], [True, True]])
    lengths = np.array([[10, 20], [30, 40], [50, 60]])
    truncated = np.array([[False, True], [False, False], [False, False]])
    report = summarize(correct, lengths, truncated, {"math": correct.astype(np.float32)})
    assert report["num_prompts"] == 3 and report["samples"] == 2
    assert report["pass@1"] == pytest.approx(0.5)
    assert report["pass@k"] == {
        "1": pytest.approx(0.5),
        "2": pytest.approx(2 / 3),
    }  # per prompt (1 + 0 + 1) / 3
    assert report["length_mean"] == 35.0 and report["truncated_fraction"] == pytest.approx(1 / 6)
    assert report["reward"] == {"math": pytest.approx(0.5)}


def _eval(*args, timeout=600):
    cmd = [sys.executable, "-m", "rljax.eval", *args]
    env = child_env(JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model=assets/tiny_arith"], "--config is required with --model"),
        (["--config=configs/grpo.py", "--model=assets/tiny_arith", "--samples=0"], "--samples must be >= 1"),
        (["--workdir=/nonexistent/run"], "--workdir: no such directory"),
        (["--config=configs/grpo.py", "--model=/nonexistent/model"], "model.path"),
        (
            ["--config=configs/grpo.py", "--model=assets/tiny_arith", "--data=/nope.jsonl"],
            "--data: no such file",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = _eval(*args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


@pytest.mark.vllm
@pytest.mark.slow
def test_eval_of_the_base_model_reproduces_the_default_jobs_step_0_accuracy(tmp_path):
    # The default job's own evaluation before step 1 (README, configs/grpo.py) measured 0.3125 on these 64
    # held-out prompts: the same weights, prompts, temperature and per-request seeds give the same samples.
    report_file = tmp_path / "report.json"
    proc = _eval("--config=configs/grpo.py", "--model=assets/tiny_arith", f"--json={report_file}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(report_file.read_text())
    assert report["num_prompts"] == 64 and report["samples"] == 1
    assert report["pass@1"] == 0.3125 and report["pass@k"] == {"1": 0.3125}
    assert report["reward"]["math"] == pytest.approx(0.3125)  # reward.functions is the same verifier
    assert 1 <= report["length_mean"] <= 16 and "rljax.eval: 64 prompts x 1: pass@1 0.3125" in proc.stdout
