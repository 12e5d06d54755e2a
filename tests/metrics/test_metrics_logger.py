"""MetricsLogger: JSONL one line per step (also across resumes), TensorBoard read back, console, W&B."""

import io
import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from rljax.metrics import (
    SCHEMA,
    MetricsLogger,
    StepRecord,
    example_names,
    format_progress,
    lookup,
    to_counts,
    to_scalar,
)
from rljax.metrics.console import EtaEstimator, format_duration


def full_step(step: int) -> dict:
    """One value for every schema name (patterns filled in), histograms as staleness counts."""
    out = {}
    for i, name in enumerate(example_names()):
        out[name] = [step, 2, 1] if lookup(name).kind == "histogram" else 0.25 * i + step
    return out


def jsonl_lines(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def read_tb(workdir):
    acc = event_accumulator.EventAccumulator(
        str(workdir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0}
    )
    acc.Reload()
    return acc


def test_tensorboard_files_hold_every_schema_name(tmp_path):
    with MetricsLogger(tmp_path, console=False, total_steps=3) as logger:
        for step in range(3):
            logger.write(step, full_step(step))
    acc = read_tb(tmp_path)
    tags = acc.Tags()
    hist_names = {n for n in example_names() if lookup(n).kind == "histogram"}
    assert set(tags["scalars"]) == set(example_names()) - hist_names
    assert set(tags["histograms"]) == hist_names == {"staleness/hist"}
    i = example_names().index("reward/mean")
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(s, 0.25 * i + s) for s in range(3)]
    h = acc.Histograms("staleness/hist")[2].histogram_value  # counts [2, 2, 1] at values 0, 1, 2
    assert (h.num, h.sum, h.sum_squares, h.min, h.max) == (5.0, 4.0, 6.0, 0.0, 2.0)
    assert list(h.bucket)[:3] == [2.0, 2.0, 1.0]


