"""`python -m rljax.replay`: one saved update re-run from its checkpoint and batch, checked bit for bit.

A real short run (real vLLM CPU build, checkpoint every step, `checkpoint.save_batches`) provides the
checkpoints and batches; replay must match, and must name the leaf when a checkpoint or batch is tampered.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from jax_env import child_env

from rljax import replay
from rljax.checkpoint import Checkpointer, batch_path, load_batch

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def env(workdir):
    """One CPU device (the layout the run used); the run and the replays share compiled programs through
    the test run's compilation cache (conftest; the same programs give the same bits)."""
    return child_env(JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def run_dir(arith_server, tmp_path_factory):
    """A 2-step GRPO run with a checkpoint and a saved batch at every step (on the session's vLLM server)."""
    root = tmp_path_factory.mktemp("replay")
    cmd = [
        sys.executable,
        "-m",
        "rljax.main",
        "--config=configs/grpo.py",
        f"--workdir={root / 'run'}",
        *arith_server.main_args(),
        "--config.trainer.steps=2",
        "--config.trainer.eval_every=0",
        "--config.rollout.batch_size=16",
        "--config.rollout.group_size=4",
        "--config.checkpoint.every_steps=1",
        "--config.checkpoint.save_batches=true",
        "--config.metrics.tensorboard=false",
        "--config.metrics.console=false",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env(root / "run"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "run"


def run_replay(workdir, step, cache_of):
    cmd = [sys.executable, "-m", "rljax.replay", f"--workdir={workdir}", f"--step={step}"]
    return subprocess.run(cmd, cwd=REPO, env=env(cache_of), capture_output=True, text=True, timeout=600)


def test_run_saved_a_batch_per_step(run_dir):
    assert sorted(p.name for p in (run_dir / "batches").iterdir()) == [f"step_{s:08d}.npz" for s in range(2)]
    batch = load_batch(batch_path(str(run_dir), 1))
    assert batch.input_ids.shape[0] == 16 and float(np.sum(batch.loss_mask)) > 0
    assert np.any(batch.advantages != 0), "a batch with all-zero advantages would not move the params"


def test_replay_matches_the_next_checkpoint(run_dir):
    proc = run_replay(run_dir, 1, run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "rljax.replay: MATCH: step 1 -> 2" in proc.stdout


def tampered_copy(run_dir, tmp_path) -> pathlib.Path:
    work = tmp_path / "run"
    shutil.copytree(run_dir, work)
    return work


def test_tampered_checkpoint_names_the_leaf(run_dir, tmp_path):
    """Checkpoint 2 re-saved with one element of the embedding moved by one ulp -> exit 1, leaf named."""
    import jax
    import orbax.checkpoint as ocp

    work = tampered_copy(run_dir, tmp_path)
    ck = Checkpointer(str(work / "checkpoints"), async_save=False)
    state = ocp.StandardCheckpointer().restore(work / "checkpoints" / "2" / "state")
    extra, config = ck.restore_extra(2), ck.restore_config(2)
    emb = np.array(state["params"]["embed"]["embedding"])
    emb.flat[7] = np.nextafter(emb.flat[7], np.float32(np.inf))
    state["params"]["embed"]["embedding"] = jax.numpy.asarray(emb)
    shutil.rmtree(work / "checkpoints" / "2")
    ck.close()
    ck = Checkpointer(str(work / "checkpoints"), async_save=False)
    ck.save(2, state, extra, config)
    ck.close()
    proc = run_replay(work, 1, run_dir)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert "MISMATCH" in proc.stdout and ".params['embed']['embedding']:" in proc.stdout, proc.stdout
    assert "1 of " in proc.stdout  # exactly the one tampered element


def test_compare_trees_is_bitwise_and_names_the_first_leaf():
    import jax.numpy as jnp

    a = {"opt": {"mu": np.zeros(4, np.float32)}, "params": {"w": np.asarray([1.0, np.nan], np.float32)}}
    assert replay.compare_trees(a, a).match  # NaN equals itself bit for bit
    b = {"opt": {"mu": np.zeros(4, np.float32)}, "params": {"w": np.asarray([1.0, -np.nan], np.float32)}}
    v = replay.compare_trees(b, a)
    assert not v.match and v.first_mismatch == "['params']['w']" and v.detail.startswith("1 of 2 elements")
    c = {"opt": {"mu": -np.zeros(4, np.float32)}, "params": {"w": jnp.asarray([2.0, np.nan])}}
    assert replay.compare_trees(c, a).first_mismatch == "['opt']['mu']"  # -0.0 is not +0.0 bitwise
    d = {"opt": {"mu": np.zeros(4, np.float64)}, "params": a["params"]}
    assert "float64" in replay.compare_trees(d, a).detail
    assert replay.compare_trees({"params": a["params"]}, a).first_mismatch == "<tree structure>"


def exit_code_and_error(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        replay.main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_bad_inputs_exit_2_naming_the_problem(run_dir, tmp_path, capsys):
    code, err = exit_code_and_error(capsys, f"--workdir={tmp_path / 'nope'}", "--step=1")
    assert code == 2 and "--workdir: no such directory" in err
    code, err = exit_code_and_error(capsys, f"--workdir={run_dir}", "--step=2")  # no checkpoint 3
    assert code == 2 and "needs checkpoints 2 and 3" in err and "found [1, 2]" in err
    code, err = exit_code_and_error(capsys, f"--workdir={run_dir}", "--step=-1")
    assert code == 2 and "--step: must be >= 0" in err
    work = tampered_copy(run_dir, tmp_path)
    os.remove(batch_path(str(work), 1))
    code, err = exit_code_and_error(capsys, f"--workdir={work}", "--step=1")
    assert code == 2 and "no saved batch for step 1" in err and "save_batches" in err
    code, err = exit_code_and_error(capsys, f"--workdir={run_dir}")
    assert code == 2 and "--step" in err  # argparse: required
