"""The suite's parallel layout (tests/support/shared.py, tests/support/parallel.py), on an inner test suite
run by a real pytest: a shared resource starts once per run and stops after its last user, whether the
suite runs serially or on two xdist workers; the users of a resource, and the tests of a module with a
module-scoped fixture, run in a row on one worker; expensive groups are handed out first; a per-worker
resource's users go out first, over the workers, each worker starting it once."""

import json
import pathlib
import subprocess
import sys
import time

import pytest
from jax_env import child_env

SUPPORT = pathlib.Path(__file__).resolve().parent / "support"

CONFTEST = """
import json, os, pytest
from shared import Shared

LOG = os.environ["INNER_LOG"]

def log(**event):
    event["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(LOG, "a") as f:
        f.write(json.dumps(event) + "\\n")

def _stop(value):
    log(event="stop", value=value)

SERVER = Shared("server", _stop)

@pytest.fixture
def server():
    def start():
        log(event="start")
        return "srv"
    return SERVER.get(start)

PER = Shared("per", lambda value: log(event="stop_per"), per_worker=True)

@pytest.fixture
def per():
    def start():
        log(event="start_per")
        return "per"
    return PER.get(start)

@pytest.fixture(autouse=True)
def _record(request):
    yield
    log(event="test", test=request.node.name)  # after the test, while its resources are up
"""

USERS_A = """
import pytest

@pytest.mark.slow
def test_a1(server): assert server == "srv"
def test_plain_a(): pass
@pytest.mark.slow
def test_a2(server): assert server == "srv"
"""

USERS_B = """
def test_b1(server): assert server == "srv"
def test_plain_b(): pass
"""

MODULE_FIXTURE = """
import pytest

@pytest.fixture(scope="module")
def built():
    return object()

def test_m1(built): pass
def test_m2(built): pass
"""

PLAIN = "\n".join(f"def test_p{i}(): pass" for i in range(8))

# Users of a per-worker resource: two single tests and a module-fixture group with one user in it.
PER_USERS = {
    "test_w1.py": "def test_w1a(per): pass\ndef test_w1b(per): pass\n",
    "test_w2.py": (
        "import pytest\n\n@pytest.fixture(scope='module')\ndef built():\n    return object()\n\n"
        "def test_w2a(built): pass\ndef test_w2b(built, per): pass\n"
    ),
}


def inner_pytest(tmp_path: pathlib.Path, *args: str, extra_files=None) -> subprocess.CompletedProcess:
    suite = tmp_path / "suite"
    suite.mkdir()
    files = {"test_a.py": USERS_A, "test_b.py": USERS_B, "test_m.py": MODULE_FIXTURE, "test_plain.py": PLAIN}
    for name, text in {"conftest.py": CONFTEST, **files, **(extra_files or {})}.items():
        (suite / name).write_text(text)
    env = child_env(PYTHONPATH=str(SUPPORT), INNER_LOG=str(tmp_path / "events.jsonl"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "shared", "-p", "parallel"]
    return subprocess.run(
        [*cmd, "-c", "/dev/null", "--rootdir", str(suite), *args, str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_inner(tmp_path: pathlib.Path, *args: str) -> list[dict]:
    proc = inner_pytest(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


USERS = {"test_a1", "test_a2", "test_b1"}


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_shared_resource_starts_once_and_its_users_run_in_a_row_on_one_worker(tmp_path, workers):
    events = run_inner(tmp_path, "-n", workers)
    tests = [e for e in events if e["event"] == "test"]
    assert {e["test"] for e in tests} == USERS | {"test_plain_a", "test_plain_b", "test_m1", "test_m2"} | {
        f"test_p{i}" for i in range(8)
    }
    starts = [e for e in events if e["event"] == "start"]
    stops = [e for e in events if e["event"] == "stop"]
    assert len(starts) == 1 and len(stops) == 1, events
    worker = starts[0]["worker"]
    on_worker = [e for e in events if e["worker"] == worker]
    i_start, i_stop = on_worker.index(starts[0]), on_worker.index(stops[0])
    between = [e["test"] for e in on_worker[i_start:i_stop] if e["event"] == "test"]
    # the resource was alive for exactly its three users, one after another, and no other test
    assert set(between) == USERS and len(between) == 3, on_worker
    module_tests = [e for e in tests if e["test"] in ("test_m1", "test_m2")]
    assert len({e["worker"] for e in module_tests}) == 1  # the module fixture was built on one worker


def test_a_per_worker_resource_splits_its_users_over_the_workers_each_starting_it_once(tmp_path):
    proc = inner_pytest(tmp_path, "-n", "2", extra_files=PER_USERS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    per_groups = {"test_w1a", "test_w1b", "test_w2a", "test_w2b"}  # three groups (w2's tests share one)
    workers = {e["worker"] for e in events if e["event"] == "test" and e["test"] in per_groups}
    assert len(workers) == 2, events  # not one worker running them all in a row
    for worker in workers:
        mine = [e for e in events if e["worker"] == worker]
        assert [e["event"] for e in mine].count("start_per") == 1, mine  # once per worker
        tests = [e["test"] for e in mine if e["event"] == "test"]
        # handed out first: the worker's users of the resource (and their group mates) before anything else
        n = len([t for t in tests if t in per_groups])
        assert set(tests[:n]) <= per_groups and not per_groups & set(tests[n:]), tests
        stop = [e["event"] for e in mine].index("stop_per")
        assert not per_groups & {e["test"] for e in mine[stop:] if e["event"] == "test"}  # stopped after them
    # the ordinary resource is unaffected: started once, on one worker
    assert [e["event"] for e in events].count("start") == 1


def test_the_costliest_group_runs_first_serially(tmp_path):
    tests = [e["test"] for e in run_inner(tmp_path, "-n", "0") if e["event"] == "test"]
    # the resource group (two slow tests and a start-up) outweighs every other; it keeps collection order
    assert tests[:3] == ["test_a1", "test_a2", "test_b1"], tests
    assert tests.index("test_m1") + 1 == tests.index("test_m2")


def test_auto_workers_one_more_than_the_cores_within_memory():
    from parallel import auto_workers

    assert auto_workers(2, 23.6) == 3  # this project's CPU machines
    assert auto_workers(2, 15.0) == 2  # memory-bound
    assert auto_workers(16, 64.0) == 10
    assert auto_workers(1, 4.0) == 1


def test_a_worker_that_dies_fails_the_run_promptly_naming_the_test(tmp_path):
    """pyproject's --max-worker-restart=0: with xdist's replacement worker, such a run hangs (checked)."""
    import tomllib

    pyproject = tomllib.loads((SUPPORT.parents[1] / "pyproject.toml").read_text())
    addopts = pyproject["tool"]["pytest"]["ini_options"]["addopts"].split()
    flag = next(a for a in addopts if a.startswith("--max-worker-restart"))
    killer = "import os, signal\n\n\ndef test_dies(server):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    t0 = time.monotonic()
    proc = inner_pytest(tmp_path, "-n", "2", flag, extra_files={"test_dies.py": killer})
    assert time.monotonic() - t0 < 120
    assert proc.returncode != 0
    assert "crashed while running 'test_dies.py::test_dies'" in proc.stdout, proc.stdout
