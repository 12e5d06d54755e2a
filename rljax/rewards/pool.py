"""RewardPool: score a batch with several weighted reward functions in isolated worker processes.

Every (item, function) call runs in one of `num_workers` worker processes (fresh interpreters started with
`python -m rljax.rewards._worker`, so nothing of the loop's state, threads or devices is inherited) under
a per-call timeout. A call that hangs is scored 0 and its worker (and the worker's children, e.g. sandbox
processes) is killed and replaced; a worker that dies (segfault, os._exit) scores its call 0 and is
replaced; an exception, a NaN/inf or a non-number is an error. The whole `score()` call ends by
`total_timeout_s`; calls not done by then count as timeouts. Every failure scores the minimum of the
reward's declared range (`base.declare_range`; 0.0 when unbounded below), and every value is clamped
into the range, counted as `reward_fn/out_of_range` when it was outside.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import psutil

from rljax.rewards._workdirs import RunDir, worker_env
from rljax.rewards.base import call_reward, clamp, failure_score, resolve, reward_range
from rljax.rewards.sandbox import SandboxUnavailable
from rljax.rewards.sandbox import configure as configure_sandbox
from rljax.rewards.sandbox import sweep as sweep_sandboxes

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 30.0  # a fresh worker imports numpy + the rewards; generous for a loaded 2-core machine
RewardSpec = tuple[Any, ...]  # (name | callable, weight) or (name | callable, weight, options)


def _spec_name(spec: str | Callable) -> str:
    return spec if isinstance(spec, str) else f"{spec.__module__}:{spec.__qualname__}"


def _normalize_specs(specs: Sequence[RewardSpec]) -> list[tuple[str, Any, float, dict[str, Any]]]:
    """[(metric name, name-or-callable, weight, options)]; names resolved here so errors come early."""
    if not specs:
        raise ValueError("RewardPool needs at least one (name, weight, options) spec")
    out, seen = [], collections.Counter()
    for spec in specs:
        if len(spec) not in (2, 3):
            raise ValueError(f"reward spec must be (name, weight) or (name, weight, options), got {spec!r}")
        fn, weight, options = spec[0], float(spec[1]), dict(spec[2]) if len(spec) == 3 else {}
        if isinstance(fn, str):
            resolve(fn)
        elif not callable(fn):
            raise ValueError(f"reward spec {spec!r}: first element must be a name or a function")
        name = _spec_name(fn)
        seen[name] += 1
        out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", fn, weight, options))
    return out


def _raise_init_error(text: str) -> None:
    kind, _, reason = text.partition(": ")
    if kind == "SandboxUnavailable":
        raise SandboxUnavailable(reason)
    raise RuntimeError(f"reward worker failed to start:\n{text}")


class _Worker:
    """One worker process and its connection; `task` is (task_id, item, fn) while busy."""

    def __init__(self, init_message: bytes, tmpdir: str):
        parent, child = socket.socketpair()
        # Its own temp dir under the pool's run dir, removed on kill: a worker killed mid-run cannot
        # clean up its sandbox directories itself. An allow-listed environment: no tokens or keys.
        self.tmpdir = tmpdir
        env = worker_env(os.environ, tmpdir)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rljax.rewards._worker", str(child.fileno())],
            pass_fds=(child.fileno(),),
            start_new_session=True,  # Ctrl-C on the loop's terminal is the loop's to handle
            env=env,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send_bytes(init_message)
        self.ready = False
        self.since = time.monotonic()
        self.task: tuple[int, int, int] | None = None

    def kill(self) -> None:
        try:
            victims = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            victims = []
        for p in [*victims]:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.kill()
        self.proc.wait()
        self.conn.close()
        sweep_sandboxes()  # the cgroups of sandboxes it was running when killed
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class RewardPool:
    """Weighted sum of reward functions, computed in worker processes with per-call timeouts.

    specs: [(name, weight, options)], name in REWARDS, "package.module:function", or a module-level
    function (an optional `fn.warmup()` runs once per worker before it takes calls). num_workers=0 runs
    calls inline (no isolation or timeouts; for debugging).
    total_timeout_s: bound on one score() call; default timeout_s * ceil(calls / num_workers) plus a
    worker start-up allowance.
    sandbox: `rljax.rewards.sandbox.configure` settings for the workers (mode, tmpfs_mb, cpus); None
    keeps the sandbox's defaults (namespace mode, failing closed where it cannot run).
    """

    def __init__(self, specs: Sequence[RewardSpec], *, num_workers: int = 2, timeout_s: float = 5.0,
                 total_timeout_s: float | None = None,
                 sandbox: dict[str, Any] | None = None):  # fmt: skip
        self._specs = _normalize_specs(specs)
        self.names = [name for name, *_ in self._specs]
        self.weights = np.asarray([w for _, _, w, _ in self._specs], np.float32)
        self.num_workers, self.timeout_s, self.total_timeout_s = num_workers, timeout_s, total_timeout_s
        self.restarts = 0
        self.last_errors: dict[str, str] = {}
        sandbox = dict(sandbox or {})
        configure_sandbox(**sandbox)  # checks the names here; inline calls (num_workers=0) use it too
        specs_pickle = pickle.dumps([(fn, opts) for _, fn, _, opts in self._specs])
        self._init_message = pickle.dumps(("init", list(sys.path), specs_pickle, sandbox))
        self._inline = [(resolve(fn) if isinstance(fn, str) else fn, o) for _, fn, _, o in self._specs]
        self.ranges = [reward_range(fn, options) for fn, options in self._inline]
        self._run_dir = RunDir()
        self._workers = [self._new_worker() for _ in range(num_workers)]

    def _new_worker(self) -> _Worker:
        return _Worker(self._init_message, self._run_dir.new_worker_dir())

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> bool:
        """Blocks until every worker has started (call once after construction, so start-up is not
        charged to the first step); True if all are ready within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while not all(w.ready for w in self._workers) and time.monotonic() < end:
            waiting = {w.conn: w for w in self._workers if not w.ready}
            for conn in wait(list(waiting), timeout=max(0.0, end - time.monotonic())):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._replace(self._workers.index(waiting[conn]))
                    continue
                if message[0] == "init_error":
                    _raise_init_error(message[1])
                waiting[conn].ready = True
        return all(w.ready for w in self._workers)

    def close(self) -> None:
        """Stops all workers (idempotent)."""
        for worker in self._workers:
            worker.kill()
        self._workers = []
        if hasattr(self, "_run_dir"):
            self._run_dir.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def score(
        self, batch: Sequence[dict[str, Any]]
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Scores `batch` (dicts with prompt, completion, example).

        Returns (rewards f32[B] = sum_k weight_k * per_fn[k], per_fn {name: f32[B]}, metrics) with metrics
        reward_fn/{timeouts,errors,worker_restarts,time_s} and reward_fn/<name>/{mean,timeouts,errors}.
        """
        start, restarts = time.monotonic(), self.restarts
        raw = np.full((len(self._specs), len(batch)), np.nan, np.float64)  # NaN: no valid value (yet)
        timeouts = np.zeros(len(self._specs), np.int64)
        errors = np.zeros(len(self._specs), np.int64)
        if self.num_workers == 0:
            self._score_inline(batch, raw, errors)
        else:
            self._score_in_workers(batch, raw, timeouts, errors)
        values, out_of_range = self._clamp(raw)
        per_fn = {name: values[k] for k, name in enumerate(self.names)}
        metrics = {
            "reward_fn/timeouts": float(timeouts.sum()),
            "reward_fn/errors": float(errors.sum()),
            "reward_fn/out_of_range": float(out_of_range.sum()),
            "reward_fn/worker_restarts": float(self.restarts - restarts),
            "reward_fn/time_s": time.monotonic() - start,
        }
        for k, name in enumerate(self.names):
            metrics[f"reward_fn/{name}/mean"] = float(values[k].mean()) if len(batch) else 0.0
            metrics[f"reward_fn/{name}/timeouts"] = float(timeouts[k])
            metrics[f"reward_fn/{name}/errors"] = float(errors[k])
            metrics[f"reward_fn/{name}/out_of_range"] = float(out_of_range[k])
        return (self.weights @ values).astype(np.float32), per_fn, metrics

    def _clamp(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values f32[K,B] clamped into each range, failures at its minimum; out-of-range counts i64[K])."""
        values = np.empty(raw.shape, np.float32)
        out_of_range = np.zeros(len(self._specs), np.int64)
        for k, bounds in enumerate(self.ranges):
            for i, value in enumerate(raw[k]):
                if math.isnan(value):  # failed call (workers and check_value never pass NaN on as a value)
                    values[k, i] = failure_score(bounds)
                    continue
                values[k, i], outside = clamp(float(value), bounds)
                out_of_range[k] += outside
        return values, out_of_range

    def _record_error(self, k: int, errors: np.ndarray, message: str) -> None:
        errors[k] += 1
        if self.names[k] not in self.last_errors:
            log.warning(
                "reward %s failed (scored %s): %s", self.names[k], failure_score(self.ranges[k]), message
            )
        self.last_errors[self.names[k]] = message

    def _score_inline(self, batch, values, errors) -> None:
        for i, item in enumerate(batch):
            for k, (fn, options) in enumerate(self._inline):
                value, kind, message = call_reward(fn, options, item)
                if kind is None:
                    values[k, i] = value
                else:
                    self._record_error(k, errors, message)

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = self._new_worker()
        self.restarts += 1

    def _score_in_workers(self, batch, values, timeouts, errors) -> None:
        pending = collections.deque((i, k) for i in range(len(batch)) for k in range(len(self._specs)))
        calls = len(pending)
        budget = self.total_timeout_s
        if budget is None:
            budget = self.timeout_s * math.ceil(calls / self.num_workers) + _START_TIMEOUT_S
        deadline = time.monotonic() + budget
        while (pending or any(w.task for w in self._workers)) and time.monotonic() < deadline:
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    self._dispatch(w, pending, batch)
            self._collect(deadline, values, errors)
            self._expire(timeouts)
        for index, w in enumerate(self._workers):
            if w.task is not None:  # out of total time: count it and free the worker
                timeouts[w.task[2]] += 1
                self._replace(index)
        for _, k in pending:
            timeouts[k] += 1

    def _dispatch(self, w: _Worker, pending: collections.deque, batch: Sequence[dict[str, Any]]) -> None:
        i, k = pending.popleft()
        task_id = i * len(self._specs) + k
        try:
            w.conn.send(("call", task_id, k, batch[i]))
        except (BrokenPipeError, ConnectionResetError):
            pending.appendleft((i, k))  # the worker died while idle: retry the call on its replacement
            self._replace(self._workers.index(w))
            return
        w.task, w.since = (task_id, i, k), time.monotonic()

    def _wait_timeout(self, deadline: float) -> float:
        ends = [deadline]
        for w in self._workers:
            ends.append(w.since + (self.timeout_s if w.ready else _START_TIMEOUT_S))
        return max(0.0, min(ends) - time.monotonic())

    def _collect(self, deadline: float, values: np.ndarray, errors: np.ndarray) -> None:
        watched = {w.conn: index for index, w in enumerate(self._workers) if w.task or not w.ready}
        for conn in wait(list(watched), timeout=self._wait_timeout(deadline)):
            index = watched[conn]
            w = self._workers[index]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                if w.task is not None:
                    self._record_error(w.task[2], errors, f"worker died (exit code {w.proc.poll()})")
                self._replace(index)
                continue
            if message[0] == "ready":
                w.ready = True
            elif message[0] == "init_error":
                _raise_init_error(message[1])
            elif w.task is not None and message[1] == w.task[0]:
                _, _, value, kind, text = message
                _, i, k = w.task
                if kind is None:
                    values[k, i] = value
                else:
                    self._record_error(k, errors, text)
                w.task = None

    def _expire(self, timeouts: np.ndarray) -> None:
        now = time.monotonic()
        for index, w in enumerate(self._workers):
            if w.task is not None and now - w.since > self.timeout_s:
                k = w.task[2]
                timeouts[k] += 1
                if self.names[k] not in self.last_errors:
                    log.warning("reward %s timed out after %.1fs", self.names[k], self.timeout_s)
                self.last_errors[self.names[k]] = f"timed out after {self.timeout_s}s"
                self._replace(index)
            elif not w.ready and now - w.since > _START_TIMEOUT_S:
                self._replace(index)