def test_jsonl_has_one_line_per_step_and_converts_numpy_and_jax(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        for step in range(4):
            logger.write(step, {"reward/mean": jnp.float32(0.5 * step), "compile/count": np.int32(2),
                                "optim/skipped_steps": jnp.array(step % 2), "loss/total": float("nan"),
                                "staleness/hist": {0: np.int64(3), 2: 1}})  # fmt: skip
    lines = jsonl_lines(tmp_path)
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert [r["reward/mean"] for r in lines] == [0.0, 0.5, 1.0, 1.5]
    assert lines[3]["compile/count"] == 2 and isinstance(lines[3]["compile/count"], int)
    assert [r["optim/skipped_steps"] for r in lines] == [0, 1, 0, 1]
    assert lines[0]["loss/total"] is None  # strict JSON: NaN written as null
    assert lines[0]["staleness/hist"] == [3, 0, 1]
    assert all(isinstance(r["time"], float) for r in lines)


def test_resume_truncates_so_each_step_appears_once(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:  # first run: steps 0..7, then "crashes"
        for step in range(8):
            logger.write(step, {"reward/mean": float(step), "staleness/hist": [1]})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "reward/me')  # a line cut short by the crash
    # The checkpoint was at step 5: the resumed run rewrites steps 5.. with new values.
    with MetricsLogger(tmp_path, console=False, resume_step=5) as logger:
        for step in range(5, 10):
            logger.write(step, {"reward/mean": 100.0 + step, "staleness/hist": [0, 2]})
    lines = jsonl_lines(tmp_path)
    assert [r["step"] for r in lines] == list(range(10))
    assert [r["reward/mean"] for r in lines] == [0, 1, 2, 3, 4, 105, 106, 107, 108, 109]
    # A second resume at a step before the last one, and a plain reopen that appends.
    with MetricsLogger(tmp_path, tensorboard=False, console=False, resume_step=9) as logger:
        logger.write(9, {"reward/mean": -1.0})
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        with pytest.raises(ValueError, match="write each step once"):
            logger.write(9, {"reward/mean": 0.0})
        logger.write(10, {"reward/mean": 10.0})
    lines = jsonl_lines(tmp_path)
    assert [r["step"] for r in lines] == list(range(11)) and lines[9]["reward/mean"] == -1.0
    # TensorBoard purged the first run's events from step 5 on: one event per step, the new values.
    events = read_tb(tmp_path).Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [(s, s if s < 5 else 100.0 + s) for s in range(10)]


def test_non_zero_process_writes_nothing(tmp_path):
    with MetricsLogger(tmp_path / "run", process_index=1) as logger:
        logger.write(0, {"reward/mean": 1.0})
        assert not logger.active
    assert not (tmp_path / "run").exists()


def test_unknown_name_warns_once_and_is_still_written(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        with pytest.warns(UserWarning, match="my/custom") as record:
            logger.write(0, {"my/custom": 1.0, "reward/mean": 0.0})
            logger.write(1, {"my/custom": 2.0})
        assert len([w for w in record if "my/custom" in str(w.message)]) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            logger.write(2, {"my/custom": 3.0, "timing/rollout_s": 1.5})  # known names never warn
    assert [r["my/custom"] for r in jsonl_lines(tmp_path)] == [1.0, 2.0, 3.0]


def test_bad_values_and_steps_raise(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        with pytest.raises(ValueError, match="reward/mean"):
            logger.write(0, {"reward/mean": np.ones(3)})
        with pytest.raises(ValueError, match="non-negative"):
            logger.write(0, {"staleness/hist": [1, -2]})
        with pytest.raises(ValueError, match="step"):
            logger.write(-1, {"reward/mean": 0.0})
        with pytest.raises(ValueError, match="reserved"):
            logger.write(0, {"time": 0.0})
    assert to_scalar(jnp.ones((1, 1))) == 1.0 and to_scalar(True) == 1
    assert to_counts(np.array([1, 0, 2])) == [1, 0, 2] and to_counts({"1": 2}) == [0, 2]
    with pytest.raises(ValueError, match="keys"):
        to_counts({-1: 2})


def test_console_line_and_eta_with_a_fake_clock(tmp_path):
    clock = iter([100.0, 110.0, 130.0])  # step 0 at t=100, step 1 at t=110, step 2 at t=130
    stream = io.StringIO()
    with MetricsLogger(tmp_path, tensorboard=False, total_steps=10, console_stream=stream,
                       time_fn=lambda: next(clock)) as logger:  # fmt: skip
        for step in range(3):
            logger.write(
                step, {"reward/mean": 0.5, "kl/mean": 0.00123, "timing/step_s": 12.0, "loss/kl": 9.0}
            )
        assert logger.eta_s == pytest.approx(15.0 * 8)  # 15 s/step since step 0, steps 3..10 left
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # not a terminal: one line per step
    assert lines[0].startswith("[--------------------] 0/10   0% ETA ?")
    assert lines[2] == "[####----------------] 2/10  20% ETA 2m00s | reward 0.5 kl 0.00123 step_s 12"
    assert format_duration(7322) == "2h02m" and format_duration(None) == "?"
    no_total = format_progress(StepRecord(4, {"reward/mean": 1}, {}, 0.0), None)
    assert no_total == "step 4 | reward 1"
    eta = EtaEstimator(None, time_fn=lambda: 0.0)
    assert eta.update(0) is None and eta.update(1) is None


def test_console_redraws_in_place_on_a_terminal(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    with MetricsLogger(tmp_path, tensorboard=False, total_steps=2, console_stream=stream) as logger:
        logger.write(0, {"reward/mean": 1.0})
        logger.write(1, {"reward/mean": 2.0})
    out = stream.getvalue()
    assert out.count("\r") == 2 and out.count("\n") == 1 and out.endswith("\n")
    assert "\x1b[K" in out


def test_wandb_missing_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"pip install .rljax\[wandb\]."):
        MetricsLogger(tmp_path, console=False, tensorboard=False, wandb={"project": "p", "mode": "offline"})
    with pytest.raises(ValueError, match="valid keys"):
        MetricsLogger(tmp_path / "b", console=False, tensorboard=False, wandb={"project": "p", "bogus": 1})


def test_schema_has_no_name_the_writers_reserve():
    assert "step" not in SCHEMA and "time" not in SCHEMA
