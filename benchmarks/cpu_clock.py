"""CPU seconds per phase for bench_phases: this process (the trainer; every thread) plus its descendants
(the vLLM server, its engine core and workers), so a phase's cost is also counted in core-seconds.

On a host with C cores a step cannot take less than (CPU seconds of its phases) / C however they overlap:
`core_floor_s` is that bound, the one the async step meets on 2 cores when both phases want every core.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path


def _stat(pid: int) -> tuple[int, int]:
    """(ppid, utime + stime in clock ticks) of `pid` from /proc; OSError when it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


class CpuClock:
    """`read() -> (trainer CPU s, descendants' CPU s)`. The descendants are found once by a /proc scan
    and again only when one of them has gone (the server's processes live as long as the loop), so a
    read costs a few /proc reads, not a scan. A descendant counts from when a scan first finds it (what
    it used before is not this clock's), and one that exits keeps what it was last read at, so the
    descendants' total never jumps when the set of processes changes."""

    def __init__(self):
        self._tick = os.sysconf("SC_CLK_TCK")
        self._base: dict[int, int] = {}  # pid -> its CPU ticks when first found
        self._last: dict[int, int] = {}  # pid -> its CPU ticks when last read
        self._gone = 0  # ticks of descendants that have exited, since they were found

    def _scan(self) -> None:
        stats = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, IndexError, ValueError):
                stats[int(pid)] = _stat(int(pid))
        family, size = {os.getpid()}, 0
        while len(family) != size:
            size = len(family)
            family |= {pid for pid, (ppid, _) in stats.items() if ppid in family}
        family.discard(os.getpid())
        for pid in set(self._base) - family:
            self._gone += self._last.pop(pid) - self._base.pop(pid)
        for pid in family - set(self._base):
            self._base[pid] = self._last[pid] = stats[pid][1]

    def children_s(self) -> float:
        try:
            for pid in self._base:
                self._last[pid] = _stat(pid)[1]
        except OSError:  # one has exited: it keeps its last reading, the others are read again
            self._scan()
            for pid in self._base:
                with contextlib.suppress(OSError):
                    self._last[pid] = _stat(pid)[1]
        return (self._gone + sum(self._last[p] - self._base[p] for p in self._base)) / self._tick

    def rescan(self) -> None:
        """Looks for new descendants (call after the server started)."""
        self._scan()

    def has_children(self) -> bool:
        return bool(self._base)

    def read(self) -> tuple[float, float]:
        return time.process_time(), self.children_s()


class PhaseCpu:
    """CPU seconds (trainer + server) per named phase and per step, fed by `phase(name)` contexts and
    `step()` at each step's end: `step()` returns {'bench/cpu_<phase>_s', 'bench/cpu_step_s',
    'bench/server_cpu_step_s'} since the previous `step()`."""

    def __init__(self, clock: CpuClock | None = None):
        self.clock = clock or CpuClock()
        self._phases: dict[str, float] = {}
        self._last = self.clock.read()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.clock.has_children():  # the loop's first phase: its server has started by now
            self.clock.rescan()
        t0, c0 = self.clock.read()
        try:
            yield
        finally:
            t1, c1 = self.clock.read()
            self._phases[name] = self._phases.get(name, 0.0) + (t1 - t0) + (c1 - c0)

    def step(self) -> dict[str, float]:
        now = self.clock.read()
        (t0, c0), (t1, c1) = self._last, now
        out = {f"bench/cpu_{k}_s": v for k, v in self._phases.items()}
        out |= {"bench/cpu_step_s": (t1 - t0) + (c1 - c0), "bench/server_cpu_step_s": c1 - c0}
        self._phases, self._last = {}, now
        return out


def core_floor_s(cpu_seconds: list[float], cores: int) -> float:
    """The least wall time `cpu_seconds` of work can take on `cores` cores, overlapped perfectly."""
    return sum(cpu_seconds) / max(cores, 1)
