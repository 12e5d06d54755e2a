"""The fault suite at the loop level: real `rljax.main` runs (real vLLM CPU server, reward workers, orbax
checkpoints) and real JAX multi-process jobs, each fault ending in recovery or a clear failure in time.

One run owns its server and goes through, in order: the server SIGKILLed mid-generation (step 1's
rollout) and mid-sync (step 2's push), a planted non-finite gradient (step 3, tests/support/fault_main.py),
a reward function that hangs, then SIGTERM preemption; the rerun resumes from the preempted checkpoint,
and a third run, after the latest checkpoint is garbled, falls back to the one before (both reruns against
the test run's shared tiny_arith server, `arith_server`). The server faults
are timed by RLJAX_TEST_FAULTS, which tests/support/fault_main.py wires in at the rollout engine's boundary
(tests/support/faults.py); the kills are real SIGKILLs of the server's processes.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
from jax_env import child_env

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTS = pathlib.Path(__file__).resolve().parents[1] / "support"
PREEMPTED_EXIT_CODE = 143
PEER_LOST_EXIT_CODE = 3
# Small and fast; every step checkpointed so the preempted and the garbled step have a predecessor.
ARGS = (
    "--config=configs/grpo.py:smoke",
    "--config.trainer.eval_every=0",
    "--config.data.eval_size=1",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.keep_last=10",
    "--config.rollout.vllm.gpu_memory_utilization=0.08",
    "--config.rollout.vllm.max_restarts=2",
    "--config.reward.functions=('math','fault_rewards:hang_once')",
    "--config.reward.weights=(1.0,1.0)",
    "--config.reward.timeout_s=2.0",
)


def env_for(workdir: pathlib.Path, faults: str, poison_update: int) -> dict:
    env = child_env(JAX_PLATFORMS="cpu", RLJAX_TEST_FAULTS=faults, PYTHONPATH=f"{REPO}:{TESTS}")
    env["RLJAX_TEST_POISON_UPDATE"] = str(poison_update)
    env["RLJAX_TEST_HANG_MARKER"] = str(workdir / "hang_once.marker")
    return env


def start_main(workdir: pathlib.Path, steps: int, faults: str = "", poison_update: int = 0, extra_args=()):
    """`python -m rljax.main`, through tests/support/fault_main.py (server kills, a non-finite gradient)."""
    cmd = [sys.executable, str(TESTS / "fault_main.py"), f"--workdir={workdir}", *ARGS, *extra_args]
    cmd.append(f"--config.trainer.steps={steps}")
    log = open(workdir.parent / f"{workdir.name}_{time.monotonic_ns()}.log", "w+")  # noqa: SIM115
    env = env_for(workdir, faults, poison_update)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.seek(0)
    text = proc.log.read()
    proc.log.close()
    return text


def metrics(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def saved_steps(workdir: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def extra(workdir: pathlib.Path, step: int) -> dict:
    return json.loads((workdir / "checkpoints" / str(step) / "extra" / "metadata").read_text())


def garble(step_dir: pathlib.Path) -> None:
    """Overwrites every array data file of a saved step with garbage of the same size."""
    hit = 0
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and ("ocdbt" in str(f) or "d/" in str(f.relative_to(step_dir / "state"))):
            f.write_bytes(os.urandom(max(f.stat().st_size, 16)))
            hit += 1
    assert hit, f"no array files under {step_dir}"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_loop_recovers_from_server_reward_and_gradient_faults_then_preempts_and_resumes(
    tmp_path, arith_server
):
    work = tmp_path / "run"
    work.mkdir()
    # evaluation is off (trainer.eval_every=0): generate call 1 is step 1's rollout, sync call 2 step 2's push
    faults = "kill_server_mid_generate:1,kill_server_mid_sync:2"
    proc = start_main(work, steps=8, faults=faults, poison_update=3)
    t0 = time.monotonic()
    while proc.poll() is None and not any(m["step"] >= 4 for m in metrics(work)):
        assert time.monotonic() - t0 < 600, "run A made no progress"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    out = finish(proc, timeout=120)
    # (f) preemption: saved at the next step boundary, exit status 143 for the requeue, promptly
    assert proc.returncode == PREEMPTED_EXIT_CODE, out[-4000:]
    assert time.monotonic() - signalled < 60, "preemption took too long"
    lines = metrics(work)
    preempted = max(saved_steps(work))
    assert f"rljax: preempted; saved step {preempted}" in out
    assert lines[-1]["step"] == preempted and 4 <= preempted < 8
    train = [m for m in lines if m["step"] > 0]
    assert [m["policy/version"] for m in train] == list(range(1, preempted + 1))
    # (a), (b): server killed mid-generation and mid-sync, each restarted, re-synced and resubmitted
    assert "killing the rollout server mid-generation" in out and "killing the rollout server mid-sync" in out
    assert "rollout generate failed" in out and "rollout weight sync failed" in out
    by_step = {m["step"]: m for m in train}
    assert sum(m["recovery/restarts"] for m in train) >= 2
    assert sum(m["recovery/failed_restarts"] for m in train) == 0
    assert sum(m["recovery/resubmitted"] for m in train) >= 4  # the 4 prompts of a step's rollout
    # the mid-generation kill is step 1's rollout (recovered before step 1's push, which reports it), the
    # mid-sync kill step 2's push
    assert by_step[1]["recovery/restarts"] >= 1 and by_step[2]["recovery/restarts"] >= 1
    for m in train:  # every step after a recovery still verified the sync and trained on fresh samples
        assert m["weight_sync/canary_logprob_max_abs_diff"] < 1e-3, m
        assert m["staleness/max"] == 0
    # (e) step 3's planted NaN gradient: update skipped (params and step counter unchanged), run goes on
    assert by_step[3]["optim/nonfinite"] == 1.0 and by_step[3]["optim/skipped_steps"] == 1.0
    assert all(m["optim/nonfinite"] == 0.0 for s, m in by_step.items() if s != 3)
    assert extra(work, 2)["policy_version"] == 2 and extra(work, 3)["policy_version"] == 2
    assert extra(work, 4)["policy_version"] == 3
    # (c) the hanging reward function: one call timed out (scored 0), every step completed
    timeouts = [m.get("reward_fn/fault_rewards:hang_once/timeouts", 0.0) for m in train]
    assert sum(m["reward_fn/timeouts"] for m in train) == 1 and sum(timeouts) == 1, timeouts
    assert sum(m["reward_fn/worker_restarts"] for m in train) >= 1

    # (f) the rerun resumes from the preempted checkpoint and finishes. The reruns take their rollouts from
    # the test run's tiny_arith server (the model of the smoke preset): what they check is the checkpoint
    # path, and each owned server would cost a vLLM start-up (~25-60 s on 2 cores); run A owns its server.
    proc = start_main(work, steps=preempted + 1, extra_args=arith_server.main_args())
    out = finish(proc, timeout=400)
    assert proc.returncode == 0, out[-4000:]
    assert f"rljax: finished {preempted + 1} steps" in out
    lines = metrics(work)
    assert [m["step"] for m in lines] == list(range(1, preempted + 2))
    assert extra(work, preempted + 1)["policy_version"] == preempted

    # (d) the latest checkpoint garbled: the next run reports it, falls back to the previous one, resumes
    # and trains on, saving the garbled step's number afresh (the bad copy is moved to checkpoints/corrupt/).
    garbled = preempted + 1
    garble(work / "checkpoints" / str(garbled))
    proc = start_main(work, steps=garbled + 1, extra_args=arith_server.main_args())
    out = finish(proc, timeout=400)
    assert proc.returncode == 0, out[-4000:]
    assert f"checkpoint step {garbled} in" in out and "falling back to an earlier step" in out
    assert f"resuming from checkpoint step {preempted} in" in out
    lines = metrics(work)
    assert [m["step"] for m in lines] == list(range(1, garbled + 2))
    assert [m["policy/version"] for m in lines[-2:]] == [garbled, garbled + 1]
    assert extra(work, garbled + 1)["policy_version"] == garbled  # two updates after step `preempted`
    assert extra(work, garbled)["policy_version"] == garbled - 1  # re-saved, restorable again
    assert [p.name.split("-")[0] for p in (work / "checkpoints" / "corrupt").iterdir()] == [str(garbled)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(log_dir: pathlib.Path, name: str) -> list[subprocess.Popen]:
    """Two processes of one JAX job on localhost, set up as `rljax.launch` does (RLJAX_* environment)."""
    port, procs = free_port(), []
    for i in range(2):
        env = child_env()
        env.update(
            RLJAX_COORDINATOR=f"127.0.0.1:{port}",
            RLJAX_NUM_PROCESSES="2",
            RLJAX_PROCESS_ID=str(i),
            RLJAX_PLATFORM="cpu",
            RLJAX_CPU_DEVICES="1",
            RLJAX_PEER_TIMEOUT_S="10",
            PYTHONPATH=str(REPO),
        )
        log = open(log_dir / f"{name}_{i}.log", "w+")  # noqa: SIM115 (closed by finish)
        cmd = [sys.executable, str(TESTS / "mp_fault_worker.py")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        procs[-1].log = log
    return procs


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_of_two_processes_killed_ends_the_other_promptly_with_a_message(tmp_path):
    jobs = {victim: start_job(tmp_path, f"kill{victim}") for victim in (1, 0)}
    t0 = time.monotonic()
    for procs in jobs.values():
        while "rljax-test: step 3" not in pathlib.Path(procs[0].log.name).read_text():
            assert procs[0].poll() is None and time.monotonic() - t0 < 180, "job did not start"
            time.sleep(0.2)
    killed = {}
    for victim, procs in jobs.items():
        procs[victim].kill()
        killed[victim] = time.monotonic()
    outs = {}
    for victim, procs in jobs.items():
        survivor = procs[1 - victim]
        outs[victim] = finish(survivor, timeout=120)
        finish(procs[victim], timeout=10)
        assert time.monotonic() - killed[victim] < 60, f"survivor of killing {victim} took too long"
        assert survivor.returncode not in (None, 0), outs[victim][-3000:]
    # the leader survives its peer: the watchdog names the dead process and exits for a restart
    assert jobs[1][0].returncode == PEER_LOST_EXIT_CODE, outs[1][-3000:]
    assert "rljax: process 0: process 1 of 2 sent no heartbeat" in outs[1]
    assert "restarted and resume" in outs[1]
    # the coordinator (process 0) dies: JAX's coordination service ends process 1 at once, saying why
    assert "another task died" in outs[0] or "lost the JAX coordinator" in outs[0], outs[0][-3000:]
