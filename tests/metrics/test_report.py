"""python -m rljax.report: a real PNG from metrics.jsonl laid out as a grid, panels without signal left out,
step time stacked by phase with compile steps marked apart."""

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


def write_run(workdir, steps, full=True, async_mode=False):
    """A sync run at beta 0 (KL and staleness flat zero) unless `async_mode` (staleness 0 then 1); step 1
    compiles the update, and so does step 5 (a new batch shape)."""
    with MetricsLogger(workdir, tensorboard=False, console=False) as logger:
        for s in range(1, steps + 1):
            update = 9.0 if s in (1, 5) else 0.5
            m = {
                "reward/mean": 0.1 * s,
                "reward/math/mean": 0.05 * s,
                "loss/total": 1.0,
                "timing/rollout_s": 1.0 + 0.01 * s,
                "timing/update_s": update,
                "timing/step_s": 1.0 + 0.01 * s + update + 0.25,
                "batch/rows": 9.0 if s < 5 else 10.0,
                "batch/row_length": 64.0,
            }
            if full:
                m |= {"kl/mean": 0.0, "entropy/mean": 2.0 - 0.01 * s, "response/length_mean": 100.0 + s,
                      "response/length_max": 200, "staleness/mean": float(async_mode and s > 1),
                      "staleness/max": float(async_mode and s > 1), "staleness/hist": [1, 1]}  # fmt: skip
            logger.write(s, m)


def test_grid_leaves_out_flat_panels_and_adds_step_time(tmp_path):
    write_run(tmp_path / "run", 12)
    out = tmp_path / "report.png"
    panels = report.render_report([tmp_path / "run"], out, dpi=50)
    # KL at beta 0 and staleness in sync mode are flat zero: no panel.
    assert panels == ["reward", "entropy", "response length", "step time"]
    assert png_size(out) == (3 * 5 * 50, 2 * 3 * 50)  # 3 columns, 2 rows of 5 x 3 in at 50 dpi
    assert out.stat().st_size > 10_000
    one_col = report.render_report([tmp_path / "run"], tmp_path / "col.png", dpi=50, cols=1)
    assert one_col == panels and png_size(tmp_path / "col.png") == (5 * 50, 4 * 3 * 50)


def test_several_runs_share_curve_panels_with_one_step_time_panel_each(tmp_path):
    write_run(tmp_path / "a" / "run", 12)
    write_run(tmp_path / "b" / "run", 5, async_mode=True)  # same dir name: labels get the parent
    out = tmp_path / "report.png"
    panels = report.render_report([tmp_path / "a" / "run", tmp_path / "b" / "run"], out, dpi=50)
    assert panels == [
        "reward",
        "entropy",
        "response length",
        "staleness",  # the async run's staleness moves
        "step time: a/run",
        "step time: b/run",
    ]
    assert png_size(out) == (750, 300)
    assert report.run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]


def test_signal_rule():
    flat = {"kl/mean": ([1, 2, 3], [0.0, 0.0, 0.0]), "eval/accuracy": ([0], [0.3])}
    assert not report.has_signal([flat], ("kl/mean",))
    assert report.has_signal([flat], ("eval/accuracy",))  # one point is a value, not a flat line
    assert not report.has_signal([flat], ("entropy/mean",))  # absent
    nan = {"kl/mean": ([1, 2], [float("nan"), float("nan")])}
    assert not report.has_signal([nan], ("kl/mean",))
    moving = {"kl/mean": ([1, 2], [0.0, 1e-4])}
    assert report.has_signal([flat, moving], ("kl/mean",))


def test_phase_times_and_compile_steps(tmp_path):
    write_run(tmp_path / "run", 6)
    series = report.load_series(tmp_path / "run")
    steps, phases = report.phase_times(series)
    assert steps == [1, 2, 3, 4, 5, 6] and list(phases) == ["rollout", "update", "other"]
    assert phases["other"] == pytest.approx([0.25] * 6)
    assert phases["update"][0] == 9.0
    assert report.compile_steps(series) == {1, 5}  # first step; step 5's batch is 10 rows, not 9
    counted = series | {"compile/count": ([1, 2, 3, 4, 5, 6], [1.0, 1.0, 2.0, 2.0, 2.0, 2.0])}
    assert report.compile_steps(counted) == {1, 3}  # compile/count, when logged, decides


def test_missing_metrics_are_skipped_and_nulls_tolerated(tmp_path):
    run = tmp_path / "r"
    with MetricsLogger(run, tensorboard=False, console=False) as logger:
        logger.write(0, {"kl/mean": 0.5})
        logger.write(1, {"kl/mean": float("nan"), "loss/total": 1.0})
        logger.write(2, {"kl/mean": 0.7})
    series = report.load_series(run)
    assert series["kl/mean"][0] == [0, 1, 2] and series["kl/mean"][1][0] == 0.5
    assert series["kl/mean"][1][1] != series["kl/mean"][1][1]  # NaN
    assert report.render_report([run], tmp_path / "one.png", dpi=40) == ["KL to reference"]
    assert png_size(tmp_path / "one.png") == (200, 120)
    only_loss = tmp_path / "loss_only"
    with MetricsLogger(only_loss, tensorboard=False, console=False) as logger:
        logger.write(0, {"loss/total": 1.0})
    with pytest.raises(ValueError, match="no plottable metrics"):
        report.render_report([only_loss], tmp_path / "none.png")


def test_report_cli(tmp_path):
    write_run(tmp_path / "run1", 3, full=False)  # reward and timings only
    write_run(tmp_path / "run2", 3, full=False)
    out = tmp_path / "cli.png"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "MPLBACKEND": "Agg"}
    runs = [str(tmp_path / "run1"), str(tmp_path / "run2")]
    cmd = [sys.executable, "-m", "rljax.report", *runs, "--out", str(out), "--dpi", "30", "--cols", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "2 runs; panels: reward, step time: run1, step time: run2" in done.stdout
    assert png_size(out) == (300, 180)
    bad_cmd = [*cmd[:3], str(tmp_path / "nowhere"), "--out", str(out)]
    bad = subprocess.run(bad_cmd, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
