"""cgroup layout choice (v2 where it has the controllers, else v1) and the limit files, on a fake cgroup
tree (this machine has v1 controllers only; the real v1 path is exercised by test_sandbox_isolation)."""

import pathlib

import pytest

from rljax.rewards import _cgroups


def fake_v2(tmp_path: pathlib.Path, monkeypatch, *, busy: bool) -> pathlib.Path:
    root = tmp_path / "cgroup"
    own = root / "trainer.scope"
    own.mkdir(parents=True)
    (root / "cgroup.subtree_control").write_text("")
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids")
    if busy:  # a directory: writing it fails like EBUSY does for a cgroup that has processes
        (own / "cgroup.subtree_control").mkdir()
    else:
        (own / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(_cgroups, "ROOT", root)
    monkeypatch.setattr(_cgroups, "_own_path", lambda hierarchy: "/trainer.scope")
    return root


def test_v2_runs_go_below_the_callers_cgroup_with_the_limits_written(tmp_path, monkeypatch):
    root = fake_v2(tmp_path, monkeypatch, busy=False)
    layout = _cgroups.detect()
    assert layout.version == 2 and set(layout.parents.values()) == {root / "trainer.scope"}
    assert (root / "trainer.scope/cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    (run,) = _cgroups.create(layout, memory=300 << 20, pids=10, cpu_millis=500)
    assert run.parent == root / "trainer.scope"
    assert (run / "memory.max").read_text() == str(300 << 20)
    assert (run / "pids.max").read_text() == "10"
    assert (run / "cpu.max").read_text() == "50000 100000"
    assert not (run / "memory.swap.max").exists()  # optional: only where swap accounting exists


def test_v2_with_processes_in_the_callers_cgroup_uses_its_parent(tmp_path, monkeypatch):
    root = fake_v2(tmp_path, monkeypatch, busy=True)
    assert set(_cgroups.detect().parents.values()) == {root}


def test_no_usable_cgroup_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(_cgroups, "ROOT", tmp_path / "none")
    with pytest.raises(OSError, match="no usable cgroup.*v1: no writable memory\\+pids"):
        _cgroups.detect()
