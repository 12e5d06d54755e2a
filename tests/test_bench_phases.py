"""Smoke test of benchmarks/bench_phases.py at tiny sizes: the phase table's structure, not its timings."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from jax_env import child_env

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_phases_reports_every_phase_against_its_floor(tmp_path):
    out = tmp_path / "phases.json"
    env = child_env()  # one CPU device is enough here
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "benchmarks/bench_phases.py", "--tiny", "--steps", "3", "--skip", "1"]
    cmd += ["--batch", "8", "--max-tokens", "8", "--repeats", "1", "--skip-async", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    for phase in ("update", "update_isolated", "generation", "sync_step"):
        row = s[phase]
        assert row["seconds"] > 0 and row["floor_seconds"] > 0
        assert row["ratio"] == pytest.approx(row["seconds"] / row["floor_seconds"])
        assert phase in proc.stdout
    for phase, target in (("update", 1.15), ("generation", 1.2), ("sync_step", 1.15)):
        assert s[phase]["target"] == target and s[phase]["met"] == (s[phase]["ratio"] <= target)
    assert "async_step" not in s  # --skip-async
    # the sync step's floor is generation's floor plus the bare update's
    floor = s["generation"]["floor_seconds"] + s["update"]["floor_seconds"]
    assert s["sync_step"]["floor_seconds"] == pytest.approx(floor)
    assert 0.0 <= s["batch/pad_fraction"] < 1.0 and s["generated_tokens_per_step"] > 0
    assert s["model_params"] > 0 and s["host"]["cpus"] >= 1
    assert set(s["sync_loop_parts_s"]) >= {"rollout", "update", "weight_sync"}
    # CPU seconds per phase: the trainer's and the server's processes (generation runs in the server)
    cpu = s["cpu_seconds"]
    assert cpu["cores"] == s["host"]["cpus"]
    assert all(cpu["sync_loop"][p] > 0 for p in ("rollout", "update", "weight_sync", "step"))
    assert cpu["sync_loop"]["step"] >= cpu["sync_loop"]["update"]
    assert cpu["floors"]["generation"] > 0 and cpu["floors"]["bare_update"] > 0
    assert "CPU s per step" in proc.stdout


def test_micro_sweep_times_each_micro_batch_size_against_the_bare_step(tmp_path):
    out = tmp_path / "sweep.json"
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "benchmarks/bench_phases.py", "--tiny", "--micro-sweep", "1,0", "--batch", "8"]
    cmd += ["--max-tokens", "8", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = json.loads(out.read_text())["micro_sweep"]
    assert set(sweep) == {"bare", "rows_1", "rows_0"}
    assert sweep["bare"]["ratio"] == pytest.approx(1.0)
    for row in sweep.values():
        assert row["seconds"] > 0 and row["ratio"] == pytest.approx(row["seconds"] / sweep["bare"]["seconds"])
