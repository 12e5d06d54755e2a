"""Exact resume, end to end: `python -m rljax.main` runs killed with SIGKILL and resumed end bit for bit
where an uninterrupted run ends (params and optimizer state), with one metrics line per step. Real vLLM (CPU
build, the session's tiny_arith server, connected through rollout.vllm.urls), real orbax. Rollouts are
reproducible across processes because every request carries its own seed (derived from trainer.seed, the
step and the prompt index) and each run pushes its own weights into the server first. Sync mode: one run
killed after step 3 while the save of step 4 is in flight (held open by tests/support/slow_save.py, the
run's entry script) with metrics written past the last complete checkpoint (3), resumed from 3, killed again
right after checkpoint 5 is complete, resumed again. Async mode (max_staleness=1): killed after step 4 with
checkpoints every 3 steps; the buffered, already generated batch comes back from the checkpoint. The runs
share the test run's JAX compilation cache (it only saves compile time: same program, same bits). Async
caveat: which policy version generates each batch depends on the producer thread reaching the rollout gate
before the trainer's next weight sync (always so here: generation starts well inside the update); the test
checks the tags it relies on.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import typing

import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax_env import child_env

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = str(REPO / "assets" / "tiny_arith")
STEPS = 6
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class Server(typing.NamedTuple):
    url: str
    token_file: str  # the server's bearer token (rollout.vllm.token_file)


@pytest.fixture(scope="module")
def server(arith_server):
    """The session's tiny_arith server (tests/support/vllm_server.py)."""
    return Server(arith_server.url, arith_server.token_file)


SUPPORT = pathlib.Path(__file__).resolve().parents[1] / "support"


def command(workdir, server, *overrides, slow_save: tuple[float, int] | None = None):
    """`python -m rljax.main ...`, or through tests/support/slow_save.py holding the save of one step."""
    entry = (
        ["-m", "rljax.main"] if slow_save is None else [str(SUPPORT / "slow_save.py"), *map(str, slow_save)]
    )
    return [
        sys.executable,
        *entry,
        "--config=configs/grpo.py",
        f"--workdir={workdir}",
        f"--config.model.path={MODEL}",
        f"--config.rollout.vllm.urls=('{server.url}',)",
        f"--config.rollout.vllm.token_file={server.token_file}",
        f"--config.trainer.steps={STEPS}",
        "--config.trainer.eval_every=0",  # evaluation off: no step-0 line, metrics start at step 1
        "--config.rollout.batch_size=16",
        "--config.rollout.group_size=4",
        "--config.checkpoint.keep_last=10",
        "--config.metrics.tensorboard=false",
        "--config.metrics.console=false",
        *overrides,
    ]


def env(server):
    # one CPU device in every run alike; the test run's compilation cache (conftest: same program, same bits)
    return child_env(JAX_PLATFORMS="cpu")


