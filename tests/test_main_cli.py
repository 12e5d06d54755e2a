"""`python -m rljax.main` rejects bad input early: non-zero exit, one clear line, no traceback."""

import os
import subprocess
import sys

import pytest
from jax_env import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(*args, timeout=120):
    env = child_env(JAX_PLATFORMS="cpu")  # one CPU device, as a user's laptop has
    return subprocess.run(
        [sys.executable, "-m", "rljax.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_user_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rljax: error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("--config.trainer.stpes=3", ["trainer.stpes", "unknown config key", "did you mean trainer.steps"]),
        ("--config.algo.bta=0.1", ["algo.bta", "did you mean algo.beta"]),
        ("--config.trainer.steps=ten", ["trainer.steps", "expected int"]),
        ("--config.optim.learning_rate=0", ["optim.learning_rate", "must be > 0"]),
        ("--config.optim.learning_rate=-1e-4", ["optim.learning_rate", "must be > 0"]),
        ("--config.rollout.batch_size=30", ["rollout.batch_size", "not divisible by rollout.group_size=8"]),
        ("--config.algo.is_level=tokens", ["algo.is_level", "not one of"]),
        ("--config.algo.advantage=gpro", ["algo.advantage", "valid:", "grpo"]),
    ],
)
def test_bad_config_values(tmp_path, override, fragments):
    proc = run_main("--config=configs/grpo.py", f"--workdir={tmp_path}", override)
    assert_user_error(proc, *fragments)


def test_mesh_not_matching_devices(tmp_path):
    proc = run_main("--config=configs/grpo.py", f"--workdir={tmp_path}", "--config.mesh.fsdp=2")
    assert_user_error(proc, "mesh", "but there are 1 devices")


def test_missing_model_path(tmp_path):
    proc = run_main(
        "--config=configs/grpo.py", f"--workdir={tmp_path}", f"--config.model.path={tmp_path}/none"
    )
    assert_user_error(proc, "model.path", "no such directory")


def test_preflight_runs_before_training(tmp_path):
    """A setup only preflight can judge (an unreachable rollout server) fails before any allocation."""
    proc = run_main(
        "--config=configs/grpo.py",
        f"--workdir={tmp_path}",
        "--config.rollout.vllm.urls=('http://127.0.0.1:9',)",
    )
    assert_user_error(proc, "preflight", "rollout.vllm.urls", "127.0.0.1:9")
    assert not (tmp_path / "checkpoints").exists()


def test_startup_fails_on_the_compiled_memory_budget(tmp_path):
    """Start-up compiles the train step and log-prob passes for the configured shapes (before vLLM or
    the parameters): a budget below their per-device bytes stops the run with those numbers."""
    proc = run_main(
        "--config=configs/grpo.py", f"--workdir={tmp_path}", "--config.mesh.device_memory_gib=0.01"
    )
    assert_user_error(
        proc,
        "preflight",
        "memory:",
        "compiled for 64 rows x 512 tokens",
        "train_step",
        "temp",
        "a device has 0.01 GiB (mesh.device_memory_gib)",
    )
    assert "rljax: preflight: memory per device, GiB" in proc.stdout
    assert not (tmp_path / "checkpoints").exists()


def test_missing_config_file(tmp_path):
    proc = run_main("--config=configs/nope.py", f"--workdir={tmp_path}")
    assert_user_error(proc, "no such config file")


def test_unknown_preset(tmp_path):
    proc = run_main("--config=configs/grpo.py:huge", f"--workdir={tmp_path}")
    assert_user_error(proc, "unknown preset 'huge'")


def test_missing_workdir():
    proc = run_main("--config=configs/grpo.py")
    assert_user_error(proc, "--workdir is required")


def test_run_honours_its_argv_not_sys_argv(tmp_path, monkeypatch):
    """`rljax.main.run(argv)` applies argv's `--config.*` overrides (sys.argv is someone else's), and a
    second call in the same process starts from the defaults again (no flag leaks from the first)."""
    from rljax import main

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["pytest", "--config.algo.beta=0.5"])
    started = []
    monkeypatch.setattr(main, "start", lambda cfg, workdir: started.append((cfg, workdir)))

    def run(*argv):  # absl's app.run ends with sys.exit: code None/0 after `start` returned
        with pytest.raises(SystemExit) as e:
            main.run(["rljax", *argv])
        return e.value.code

    base = ["--config=configs/grpo.py:smoke", f"--workdir={tmp_path}"]
    assert run(*base, "--config.algo.beta=0.25", "--config.trainer.steps", "7") in (None, 0)
    ((cfg, workdir),) = started
    assert (cfg.algo.beta, cfg.trainer.steps, workdir) == (0.25, 7, str(tmp_path))
    assert run("--config=configs/grpo.py:smoke") == 2  # no --workdir: the first call's is not reused
    assert len(started) == 1
    assert run(*base) in (None, 0)
    assert started[1][0].algo.beta == 0.0 and started[1][0].trainer.steps == 3  # the smoke preset's own
