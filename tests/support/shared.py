"""Expensive test resources (vLLM servers, the Slurm cluster) started by the first test that needs one and
stopped after the last test of its group (load with `pytest_plugins`).

A session-scoped fixture would keep a server alive until the end of the run: with two xdist workers and
the per-test servers of other tests beside them that is more memory than a 24 GiB machine has. A
`Shared` resource is kept while consecutive tests use it or while the tests of its group run (`parallel.py`
puts all the users of one resource in one group, which runs in a row on one worker): each resource starts
once per run. A test that needs a resource again later (another order, a single test) gets a fresh one:
correct, only slower.

`Shared(name, stop, per_worker=True)`: a resource cheap enough to start once per worker, whose users take
so long together that one worker running them all would set the suite's wall time (the tiny_arith server:
the fault suite, the resume and replay runs, the Slurm jobs...). Its users are not joined into one group;
`parallel.py` hands their groups out first, so each worker runs the ones it gets in a row and starts its
own copy at most once.

A resource is declared at import (`Shared(name, stop)`: `parallel.py` reads the names at collection) and
exposed by a fixture of the same name that calls `Shared.get(start)` (a session fixture may return a handle
that calls it on use, as `vllm_server.ArithServer` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

_RESOURCES: dict[str, Shared] = {}  # fixture name -> resource
GROUP = pytest.StashKey[str]()  # an item's group (parallel.py): its resources outlive tests that skip them


class Shared:
    """A value built by `get(start)` when there is none, released by `stop(value)` after its last user."""

    def __init__(self, name: str, stop: Callable[[Any], None], *, per_worker: bool = False):
        self.name, self._stop, self.per_worker = name, stop, per_worker
        self._value: Any = None
        _RESOURCES[name] = self

    def get(self, start: Callable[[], Any]) -> Any:
        if self._value is None:
            self._value = start()
        return self._value

    def close(self) -> None:
        value, self._value = self._value, None
        if value is not None:
            self._stop(value)


def resource_names(*, per_worker: bool | None = None) -> tuple[str, ...]:
    """The resources' fixture names: all, or those with (True) or without (False) a copy per worker."""
    return tuple(n for n, r in _RESOURCES.items() if per_worker is None or r.per_worker == per_worker)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own fixtures are torn down: close each resource the next test does not use, unless
    the next test is of the same group (whose tests run in a row and use its resources now and then)."""
    if nextitem is not None and GROUP in item.stash and item.stash[GROUP] == nextitem.stash.get(GROUP, None):
        return
    following = set(getattr(nextitem, "fixturenames", ())) if nextitem is not None else set()
    for name, resource in _RESOURCES.items():
        if name not in following:
            resource.close()


def pytest_sessionfinish(session, exitstatus):
    for resource in _RESOURCES.values():
        resource.close()
