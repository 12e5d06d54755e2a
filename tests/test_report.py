"""python -m rljax.report: a real PNG from metrics.jsonl, runs side by side, missing metrics skipped."""

import os
import struct
import subprocess
import sys

import pytest

from rljax import report
from rljax.metrics import MetricsLogger


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def write_run(workdir, steps, full=True):
    with MetricsLogger(workdir, tensorboard=False, console=False) as logger:
        for s in range(steps):
            m = {
                "reward/mean": 0.1 * s,
                "reward/math/mean": 0.05 * s,
                "timing/step_s": 2.0,
                "loss/total": 1.0,
            }
            if full:
                m |= {"kl/mean": 0.001 * s, "entropy/mean": 2.0 - 0.01 * s, "response/length_mean": 100.0 + s,
                      "response/length_max": 200, "timing/rollout_s": 1.2, "staleness/mean": 0.5,
                      "staleness/max": 1, "staleness/hist": [1, 1]}  # fmt: skip
            logger.write(s, m)


def test_report_renders_two_runs_side_by_side(tmp_path):
    write_run(tmp_path / "a" / "run", 12)
    write_run(tmp_path / "b" / "run", 5, full=False)  # same dir name: labels get the parent
    out = tmp_path / "report.png"
    panels = report.render_report([tmp_path / "a" / "run", tmp_path / "b" / "run"], out, dpi=50)
    assert panels == ["reward", "KL to reference", "entropy", "response length", "timings", "staleness"]
    width, height = png_size(out)
    # 2 columns of 5.0 in and 6 rows of 2.6 in at 50 dpi (tight_layout keeps the figure size).
    assert (width, height) == (500, 780)
    assert out.stat().st_size > 10_000
    assert report.run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]


def test_missing_metrics_are_skipped_and_nulls_tolerated(tmp_path):
    run = tmp_path / "r"
    with MetricsLogger(run, tensorboard=False, console=False) as logger:
        logger.write(0, {"kl/mean": 0.5})
        logger.write(1, {"kl/mean": float("nan"), "loss/total": 1.0})
    series = report.load_series(run)
    assert series["kl/mean"][0] == [0, 1] and series["kl/mean"][1][0] == 0.5
    assert series["kl/mean"][1][1] != series["kl/mean"][1][1]  # NaN
    assert report.render_report([run], tmp_path / "one.png", dpi=40) == ["KL to reference"]
    assert png_size(tmp_path / "one.png") == (200, 104)
    only_loss = tmp_path / "loss_only"
    with MetricsLogger(only_loss, tensorboard=False, console=False) as logger:
        logger.write(0, {"loss/total": 1.0})
    with pytest.raises(ValueError, match="no plottable metrics"):
        report.render_report([only_loss], tmp_path / "none.png")


def test_report_cli(tmp_path):
    write_run(tmp_path / "run1", 3, full=False)  # reward and timings only: 2 panels
    write_run(tmp_path / "run2", 3, full=False)
    out = tmp_path / "cli.png"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "MPLBACKEND": "Agg"}
    runs = [str(tmp_path / "run1"), str(tmp_path / "run2")]
    cmd = [sys.executable, "-m", "rljax.report", *runs, "--out", str(out), "--dpi", "30"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "2 runs; panels: reward, timings" in done.stdout and png_size(out) == (300, 156)
    bad_cmd = [*cmd[:3], str(tmp_path / "nowhere"), "--out", str(out)]
    bad = subprocess.run(bad_cmd, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
