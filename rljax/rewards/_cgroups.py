"""Per-run cgroups for the sandbox: total memory, process count and CPU share of one run, and a clean kill.

cgroup v2 is used where the unified hierarchy has the memory and pids controllers; otherwise cgroup v1
(one directory per controller under /sys/fs/cgroup/{memory,pids,cpu}). Each run gets its own cgroup named
`rljax-sb-<owner pid>-<n>` below the caller's own cgroup (so the caller's limits still bound it). When a
run ends, every process left in it is killed and the directories are removed; cgroups whose owner died
(a SIGKILLed reward worker) are swept by `sweep_stale`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import signal
import time

ROOT = pathlib.Path("/sys/fs/cgroup")
PREFIX = "rljax-sb-"
_REQUIRED = ("memory", "pids")  # cpu is applied where present
_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where per-run cgroups go: {controller: parent dir}; v2 has one parent for all controllers."""

    version: int
    parents: dict[str, pathlib.Path]


def _own_path(hierarchy: str) -> str:
    """This process's cgroup path in a v1 hierarchy ("memory") or v2 (""), from /proc/self/cgroup."""
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if hierarchy in controllers.split(",") or (hierarchy == "" and controllers == ""):
            return path
    raise LookupError(hierarchy)


def _v2_layout() -> Layout | None:
    mount = next((m for m in (ROOT / "unified", ROOT) if (m / "cgroup.subtree_control").exists()), None)
    if mount is None:
        return None
    parent = mount / _own_path("").lstrip("/")
    if not set(_REQUIRED) <= set((parent / "cgroup.controllers").read_text().split()):
        return None
    wanted = [c for c in (*_REQUIRED, "cpu") if c in (parent / "cgroup.controllers").read_text().split()]
    # Why: a v2 cgroup with processes cannot enable controllers for its children ("no internal
    # processes"); then v2 is not usable from here without moving the caller, which we do not do.
    (parent / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
    return Layout(2, {c: parent for c in wanted})


def _v1_layout() -> Layout | None:
    parents = {}
    for controller in (*_REQUIRED, "cpu"):
        mount = ROOT / controller
        if (mount / "cgroup.procs").exists() and os.access(mount, os.W_OK):
            parents[controller] = mount / _own_path(controller).lstrip("/")
    return Layout(1, parents) if set(_REQUIRED) <= set(parents) else None


def detect() -> Layout:
    """The usable layout (v2 with controllers, else v1); raises OSError saying why neither works."""
    problems = []
    for version, find in ((2, _v2_layout), (1, _v1_layout)):
        try:
            layout = find()
        except (OSError, LookupError) as e:
            problems.append(f"v{version}: {e}")
            continue
        if layout is not None:
            return layout
        problems.append(f"v{version}: no writable {'+'.join(_REQUIRED)} controllers")
    raise OSError("no usable cgroup (" + "; ".join(problems) + ")")


def _files(limits: dict[str, int], version: int) -> dict[str, list[tuple[str, str]]]:
    """Controller -> [(file, value)] for memory bytes, max pids and CPU (in 1/1000 of a core)."""
    period = 100_000
    quota = str(max(1000, limits["cpu_millis"] * period // 1000))
    if version == 2:
        return {
            "memory": [("memory.max", str(limits["memory"])), ("memory.swap.max", "0")],
            "pids": [("pids.max", str(limits["pids"]))],
            "cpu": [("cpu.max", f"{quota} {period}")],
        }
    return {
        "memory": [
            ("memory.limit_in_bytes", str(limits["memory"])),
            ("memory.memsw.limit_in_bytes", str(limits["memory"])),
        ],  # fmt: skip
        "pids": [("pids.max", str(limits["pids"]))],
        "cpu": [("cpu.cfs_period_us", str(period)), ("cpu.cfs_quota_us", quota)],
    }


def create(layout: Layout, *, memory: int, pids: int, cpu_millis: int) -> list[pathlib.Path]:
    """Makes one run's cgroup(s) with the limits set; returns their dirs (the processes join them)."""
    name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
    files = _files({"memory": memory, "pids": pids, "cpu_millis": cpu_millis}, layout.version)
    dirs = sorted({parent / name for parent in layout.parents.values()})
    try:
        for d in dirs:
            d.mkdir()
        for controller, parent in layout.parents.items():
            for file, value in files[controller]:
                path = parent / name / file
                if path.exists():  # memsw / swap.max only where swap accounting is on
                    path.write_text(value)
    except OSError:
        remove(dirs)
        raise
    return dirs


def memory_killed(dirs: list[pathlib.Path]) -> bool:
    """Whether the kernel's OOM killer killed a process of this run (its memory limit was hit)."""
    for d in dirs:
        for name in ("memory.events", "memory.oom_control"):
            path = d / name
            if path.exists():
                fields = dict(line.split() for line in path.read_text().splitlines() if line.strip())
                return int(fields.get("oom_kill", 0)) > 0
    return False


def _procs(d: pathlib.Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_all(dirs: list[pathlib.Path], within_s: float = 10.0) -> None:
    """SIGKILLs every process in the run's cgroups until none is left (a fork bomb cannot outrun it:
    the pids limit caps it), then waits for them to be gone."""
    end = time.monotonic() + within_s
    for d in dirs:
        kill_file = d / "cgroup.kill"
        if kill_file.exists():
            kill_file.write_text("1")
    while time.monotonic() < end:
        pids = [pid for d in dirs for pid in _procs(d)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


def remove(dirs: list[pathlib.Path]) -> None:
    """Kills what is left and removes the directories (the kernel frees a cgroup once it is empty)."""
    kill_all(dirs)
    for d in dirs:
        for _ in range(100):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY while the last killed process is being torn down
                time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(layout: Layout) -> int:
    """Removes per-run cgroups whose owner process is gone (e.g. a SIGKILLed reward worker); returns the
    number removed. A cgroup whose owner pid was reused is left alone (a leak, never a wrong kill)."""
    stale = {}
    for parent in set(layout.parents.values()):
        for d in parent.glob(PREFIX + "*"):
            owner = d.name[len(PREFIX) :].split("-")[0]
            if owner.isdigit() and not _alive(int(owner)):
                stale.setdefault(d.name, []).append(d)
    for dirs in stale.values():
        remove(dirs)
    return len(stale)
