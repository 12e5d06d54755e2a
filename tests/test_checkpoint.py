"""Real orbax checkpoints: round trip, preservation policy, corrupt-latest fall-back, re-meshing."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.checkpoint import Checkpointer, CheckpointError, abstract_like


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
    from rljax.loop.trajectory import Trajectory, build_loss_inputs

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
    """RLJAX_TEST_SLOW_SAVE_S holds only the chosen step between its data write and its rename."""
    monkeypatch.setenv("RLJAX_TEST_SLOW_SAVE_S", "3")
    monkeypatch.setenv("RLJAX_TEST_SLOW_SAVE_STEP", "2")
    ck = Checkpointer(str(tmp_path), async_save=True)
    ck.save(1, make_state(1), {"k": 1}, {})
    ck.wait()
    ck.save(2, make_state(2), {"k": 2}, {})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
    ck.wait()
    assert ck.all_steps() == [1, 2] and ck.restore_extra(2) == {"k": 2}
    ck.close()
