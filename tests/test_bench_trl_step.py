"""benchmarks/bench_trl_step.py without TRL (a benchmark dependency only): the rljax run it launches is a
valid config with the compared settings, and its report takes the medians after the skipped steps."""

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_trl_step as bench  # noqa: E402


def test_the_rljax_run_is_the_preset_with_the_compared_settings(tmp_path):
    from rljax.runtime import config_from_args

    ns = bench.parse_args(["--prompts", "3", "--group", "4", "--max-tokens", "24", "--steps", "5"])
    cmd = bench.rljax_command(ns, tmp_path / "w")
    assert cmd[1:3] == ["-m", "rljax.main"] and f"--workdir={tmp_path / 'w'}" in cmd
    cfg = config_from_args(cmd[3:])
    assert cfg.model.path == "smollm2-135m-instruct" and cfg.data.chat_template
    assert (cfg.rollout.batch_size, cfg.rollout.group_size, cfg.rollout.max_tokens) == (12, 4, 24)
    assert cfg.optim.learning_rate == pytest.approx(2e-5) and cfg.trainer.steps == 5
    assert cfg.reward.functions == ("math",) and cfg.algo.beta == 0.0
    assert cfg.trainer.eval_every == 0 and cfg.trainer.epochs == cfg.trainer.minibatches == 1


def test_the_report_takes_medians_after_the_skipped_steps(capsys):
    rows = [{"step": s, "generation": 1.0, "update": s - 1.0, "sync": 0.0} for s in (90.0, 10.0, 12.0, 11.0)]
    med = bench.medians(rows, skip=1)
    assert med["step"] == 11.0 and med["update"] == 10.0
    out = bench.report({"rljax": med, "trl": dict(med, step=22.0)})
    assert out["step_ratio_rljax_over_trl"] == pytest.approx(0.5)
    assert "rljax / TRL: 0.50x" in capsys.readouterr().out
