"""Reward worker process: `python -m rljax.rewards._worker FD` (started by RewardPool).

Speaks over a multiprocessing Connection on the inherited socket FD:
  <- ("init", sys_path, pickle of [(spec, options), ...], sandbox settings)
                                                   -> ("ready",) | ("init_error", message)
  <- ("call", task_id, fn_index, item)            -> ("result", task_id, value | None, error_kind, message)
  <- None                                          (exit)
A reward value must be a finite real number; anything else is reported as an error, never raised.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from rljax.rewards.base import call_reward, resolve
from rljax.rewards.sandbox import SandboxUnavailable
from rljax.rewards.sandbox import configure as configure_sandbox


def _exit_when_orphaned(parent: int) -> None:
    # Why: a worker stuck in a reward function must not outlive the loop that started it.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def _init(conn: Connection) -> list[tuple[Any, dict[str, Any]]] | None:
    _, sys_path, pickled_specs, sandbox = conn.recv()
    sys.path[:] = list(sys_path)  # before unpickling: callable specs are pickled by module reference
    try:
        configure_sandbox(**sandbox)
        specs = pickle.loads(pickled_specs)

        fns = [(resolve(spec) if isinstance(spec, str) else spec, options) for spec, options in specs]
        for fn, _ in fns:  # one-time set-up (e.g. the sandbox probe) before "ready", not inside a timed call
            warmup = getattr(fn, "warmup", None)
            if callable(warmup):
                warmup()
    except SandboxUnavailable as e:  # a clear one-line reason (fail closed), not a traceback
        conn.send(("init_error", f"SandboxUnavailable: {e}"))
        return None
    except Exception:  # noqa: BLE001 - reported to the pool, which raises it
        conn.send(("init_error", traceback.format_exc()))
        return None
    conn.send(("ready",))
    return fns


def _make_non_dumpable() -> None:
    # Why: no other process of this uid may ptrace the worker or read /proc/<pid>/mem (the items it
    # scores hold the expected answers). Linux only; elsewhere the call is skipped.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass


def main(fd: int) -> None:
    _make_non_dumpable()
    conn = Connection(fd)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    fns = _init(conn)
    if fns is None:
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        _, task_id, index, item = message
        fn, options = fns[index]
        value, kind, text = call_reward(fn, options, item)
        conn.send(("result", task_id, value, kind, text))


if __name__ == "__main__":
    main(int(sys.argv[1]))