def run_to_end(workdir, server, *overrides) -> str:
    proc = subprocess.run(
        command(workdir, server, *overrides),
        cwd=REPO,
        env=env(server),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"rljax: finished {STEPS} steps" in proc.stdout
    return proc.stdout


def metrics_lines(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return lines


def metrics_steps(workdir) -> list[int]:
    return [m["step"] for m in metrics_lines(workdir)]


def kill_when(workdir, server, ready, *overrides, slow_save=None) -> tuple[list[int], str]:
    """Starts a run, SIGKILLs it once `ready(workdir)` holds; returns (metrics steps written, its stdout)."""
    log = pathlib.Path(f"{workdir}.{time.monotonic_ns()}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command(workdir, server, *overrides, slow_save=slow_save),
            cwd=REPO,
            env=env(server),
            stdout=out,
            stderr=out,
        )
        deadline = time.monotonic() + 600
        try:
            while not ready(pathlib.Path(workdir)):
                assert proc.poll() is None, f"run ended before the kill point: {log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "kill point never reached"
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(60)
    assert proc.returncode == -signal.SIGKILL
    return metrics_steps(workdir), log.read_text()


def finished_steps(workdir: pathlib.Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def in_flight(workdir: pathlib.Path, step: int) -> bool:
    d = workdir / "checkpoints"
    return d.is_dir() and any(p.name.startswith(f"{step}.orbax-checkpoint-tmp") for p in d.iterdir())


def state_of(workdir, step: int):
    return ocp.StandardCheckpointer().restore(pathlib.Path(workdir, "checkpoints", str(step), "state"))


def assert_bitwise_equal(got, want):
    import jax

    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def
    assert {jax.tree_util.keystr(p).split("]")[0] for p, _ in want_leaves} >= {"['params'", "['opt_state'"}
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        same = np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
        assert same, f"{jax.tree_util.keystr(path)}: max |diff| {np.abs(a - b).max()}"


EVERY_STEP = "--config.checkpoint.every_steps=1"


@pytest.fixture(scope="module")
def straight_sync(server, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight_sync")
    run_to_end(workdir, server, EVERY_STEP)
    assert metrics_steps(workdir) == list(range(1, STEPS + 1))
    return workdir


def test_sync_killed_twice_resumes_bitwise(server, straight_sync, tmp_path):
    workdir = tmp_path / "run"
    # 1) SIGKILL while the save of step 4 is in flight (data written, not yet renamed into place).
    written, _ = kill_when(
        workdir,
        server,
        lambda w: in_flight(w, 4) and 4 in metrics_steps(w),
        EVERY_STEP,
        slow_save=(600.0, 4),
    )
    assert finished_steps(workdir) == [1, 2, 3], "the half-written step 4 must not be listed"
    assert written[:4] == [1, 2, 3, 4]  # metrics past the newest complete checkpoint exist
    # 2) Resume from 3, the newest complete step; SIGKILL once step 5 is saved.
    written, out = kill_when(workdir, server, lambda w: 5 in finished_steps(w), EVERY_STEP)
    assert "rljax: resuming from checkpoint step 3 in" in out
    assert not in_flight(workdir, 4), "the partial step 4 is cleaned up on resume"
    assert written[:5] == [1, 2, 3, 4, 5]
    # 3) Resume from 5 to the end.
    out = run_to_end(workdir, server, EVERY_STEP)
    assert "rljax: resuming from checkpoint step 5 in" in out
    assert metrics_steps(workdir) == list(range(1, STEPS + 1)), "one metrics line per step"
    for step in range(1, STEPS + 1):  # 4 was redone after the kill; 6 is the end of the run
        assert_bitwise_equal(state_of(workdir, step), state_of(straight_sync, step))


def test_async_killed_resumes_bitwise_with_its_buffer(server, tmp_path):
    """max_staleness=1: checkpoint 3 holds the batch of the 4th update, generated by policy 2, untrained."""
    async_mode = "--config.trainer.max_staleness=1"
    straight = tmp_path / "straight"
    run_to_end(straight, server, EVERY_STEP, async_mode)
    workdir = tmp_path / "run"
    written, _ = kill_when(
        workdir,
        server,
        # checkpoint 3 saves asynchronously: step 4 can finish before it is committed
        lambda w: 4 in metrics_steps(w) and 3 in finished_steps(w),
        "--config.checkpoint.every_steps=3",
        async_mode,
    )
    assert 3 in finished_steps(workdir) and 4 in written
    buffered = json.loads((workdir / "checkpoints" / "3" / "extra" / "metadata").read_text())["buffer"]
    # The checkpoint carries the batch for (0-based) step 3, generated by policy 2 and not yet trained on.
    assert buffered["buffer"][0]["step"] == 3, buffered["next_step"]
    versions = {t["policy_version"] for g in buffered["buffer"][0]["groups"] for t in g["trajectories"]}
    assert versions == {2}
    out = run_to_end(workdir, server, "--config.checkpoint.every_steps=3", async_mode)
    assert "rljax: resuming from checkpoint step 3 in" in out
    assert metrics_steps(workdir) == list(range(1, STEPS + 1)), "one metrics line per step"
    hist = lambda w: [m.get("staleness/hist") for m in metrics_lines(w)]
    assert hist(workdir) == hist(straight), "each step trained on samples of the same policy versions"
    assert_bitwise_equal(state_of(workdir, 3), state_of(straight, 3))
    assert_bitwise_equal(state_of(workdir, STEPS), state_of(straight, STEPS))
