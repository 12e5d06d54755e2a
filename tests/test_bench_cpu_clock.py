"""benchmarks/cpu_clock.py: a phase's CPU seconds count this process's threads and its child processes."""

import pathlib
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from cpu_clock import PhaseCpu, core_floor_s  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


SPIN = "import time\nt = time.process_time() + 0.4\nwhile time.process_time() < t: pass\ninput()"


def test_phase_cpu_counts_this_process_and_a_child_process():
    cpu = PhaseCpu()
    with cpu.phase("trainer"):
        _spin(0.3)
    with cpu.phase("idle"):
        time.sleep(0.3)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE)
    try:
        with cpu.phase("server"):  # the child spins ~0.4 CPU s (a vLLM server's work, in the loop)
            cpu.clock.rescan()
            before = cpu.clock.children_s()
            while cpu.clock.children_s() - before < 0.35:
                time.sleep(0.05)
        row = cpu.step()
    finally:
        spinner.communicate(b"\n", timeout=30)
    assert row["bench/cpu_trainer_s"] >= 0.29
    assert row["bench/cpu_idle_s"] < 0.1
    assert row["bench/cpu_server_s"] >= 0.35
    assert row["bench/server_cpu_step_s"] >= 0.35
    # The phases are disjoint parts of the step. (Not trainer + server_cpu_step: the clock counts every
    # descendant of this process, so a session-wide server started by an earlier test lands in both.)
    phases = row["bench/cpu_trainer_s"] + row["bench/cpu_idle_s"] + row["bench/cpu_server_s"]
    assert row["bench/cpu_step_s"] >= phases - 1e-6
    assert cpu.step()["bench/cpu_step_s"] < row["bench/cpu_step_s"]  # step() starts a new step


def test_core_floor_divides_the_cpu_seconds_by_the_cores():
    assert core_floor_s([1.0, 2.0, 0.5], 2) == pytest.approx(1.75)
    assert core_floor_s([1.0], 0) == pytest.approx(1.0)


def test_a_child_counts_from_when_it_is_found_not_its_earlier_cpu():
    # A descendant that already used CPU before the clock found it (e.g. a vLLM server started earlier
    # in the same process) must not land in the step that first sees it.
    cpu = PhaseCpu()
    spinner = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE)
    try:
        time.sleep(1.5)  # it spins 0.4 CPU s, then waits on stdin
        with cpu.phase("idle"):  # the first phase scans and finds it
            time.sleep(0.2)
        row = cpu.step()
    finally:
        spinner.communicate(b"\n", timeout=30)
    assert cpu.clock.has_children()
    assert row["bench/server_cpu_step_s"] < 0.1
    assert row["bench/cpu_step_s"] >= row["bench/cpu_idle_s"] - 1e-6
