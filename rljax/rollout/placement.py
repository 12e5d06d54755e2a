"""Host placement: which cores the vLLM CPU engine and the trainer use when they share a host.

`plan_placement(cpus, mode, ...)` -> `Placement(server_cpus, trainer_cpus)`:
- "auto" (default): sync mode (`overlap=False`: generation and update alternate) leaves the trainer on all
  cores and binds vLLM's worker to all but one, the last one being left to vLLM's engine core and API
  server (vLLM's own auto rule on one NUMA node); async mode (`overlap=True`: both run at once) splits
  the cores when each side gets at least 2, the worker on the first half, the trainer on the rest (with
  the engine core and API server, which are mostly idle); with fewer it places like sync mode.
- "none": vLLM's own binding (VLLM_CPU_OMP_THREADS_BIND=auto), the trainer unpinned.
- "split": the async split in either mode.

`server_thread_env(placement, idle_spin_s)` is the vLLM child's environment for it (VLLM_CPU_OMP_THREADS_BIND,
and `RLJAX_VLLM_IDLE_SPIN_S`, read by `worker.plugin.quiet_idle_spin` inside vLLM's processes).
`pin_process(cpus)` places every thread of this process (XLA's intra-op pool exists by then, so each
thread is moved).

Idle spin: a vLLM worker reading its shared-memory message queue busy-polls (`sched_yield`) for 1 s after
its last message before sleeping on a socket (`SpinCondition.busy_loop_s`, hard-coded in vLLM 0.32); after
every generation that second takes one of the trainer's cores. `rljax.weight_sync.worker.plugin`'s
`quiet_idle_spin()` (run in every vLLM process) lowers it to `RLJAX_VLLM_IDLE_SPIN_S`. The writer pings the
socket on every message, but a ping can be lost (vLLM re-checks the queue every 5 s for that reason,
`SHM_READER_RECHECK_INTERVAL_MS`): measured with no spin and vLLM's 5 s re-check, a sync's control calls
stalled 5 or 10 s each. So a sleeping reader also re-checks every `IDLE_RECHECK_MS` (an idle worker then
wakes 200 times a second for a few microseconds, instead of spinning; both in `weight_sync.idle_spin`).
"""

from __future__ import annotations

import dataclasses
import os

from rljax.weight_sync.idle_spin import IDLE_SPIN_ENV

MODES = ("auto", "none", "split")
MIN_SPLIT_CORES = 2  # auto splits the cores in async mode only when each side gets this many


@dataclasses.dataclass(frozen=True)
class Placement:
    """`server_cpus`: the vLLM worker's OpenMP cores (() = vLLM decides); `trainer_cpus` (() = unpinned)."""

    server_cpus: tuple[int, ...] = ()
    trainer_cpus: tuple[int, ...] = ()


def allowed_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask), sorted."""
    return tuple(sorted(os.sched_getaffinity(0)))


def plan_placement(cpus: tuple[int, ...], mode: str, *, overlap: bool, server_on_host: bool) -> Placement:
    """The cores of each side for `mode` (see the module docstring); unplaced when the server is not on
    this host, with one core, or with mode "none"."""
    if mode not in MODES:
        raise ValueError(f"placement mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none" or not server_on_host or len(cpus) < 2:
        return Placement()
    # Measured on 2 cores (bench_phases, async): pinning the trainer to one core cost more than sharing
    # both with the worker (async step 0.88x of the sync step split, 0.72x unpinned), so auto splits only
    # when each side gets at least MIN_SPLIT_CORES.
    if mode == "split" or (overlap and len(cpus) >= 2 * MIN_SPLIT_CORES):
        half = len(cpus) // 2
        return Placement(server_cpus=cpus[:half], trainer_cpus=cpus[half:])
    return Placement(server_cpus=cpus[:-1], trainer_cpus=())


def server_thread_env(placement: Placement, idle_spin_s: float) -> dict[str, str]:
    """Environment for a vLLM CPU server: its worker's OpenMP cores and the idle-spin limit."""
    env = {IDLE_SPIN_ENV: repr(float(idle_spin_s))}
    if placement.server_cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in placement.server_cpus)
        env["OMP_NUM_THREADS"] = str(len(placement.server_cpus))
    return env


def pin_process(cpus: tuple[int, ...]) -> int:
    """Sets the affinity of every thread of this process to `cpus`; returns how many threads moved."""
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            moved += 1
        except (ProcessLookupError, PermissionError):  # a thread that just exited
            continue
    return moved
