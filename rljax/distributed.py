"""Multi-process helpers below the host loop and start-up (one JAX process per GPU or host, no Ray): a leaf
module (jax and numpy only), so `rljax.runtime` can start the peer watchdog without importing the loop.

Process 0 (the leader) owns the rollout engine, the reward workers, evaluation and the writers; every
process runs the sharded update. The leader's batch reaches the others with `broadcast_tree`, and the
weights pushed to the engine are staged by every process, each writing only the shards it owns, and
pushed by the leader (`rljax.loop.sharded_sync`; collectives: every process must call these at the same
point).
In a single-process run all of these are cheap no-ops.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_tree(tree: Any | None, like: Any | None = None) -> Any:
    """The leader's pytree of numpy arrays on every process. Non-leaders pass `None` and a `like` tree
    with the structure (shapes may differ: they are broadcast first)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    template = tree if is_leader() else like
    leaves, treedef = jax.tree.flatten(template)
    ndims = [np.ndim(x) for x in leaves]
    shapes = np.zeros((len(leaves), max(ndims + [1])), np.int64)
    if is_leader():
        for i, x in enumerate(leaves):
            shapes[i, : np.ndim(x)] = np.shape(x)
    shapes = np.asarray(multihost_utils.broadcast_one_to_all(shapes))
    local = [
        np.asarray(x) if is_leader() else np.zeros(tuple(shapes[i, : ndims[i]]), np.asarray(x).dtype)
        for i, x in enumerate(leaves)
    ]
    out = multihost_utils.broadcast_one_to_all(local)
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in out])


def cast_params(params: Any, dtype: Any = None) -> Any:
    """Floating leaves of `params` cast to `dtype` on their own devices, shardings kept (an elementwise
    jit: no collective); `params` itself when `dtype` is None or every leaf already has it."""
    floats = [x for x in jax.tree.leaves(params) if _floating(x)]
    if dtype is None or all(x.dtype == jax.numpy.dtype(dtype) for x in floats):
        return params
    return _cast(params, jax.numpy.dtype(dtype))


def _floating(x: Any) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


@functools.partial(jax.jit, static_argnums=1)
def _cast(params: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) else x, params)


def to_host(x: Any) -> np.ndarray:
    """A (possibly multi-process, sharded) array as numpy on every process."""
    if jax.process_count() == 1 or getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def barrier(name: str) -> None:
    """All processes reach this point before any goes on (e.g. before exiting for a requeue)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


PEER_LOST_EXIT_CODE = 3  # a peer process died or the coordinator went away: restart the whole job


class PeerWatchdog:
    """A daemon thread on every process of a multi-process job: ends this process promptly when a peer dies.

    JAX's own failure detection takes minutes (heartbeat timeout, then a shutdown barrier) and a survivor
    blocked in a collective waits that long. Each process bumps a counter under `rljax/alive/<i>` in the
    jax.distributed key-value store every `interval_s`; when a peer's counter has not moved for
    `timeout_s` (it died or hangs), or the store (hosted by process 0) cannot be reached for `timeout_s`,
    the watchdog prints which process was lost and calls `os._exit(PEER_LOST_EXIT_CODE)`: the job has
    to be restarted as a whole, and resumes from its latest checkpoint.
    """

    def __init__(
        self,
        client,
        process_id: int,
        num_processes: int,
        *,
        interval_s: float,
        timeout_s: float,
        active: Callable[[], bool] = lambda: True,
    ):
        import threading

        self._client, self._me, self._n, self._active = client, process_id, num_processes, active
        self._interval, self._timeout = interval_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rljax-peer-watchdog", daemon=True)

    def start(self) -> PeerWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:

        now = time.monotonic()
        seen = {p: (None, now) for p in range(self._n) if p != self._me}  # peer -> (last value, when)
        reached, beat = now, 0
        while not self._stop.wait(self._interval):
            if not self._active():  # jax.distributed was shut down (the normal end of the job)
                return
            now = time.monotonic()
            try:
                beat += 1
                self._client.key_value_set(f"rljax/alive/{self._me}", str(beat), allow_overwrite=True)
                values = {p: _try_get(self._client, f"rljax/alive/{p}") for p in seen}
                reached = now
            except Exception as e:  # noqa: BLE001 (the store itself is gone: the coordinator died)
                if now - reached > self._timeout:
                    self._exit(f"lost the JAX coordinator (process 0) for {now - reached:.0f} s ({e})")
                continue
            for p, value in values.items():
                if value is not None and value != seen[p][0]:
                    seen[p] = (value, now)
                elif now - seen[p][1] > self._timeout:
                    self._exit(f"process {p} of {self._n} sent no heartbeat for {now - seen[p][1]:.0f} s")

    def _exit(self, why: str) -> None:
        import os
        import sys

        if self._stop.is_set():
            return
        print(
            f"rljax: process {self._me}: {why}; a dead process ends the whole multi-process job: "
            f"exiting ({PEER_LOST_EXIT_CODE}) so it can be restarted and resume from its latest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(PEER_LOST_EXIT_CODE)


def _try_get(client, key: str) -> str | None:
    """The value under `key`, or None if no value was set yet (other errors propagate)."""
    try:
        return client.key_value_try_get(key)
    except Exception as e:
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return None
        raise


def start_peer_watchdog(interval_s: float = 1.0, timeout_s: float = 30.0) -> PeerWatchdog | None:
    """Starts the `PeerWatchdog` in a multi-process job (after `jax.distributed.initialize`); else None."""
    if jax.process_count() == 1:
        return None
    client = kv_client()
    if client is None:
        return None
    watchdog = PeerWatchdog(
        client,
        jax.process_index(),
        jax.process_count(),
        interval_s=interval_s,
        timeout_s=timeout_s,
        active=lambda: kv_client() is client,
    )
    return watchdog.start()


def kv_client():
    """The jax.distributed key-value store's client of this process (None before
    `jax.distributed.initialize` or after its shutdown): the sharded push's metadata, the canary's host
    check and the peer watchdog's heartbeats go through it. JAX has no public handle to it
    (`jax.distributed` exposes initialize, is_initialized and shutdown only; multihost_utils uses it
    internally), so this is rljax's one import of `jax._src`: an upgrade that moves it breaks here only."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client
