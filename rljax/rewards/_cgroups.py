"""Per-run cgroups for the sandbox: total memory, process count and CPU share of one run, and a clean kill.

cgroup v2 is used where the unified hierarchy has the memory and pids controllers; otherwise cgroup v1
(one directory per controller under /sys/fs/cgroup/{memory,pids,cpu}). Each run gets its own cgroup named
`rljax-sb-<pid namespace>.<owner pid>.<start time>-<n>` below the caller's own cgroup (so the caller's
limits still bound it). When a run ends, every process left in it is killed and the directories are
removed; cgroups whose owner died (a SIGKILLed reward worker) are swept by `sweep_stale`.
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
_OPTIONAL = ("memory.memsw.limit_in_bytes", "memory.swap.max")  # only where swap accounting is on
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
    available = (parent / "cgroup.controllers").read_text().split()
    if not set(_REQUIRED) <= set(available):
        return None
    wanted = [c for c in (*_REQUIRED, "cpu") if c in available]
    # Why: a v2 cgroup with processes cannot enable controllers for its children ("no internal
    # processes"); then the runs go next to the caller's cgroup, below its parent, which already
    # distributes them. We never move the caller.
    problems = []
    for base in [parent] + ([parent.parent] if parent != mount else []):
        try:
            (base / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
            return Layout(2, {c: base for c in wanted})
        except OSError as e:
            problems.append(f"{base}: {e.strerror}")
    raise OSError(
        f"cannot enable {'+'.join(wanted)} for child cgroups ({'; '.join(problems)}): run the trainer in a "
        "delegated cgroup, e.g. `systemd-run --scope -p Delegate=yes ...`"
    )


def _v1_layout() -> Layout | None:
    parents = {}
    for controller in (*_REQUIRED, "cpu"):
        mount = ROOT / controller
        try:
            parent = mount / _own_path(controller).lstrip("/")
        except LookupError:  # not mounted as v1 here
            continue
        if (mount / "cgroup.procs").exists() and os.access(parent, os.W_OK):
            parents[controller] = parent
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
    name = f"{PREFIX}{_owner_token(os.getpid())}-{next(_counter)}"
    files = _files({"memory": memory, "pids": pids, "cpu_millis": cpu_millis}, layout.version)
    dirs = sorted({parent / name for parent in layout.parents.values()})
    try:
        for d in dirs:
            d.mkdir()
        for controller, parent in layout.parents.items():
            for file, value in files[controller]:
                path = parent / name / file
                if file not in _OPTIONAL or path.exists():
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


def _owner_token(pid: int) -> str | None:
    """ "<pid namespace inode>.<pid>.<start time>": names a process unambiguously (a reused PID has another
    start time; a PID of another PID namespace has another inode), or None when `pid` is not running."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    start = stat.rpartition(")")[2].split()[19]  # field 22 of proc(5), counted after the comm field
    return f"{os.stat('/proc/self/ns/pid').st_ino}.{pid}.{start}"


def sweep_stale(layout: Layout) -> int:
    """Removes per-run cgroups whose owner process is gone (e.g. a SIGKILLed reward worker); returns the
    number removed. Owners are named by PID namespace, PID and start time, so a reused PID or another
    namespace's cgroup is never taken for a dead owner; a cgroup of another PID namespace is left alone."""
    ours = f"{os.stat('/proc/self/ns/pid').st_ino}."
    stale = {}
    for parent in set(layout.parents.values()):
        for d in parent.glob(PREFIX + "*"):
            owner = d.name[len(PREFIX) :].rpartition("-")[0]
            if owner.startswith(ours) and _owner_token(int(owner.split(".")[1])) != owner:
                stale.setdefault(d.name, []).append(d)
    for dirs in stale.values():
        remove(dirs)
    return len(stale)
