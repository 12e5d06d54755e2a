"""Starts a server process that dies with its parent (stdlib only; run by path: `python -I child_exec.py`).

    python -I child_exec.py PARENT_PID COMMAND [ARGS...]

sets, then execs COMMAND (same PID, same environment):
- SIGTERM when PARENT_PID dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG, kept across exec), so a
  crashed trainer never leaves an orphaned server holding memory; if the parent is already gone, exit 143;
- SIGUSR1 ignored: the trainer's preemption signal (Slurm may deliver it to every process of the step) is for
  the trainer, and the server must keep serving until the trainer has saved and stops it;
- all cores allowed: a trainer pinned to its own cores (`placement.pin_process`) must not pass that mask to
  a server it restarts (vLLM places its threads within the cores it is allowed).
This runs in a fresh interpreter instead of a `preexec_fn`: Python code between fork and exec of a
multithreaded trainer (JAX's threads) can deadlock, and JAX warns about it on every server start.
"""

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, command = int(argv[1]), argv[2:]
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except OSError:  # not Linux: fall back to the explicit stop() paths
        pass
    if os.getppid() != parent:  # the parent died before the death signal was set
        os._exit(143)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
