"""How the suite shares the machine's cores: pytest-xdist (`-n auto` in pyproject.toml) with a scheduler
of our own, `GroupScheduling`.

Groups. Every test gets one:
- tests that share something expensive belong together: a resource of `shared.py` (the two vLLM family
  servers, the Slurm cluster) or a module-, class- or package-scoped fixture. Connected through either,
  they form one group, which one worker runs in a row: each resource starts once.
- a per-worker resource (`Shared(..., per_worker=True)`: the tiny_arith server) joins nothing: its users
  (the fault suite, the resume, replay and default-job runs, a Slurm job) took 1,160 s in a row on one
  worker, most of the suite's wall time. Their groups go out first instead, so each worker runs the ones it
  gets in a row and starts its own copy once (at most one per worker: two extra vLLM start-ups on 3).
- any other test is a group of its own.
Order: the groups of per-worker resource users first, then the rest; each by estimated cost, largest first
(a longest-processing-time schedule: the big ones start at once on different workers, the small ones fill
the gaps at the end); a group keeps its tests in collection order. A serial run (`-n 0`) gets the same order.

xdist's own `--dist loadgroup` cannot carry this: it tags the groups onto node ids, which pytest 9.2 no
longer lets a plugin rewrite. So the workers, which collect, write the groups to a file that the controller
(which does not) reads when it schedules (`RLJAX_TEST_GROUPS_DIR`, set by the controller for its workers).

`-n auto` starts one worker more than there are cores, but no more than one per 6 GiB of memory. Much of a
test's time is spent waiting (on a server's start-up, a subprocess, a Slurm poll), so a third worker fills
what two leave idle: on 2 cores and 24 GiB, 2 workers ran the suite in 1,466 s, 3 in 1,345 s with the cores
96% busy and 15.5 GiB of memory at the peak (a worker may hold a vLLM server or two, a run's subprocesses
and its own JAX programs); with the arith server per worker, 3 ran it in 919 s, 14.6 GiB at the peak.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from shared import GROUP, resource_names

HEAVY_MARKS = ("vllm", "slurm", "multiprocess", "slow")  # a real server, cluster, job or long run: ~30 s
HEAVY_S, LIGHT_S, RESOURCE_START_S = 30.0, 1.0, 40.0
WIDE_SCOPES = ("module", "class", "package")
GIB_PER_WORKER = 6
GROUPS_DIR = "RLJAX_TEST_GROUPS_DIR"


def _keys(item) -> list[str]:
    """What `item` shares with other tests: resources by fixture name, modules by path."""
    fixturedefs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    keys = [f"resource:{name}" for name in resource_names(per_worker=False) if name in item.fixturenames]
    if any(d.scope in WIDE_SCOPES for defs in fixturedefs.values() for d in defs):
        keys.append(f"module:{item.nodeid.split('::')[0]}")
    return keys


def groups_of(items) -> list[str]:
    """One group name per item: the connected component of its keys, or its own node id."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    keys = [_keys(item) for item in items]
    for ks in keys:
        for k in ks[1:]:
            parent[find(k)] = find(ks[0])
    members: dict[str, set[str]] = {}
    for ks in keys:
        for k in ks:
            members.setdefault(find(k), set()).add(k)
    names = {root: "+".join(sorted(m)) for root, m in members.items()}
    return [names[find(ks[0])] if ks else item.nodeid for ks, item in zip(keys, items, strict=True)]


def _cost(item) -> float:
    return HEAVY_S if any(item.get_closest_marker(m) for m in HEAVY_MARKS) else LIGHT_S


def pytest_configure(config):
    """The controller of an xdist run makes the directory its workers write their groups to."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[GROUPS_DIR] = tempfile.mkdtemp(prefix="rljax-test-groups-")


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and GROUPS_DIR in os.environ:
        shutil.rmtree(os.environ.pop(GROUPS_DIR), ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after every other hook has chosen the tests and their marks
def pytest_collection_modifyitems(config, items):
    groups = groups_of(items)
    per_worker = set(resource_names(per_worker=True))
    cost: dict[str, float] = {}
    first: dict[str, int] = {}
    early: set[str] = set()  # groups with a user of a per-worker resource
    for i, (item, group) in enumerate(zip(items, groups, strict=True)):
        item.stash[GROUP] = group
        cost[group] = cost.get(group, 0.0) + _cost(item)
        first.setdefault(group, i)
        if per_worker & set(item.fixturenames):
            early.add(group)
    for group in cost:
        cost[group] += RESOURCE_START_S * group.count("resource:")
    order = sorted(
        range(len(items)), key=lambda i: (groups[i] not in early, -cost[groups[i]], first[groups[i]], i)
    )
    items[:] = [items[i] for i in order]
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker and os.environ.get(GROUPS_DIR):
        path = os.path.join(os.environ[GROUPS_DIR], f"{worker}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({items[j].nodeid: groups[i] for j, i in enumerate(order)}, f)
        os.replace(path + ".tmp", path)


def auto_workers(cores: int, memory_gib: float) -> int:
    """One worker more than the cores, at most one per GIB_PER_WORKER of memory, at least one."""
    return max(1, min(cores + 1, int(memory_gib // GIB_PER_WORKER)))


def pytest_xdist_auto_num_workers(config) -> int:
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return auto_workers(len(os.sched_getaffinity(0)), memory_gib)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling over our groups, in the workers' (cost) order: each group goes to one
        worker as a whole; a worker with two tests or fewer left gets the next group in line."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.config.option.loadscopereorder = False  # keep the cost order the workers collected in
            self._groups: dict[str, str] = {}

        def schedule(self) -> None:
            if not self._groups and self.collection_is_completed:
                directory = os.environ[GROUPS_DIR]
                name = min(n for n in os.listdir(directory) if n.endswith(".json"))  # all workers agree
                with open(os.path.join(directory, name)) as f:
                    self._groups = json.load(f)
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return self._groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)
