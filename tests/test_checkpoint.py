"""Real orbax checkpoints: round trip, preservation policy, corrupt-latest fall-back, re-meshing."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_env import child_env

from rljax.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    RestoreOutcome,
    abstract_like,
    agree,
    classify_restore_error,
)


def make_state(seed, mesh=None):
    k1, k2 = jax.random.split(jax.random.key(seed))
    state = {
        "params": {"w": jax.random.normal(k1, (8, 16)), "b": jax.random.normal(k2, (16,))},
        "step": jnp.asarray(seed, jnp.int32),
    }
    if mesh is not None:
        state["params"]["w"] = jax.device_put(state["params"]["w"], NamedSharding(mesh, P("fsdp", None)))
    return state


def assert_tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_and_extra_items(tmp_path):
    ck = Checkpointer(str(tmp_path), keep_last=3)
    state = make_state(1)
    extra = {"data": {"epoch": 1, "index": 17, "seed": 3}, "policy_version": 4, "buffer": [[1, 2], [3]]}
    ck.save(4, state, extra, {"trainer": {"steps": 9}})
    ck.wait()
    step, restored, got_extra = ck.restore_latest(abstract_like(state))
    assert step == 4 and got_extra == extra
    assert_tree_equal(restored, state)
    assert ck.restore_config(4) == {"trainer": {"steps": 9}}
    ck.close()


def test_keep_last_plus_every_k(tmp_path):
    ck = Checkpointer(str(tmp_path), keep_last=2, keep_every=4, async_save=False)
    for step in range(1, 10):
        ck.save(step, make_state(step), {}, {})
    ck.wait()
    assert ck.all_steps() == [4, 8, 9]  # last 2 (8, 9) plus every 4th (4, 8)
    ck.close()


def corrupt(step_dir: pathlib.Path):
    """Overwrites every array data file of a finished step with garbage of the same size."""
    hit = 0
    for f in step_dir.rglob("*"):
        if f.is_file() and ("ocdbt" in str(f) or "d/" in str(f.relative_to(step_dir))):
            f.write_bytes(os.urandom(max(f.stat().st_size, 16)))
            hit += 1
    assert hit, f"found no array files to corrupt under {step_dir}"


def test_corrupt_latest_falls_back_to_previous(tmp_path, capsys):
    ck = Checkpointer(str(tmp_path), async_save=False)
    ck.save(1, make_state(1), {"k": 1}, {})
    ck.save(2, make_state(2), {"k": 2}, {})
    ck.wait()
    corrupt(tmp_path / "2" / "state")
    step, restored, extra = ck.restore_latest(abstract_like(make_state(0)))
    assert step == 1 and extra == {"k": 1}
    assert_tree_equal(restored, make_state(1))
    assert "checkpoint step 2" in capsys.readouterr().err
    # The bad step is moved aside (kept), so the resumed run can write step 2 again and resume from it.
    assert ck.all_steps() == [1] and len(list((tmp_path / "corrupt").iterdir())) == 1
    ck.save(2, make_state(5), {"k": 5}, {})
    ck.wait()
    step, restored, extra = Checkpointer(str(tmp_path)).restore_latest(abstract_like(make_state(0)))
    assert step == 2 and extra == {"k": 5}
    assert_tree_equal(restored, make_state(5))


def test_all_corrupt_raises_rather_than_starting_over(tmp_path):
    ck = Checkpointer(str(tmp_path), async_save=False)
    ck.save(1, make_state(1), {}, {})
    ck.wait()
    corrupt(tmp_path / "1" / "state")
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        ck.restore_latest(abstract_like(make_state(0)))


def test_partial_save_directory_is_ignored(tmp_path):
    ck = Checkpointer(str(tmp_path), async_save=False)
    ck.save(1, make_state(1), {}, {})
    ck.wait()
    (tmp_path / "2.orbax-checkpoint-tmp").mkdir()  # what a process killed mid-save leaves behind
    step, _, _ = Checkpointer(str(tmp_path)).restore_latest(abstract_like(make_state(0)))
    assert step == 1


def test_empty_directory_restores_nothing(tmp_path):
    assert Checkpointer(str(tmp_path)).restore_latest(abstract_like(make_state(0))) is None


def test_restore_onto_a_different_mesh(tmp_path):
    devices = np.array(jax.devices())
    assert len(devices) == 8
    mesh8 = Mesh(devices.reshape(8), ("fsdp",))
    mesh4 = Mesh(devices[:4].reshape(4), ("fsdp",))
    state = make_state(3, mesh8)
    ck = Checkpointer(str(tmp_path), async_save=False)
    ck.save(5, state, {}, {})
    ck.wait()
    target = abstract_like(make_state(0, mesh4))
    _, restored, _ = ck.restore_latest(target)
    assert restored["params"]["w"].sharding.mesh.devices.size == 4
    assert_tree_equal(restored, state)


def test_saved_batch_round_trips_bit_for_bit(tmp_path):
    from rljax.checkpoint import batch_path, load_batch, save_batch
    from rljax.trajectory import Trajectory, build_loss_inputs

    trajs = [
        Trajectory([3, 4], [5, 6, 7], [-0.5, -1.25, -2.0], 1.0, 0, 2),
        Trajectory([3], [9], [-0.1], 0.0, 1, 1),
    ]
    batch = build_loss_inputs(trajs, np.asarray([0.7, -0.7], np.float32), temperature=0.8, top_p=0.9, top_k=5)
    path = save_batch(str(tmp_path), 3, batch)
    assert path == batch_path(str(tmp_path), 3) and path.endswith("batches/step_00000003.npz")
    assert os.listdir(tmp_path / "batches") == ["step_00000003.npz"]  # no temporary file left behind
    got = load_batch(path)
    assert (got.temperature, got.top_p, got.top_k) == (0.8, 0.9, 5)
    assert jax.tree.structure(got) == jax.tree.structure(batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(batch), strict=True):
        assert a.dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)


def test_slow_save_hook_keeps_the_step_unlisted_until_renamed(tmp_path, monkeypatch):
    """tests/support/slow_save.py holds only the chosen step between its data write and its rename."""
    import slow_save

    slow_save.install(3.0, 2, monkeypatch)
    ck = Checkpointer(str(tmp_path), async_save=True)
    ck.save(1, make_state(1), {"k": 1}, {})
    ck.wait()
    ck.save(2, make_state(2), {"k": 2}, {})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
    ck.wait()
    assert ck.all_steps() == [1, 2] and ck.restore_extra(2) == {"k": 2}
    ck.close()


# ------------------------------------------------ which failures quarantine, and agreement across processes
def two_steps(tmp_path):
    ck = Checkpointer(str(tmp_path), async_save=False)
    ck.save(1, make_state(1), {"k": 1}, {})
    ck.save(2, make_state(2), {"k": 2}, {})
    ck.wait()
    return ck


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["params"].update(w=jnp.zeros((8, 32))),  # a wider layer: another model config
        lambda s: s["params"].update(extra=jnp.zeros(3)),  # a new parameter: another optimizer/model
    ],
    ids=["shape", "structure"],
)
def test_changed_state_is_a_clear_error_not_corruption(tmp_path, change):
    ck = two_steps(tmp_path)
    target = make_state(0)
    change(target)
    with pytest.raises(CheckpointMismatchError, match="checkpoint step 2 .* does not fit this run's state"):
        ck.restore_latest(abstract_like(target))
    assert ck.all_steps() == [1, 2] and not (tmp_path / "corrupt").exists()  # nothing moved


def test_corrupt_extra_json_is_corruption(tmp_path):
    ck = two_steps(tmp_path)
    (tmp_path / "2" / "extra" / "metadata").write_text("{not json")
    step, _, extra = ck.restore_latest(abstract_like(make_state(0)))
    assert step == 1 and extra == {"k": 1}
    assert ck.all_steps() == [1] and len(list((tmp_path / "corrupt").iterdir())) == 1


def test_truncated_array_file_is_corruption(tmp_path):
    ck = two_steps(tmp_path)
    for f in (tmp_path / "2" / "state" / "d").iterdir():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    step, restored, _ = ck.restore_latest(abstract_like(make_state(0)))
    assert step == 1 and ck.all_steps() == [1]
    assert_tree_equal(restored, make_state(1))


def test_io_error_moves_nothing(tmp_path, monkeypatch):
    """An I/O error that is not recognisable corruption (injected into the real orbax read) stops the
    restore with a clear error and leaves every step in place."""
    import orbax.checkpoint as ocp

    ck = two_steps(tmp_path)

    def eio(self, directory, args=None):
        raise OSError(5, "Input/output error", str(directory))

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", eio)
    with pytest.raises(CheckpointError, match="not recognisably corrupt .*OSError.*nothing was moved"):
        ck.restore_latest(abstract_like(make_state(0)))
    assert ck.all_steps() == [1, 2] and not (tmp_path / "corrupt").exists()


@pytest.mark.parametrize(
    "error, outcome",
    [
        (ValueError("DATA_LOSS: Error decoding manifest"), RestoreOutcome.CORRUPT),
        (ValueError("OUT_OF_RANGE: Error reading byte range"), RestoreOutcome.CORRUPT),
        (json.JSONDecodeError("Expecting value", "{", 1), RestoreOutcome.CORRUPT),
        (
            ValueError("Requested shape: (8, 32) is not compatible with the stored shape: (8, 16)."),
            RestoreOutcome.MISMATCH,
        ),
        (OSError(5, "Input/output error"), RestoreOutcome.FAILED),
        (TimeoutError("read timed out"), RestoreOutcome.FAILED),
        (ValueError("UNAVAILABLE: connection reset"), RestoreOutcome.FAILED),
        (RuntimeError("something else"), RestoreOutcome.FAILED),
    ],
)
def test_classify_restore_error(error, outcome):
    assert classify_restore_error(error) is outcome


def test_agree_takes_the_worst_outcome_of_all_processes():
    ok, corrupt, failed, mismatch = RestoreOutcome
    assert agree([ok, ok]) is ok
    assert agree([ok, corrupt]) is corrupt and agree([corrupt, ok, ok]) is corrupt
    assert agree([corrupt, failed]) is failed
    assert agree([ok, mismatch, corrupt]) is mismatch


def test_a_step_corrupt_on_another_process_is_skipped_here_too(tmp_path, monkeypatch):
    """Control flow: this process reads step 2 fine, another reports it corrupt (the allgather faked):
    this process must not use step 2 either, and step 2 is quarantined only after step 1 restores."""
    import rljax.checkpoint as ckpt

    ck = two_steps(tmp_path)
    seen = []

    def others_say_corrupt_at_2(local):
        seen.append((local, sorted(p.name for p in tmp_path.iterdir())))
        return agree([local, RestoreOutcome.CORRUPT if len(seen) == 1 else RestoreOutcome.OK])

    monkeypatch.setattr(ckpt, "agree_across_processes", others_say_corrupt_at_2)
    step, restored, extra = ck.restore_latest(abstract_like(make_state(0)))
    assert step == 1 and extra == {"k": 1}
    assert_tree_equal(restored, make_state(1))
    assert seen[0][0] is RestoreOutcome.OK and "2" in seen[1][1]  # nothing moved before agreement
    assert ck.all_steps() == [1] and len(list((tmp_path / "corrupt").iterdir())) == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_agree_on_the_restorable_step(tmp_path):
    """Real jax.distributed job of 2 processes and real orbax: process 1 alone fails to read step 2's
    bytes; both restore step 1 (the same values) and step 2 is quarantined once."""
    import json as json_lib
    import subprocess
    import sys

    worker = pathlib.Path(__file__).resolve().parent / "support" / "mp_checkpoint_worker.py"
    port, ckpt_dir = _free_port(), tmp_path / "ckpt"
    env = child_env()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), str(port), str(ckpt_dir), str(tmp_path / f"out{i}.json")]
            + (["2"] if i == 1 else []),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:  # processes that disagree end up in mismatched collectives and hang: the timeout is the failure
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs
    results = [json_lib.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    for r in results:
        assert r["step"] == 1 and r["extra"] == {"k": 1} and r["values_match"], r
        assert r["all_steps"] == [1] and len(r["corrupt"]) == 1 and r["corrupt"][0].startswith("2-"), r
