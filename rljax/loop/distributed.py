"""Multi-process helpers for the host loop (one JAX process per GPU or host, no Ray).

Process 0 (the leader) owns the rollout engine, the reward workers, evaluation and the writers; every
process runs the sharded update. The leader's batch reaches the others with `broadcast_tree`, and the
weights pushed to the engine are staged by every process, each writing only the shards it owns, and
pushed by the leader (`push_sharded`; collectives: every process must call these at the same point).
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


def host_params(params: Any, dtype: Any = None) -> Any:
    """Params (cast on device to the serving `dtype`, default: as they are) as fully addressable host
    values: the arrays themselves in one process (converted lazily, one tensor at a time, by the weight
    sync), a gathered numpy copy per process otherwise (multi-process: only the copy a later recovery
    re-pushes when `rollout.vllm.max_restarts > 0`; the sync itself is `push_sharded`, no gather)."""
    params = cast_params(params, dtype)
    if jax.process_count() == 1:
        return params
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(params, tiled=True)


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
        import time

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
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        return None
    watchdog = PeerWatchdog(
        client,
        jax.process_index(),
        jax.process_count(),
        interval_s=interval_s,
        timeout_s=timeout_s,
        active=lambda: jax_distributed.global_state.client is client,
    )
    return watchdog.start()


# Sharded weight sync (multi-process): every process stages the shards it owns; the leader pushes them all.
BUCKETS_PER_PROCESS = 1 << 20  # process p numbers its buckets from p * this: one update lists them all
_SHARE_TIMEOUT_MS = 600_000


def push_sharded(
    params, *, model_config, dtype, stager, canary: Callable, push: Callable | None, keep: bool = False
) -> dict:
    """One weight push of a multi-process job; every process calls it at the same point.

    1. each process casts `params` to the serving `dtype` on device (`cast_params`: elementwise, no
       collective) and stages only the shards it owns (`rljax.models.iter_owned_hf_slices`: replica 0
       of every shard, mapped onto slices of the HF tensors) into its own bucket files (`stager`, a
       `weight_sync.staging.ShardStager`): each element once across the job, nothing all-gathered;
    2. the bucket descriptors (metadata only) reach the leader through the jax.distributed key-value
       store; the leader calls `push(StagedBuckets, trainer_logprobs)` (one update listing every bucket;
       the worker assembles the slices);
    3. the canary's trainer side is `canary(params)`, the sharded log-prob function of the training path,
       a collective: the leader broadcasts each pair of token lists it scores and the other processes
       follow (`_follow_canary`) until the leader says the push is over (also on failure);
    4. every process removes its own bucket files; with `keep` (a run that may recover: the leader
       re-pushes the last version's files alone, no collective) a push's files stay until the next push
       succeeds, so each process holds one version's share of the model in its staging directory.
    Returns the leader's metrics (plus `weight_sync/staged_bytes_{max,min}_process`: tensor bytes one
    process staged), {} elsewhere.
    """
    from rljax import models
    from rljax.weight_sync.staging import StagedBuckets

    me = jax.process_index()
    _SYNCS[0] += 1
    key = f"rljax/ws/{_SYNCS[0]}"
    mine, error, t0 = [], None, time.perf_counter()
    try:
        items = models.iter_owned_hf_slices(model_config, cast_params(params, dtype), dtype)
        mine = stager.stage(items, first_index=me * BUCKETS_PER_PROCESS)
    except Exception as e:  # noqa: BLE001 - reported to the leader, raised below after the collectives
        error = e
    stage_s = time.perf_counter() - t0
    fn = canary(params)
    pushed, result = False, {}
    try:
        try:
            shared = _share(key, [b.descriptor() for b in mine], error)
        except Exception as e:  # noqa: BLE001 - the leader raises it inside the canary collective
            shared = e

        def lead(logprobs) -> dict:  # the leader's push; the others follow its canary requests
            if isinstance(shared, Exception):
                raise shared
            buckets, per_process = shared
            metrics = push(StagedBuckets(buckets, per_process), logprobs) if push else {}
            return metrics | {
                "weight_sync/staged_bytes_max_process": float(max(per_process)),
                "weight_sync/staged_bytes_min_process": float(min(per_process)),
                "weight_sync/shard_stage_seconds": stage_s,  # the leader's own cast + copy + write
            }

        result = canary_collective(fn, lead if is_leader() else None)
        pushed = error is None
    finally:
        _retire(mine, keep=keep and pushed)
        if error is not None and not is_leader():
            raise error
    return result


_KEPT: list = []  # this process's buckets of the last push, kept for a recovery's re-push (`keep`)


def _retire(mine: list, keep: bool) -> None:
    """Unlinks this push's buckets, or (keep) the previous push's, keeping this one's."""
    if keep:
        gone, _KEPT[:] = list(_KEPT), list(mine)
    else:
        gone = list(mine)
    for b in gone:
        b.unlink()


_SYNCS = [0]  # pushes so far (the same on every process): a fresh key-value prefix per push


def _share(key: str, descriptors: list[dict], error: BaseException | None):
    """Leader: every process's buckets `(list[Bucket], bytes per process)`; raises if a process failed to
    stage. Others: publish theirs (or their error) and return None."""
    import json

    from jax._src import distributed as jax_distributed

    from rljax.weight_sync.staging import Bucket

    client = jax_distributed.global_state.client
    value = json.dumps(
        {"error": None if error is None else f"{type(error).__name__}: {error}", "buckets": descriptors}
    )
    if not is_leader():
        client.key_value_set(f"{key}/{jax.process_index()}", value)
        return None
    per_process, buckets, errors = [], [], []
    for p in range(jax.process_count()):
        d = json.loads(value if p == 0 else client.blocking_key_value_get(f"{key}/{p}", _SHARE_TIMEOUT_MS))
        if p:
            client.key_value_delete(f"{key}/{p}")
        if d["error"]:
            errors.append(f"process {p}: {d['error']}")
        buckets += [Bucket.from_descriptor(b) for b in d["buckets"]]
        per_process.append(
            sum(e.nbytes for b in buckets[len(buckets) - len(d["buckets"]) :] for e in b.entries)
        )
    if errors:
        from rljax.weight_sync import WeightSyncError

        raise WeightSyncError("weight sync: staging failed on " + "; ".join(errors))
    return buckets, tuple(per_process)


_CANARY_LIKE = {
    "more": np.zeros(1, np.int32),
    "prompt": np.zeros(1, np.int32),
    "completion": np.zeros(1, np.int32),
}


def _broadcast_canary(tokens: tuple | None) -> dict:
    """The leader's canary request (`(prompt_ids, completion_ids)`, or None: the push is over) on every
    process (a collective)."""
    tree = None
    if is_leader():
        prompt, completion = tokens if tokens is not None else ([0], [0])
        tree = {
            "more": np.asarray([tokens is not None], np.int32),
            "prompt": np.asarray(prompt, np.int32),
            "completion": np.asarray(completion, np.int32),
        }
    return broadcast_tree(tree, _CANARY_LIKE)


def canary_collective(fn: Callable, lead: Callable[[Callable], dict] | None) -> dict:
    """The canary's trainer side as a collective: `fn(prompt_ids, completion_ids)` (the sharded training
    path) needs every process. The leader returns `lead(logprobs)`, where each `logprobs` call is broadcast
    first so the others join it (`_follow_canary`) until the leader says the push is over (also on
    failure); the others (`lead` None) return {}."""
    if jax.process_count() == 1:
        return lead(fn) if lead is not None else {}
    if lead is None:
        _follow_canary(fn)
        return {}
    try:
        return lead(_leading_canary(fn))
    finally:
        _broadcast_canary(None)


def _leading_canary(fn: Callable) -> Callable:
    def logprobs(prompt_ids, completion_ids):
        _broadcast_canary((list(prompt_ids), list(completion_ids)))
        return fn(prompt_ids, completion_ids)

    return logprobs


def _follow_canary(fn: Callable) -> None:
    while True:
        req = _broadcast_canary(None)
        if not int(req["more"][0]):
            return
        fn(req["prompt"].tolist(), req["completion"].tolist())


def single_host() -> bool:
    """True when every process of the job runs on this host (hostnames compared through the
    jax.distributed key-value store; every process calls it once, at start-up). Sharded staging writes
    each process's buckets to its own host, so the leader can hand them all to the engine only then;
    across trainer hosts the sync gathers (`host_params`) until a bucket server runs on every host."""
    import json
    import socket

    if jax.process_count() == 1:
        return True
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    key = f"rljax/host/{jax.process_index()}"
    client.key_value_set(key, json.dumps(socket.gethostname()), allow_overwrite=True)
    names = {
        client.blocking_key_value_get(f"rljax/host/{p}", _SHARE_TIMEOUT_MS)
        for p in range(jax.process_count())
    }
    return len(names) == 1
