"""The snapshot of a multi-process job's weights: every process stages (and with tcp/zmq serves) the shards it
owns; the leader pushes them all in one update. Collectives: every process calls `stage_sharded` at the same
point, and every process ends the push at the same barrier (`with snapshot:`, `PushEnd`).

Nothing is gathered: each element of the model is staged once across the job, by the process that owns
it, and its bytes go from that process's host to each rollout node once (`weight_sync.served`). The
canary's trainer side is the sharded training path itself, a collective: its question is fixed
(`weight_sync.canary`, shared once from the leader's engine, `share_question`), so every process computes
the answer when the snapshot is taken, and the leader's push needs nothing from the others but the
barrier after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rljax.distributed import barrier, cast_params, is_leader, kv_client
from rljax.loop.snapshots import CanaryAnswers, StagedSnapshot, spec_key
from rljax.weight_sync.canary import CanarySpec
from rljax.weight_sync.staging import StagedBuckets

BUCKETS_PER_PROCESS = 1 << 20  # process p numbers its buckets from p * this: one update lists them all
_SHARE_TIMEOUT_MS = 600_000


@dataclasses.dataclass
class PushState:
    """One run's sharded-push state on this process (an object, not module globals: two runs in one
    process, or a test, each have their own). `pushes`: pushes so far, the same count on every process
    (each push gets a fresh key-value prefix); `kept`: this process's buckets (or served pushes) of the
    last push, kept for a recovery's re-push until the next push succeeds."""

    pushes: int = 0
    kept: list = dataclasses.field(default_factory=list)

    def next_key(self) -> str:
        self.pushes += 1
        return f"rljax/ws/{self.pushes}"

    def retire(self, mine: list, keep: bool) -> None:
        """Unlinks this push's buckets, or (keep) the previous push's, keeping this one's."""
        if keep:
            gone, self.kept = self.kept, list(mine)
        else:
            gone = list(mine)
        for b in gone:
            b.unlink()

    def release(self) -> None:
        """Removes the kept push's buckets (and stops their servers): the run is over."""
        self.retire([], keep=True)


@dataclasses.dataclass
class _Staged:
    """This process's share of one push: its bucket descriptors' owners (`mine`), what to retire at the
    end (`units`: the buckets, or the served push holding them), its server, a staging error, seconds."""

    mine: list
    units: list
    served: Any = None
    error: Exception | None = None
    seconds: float = 0.0


def stage_sharded(
    params,
    *,
    state: PushState,
    model_config,
    dtype,
    stager,
    scorer,
    question: CanarySpec,
    keep: bool = False,
    serve: Callable | None = None,
) -> StagedSnapshot:
    """The snapshot of a multi-process job's params; every process calls it at the same point.

    1. the canary's trainer side: `scorer.dispatch(question)` (the sharded log-prob function of the
       training path, a collective) starts on every process before anything is staged;
    2. each process casts `params` to the serving `dtype` on device (`cast_params`: elementwise, no
       collective) and stages only the shards it owns (`rljax.models.iter_owned_hf_slices`: replica 0
       of every shard, mapped onto slices of the HF tensors) into its own bucket files (`stager`, a
       `weight_sync.staging.ShardStager`): each element once across the job, nothing all-gathered;
       with `serve` (tcp/zmq: `buckets -> weight_sync.served.ServedBuckets`) it also serves them from
       its own bucket server, so every bucket carries the address it is pulled from;
    3. the bucket descriptors (metadata only) reach the leader through the jax.distributed key-value
       store; the canary's answer comes back on every process (the collective's end);
    4. the leader's snapshot lists every bucket (`StagedBuckets`, one update; the worker assembles the
       slices); before the servers pause, its push waits until every process has sent its buckets
       (`StagedBuckets.wait_sent`, through the key-value store). The other processes' snapshots push
       nothing: their `with snapshot:` waits at the "push over" barrier (`PushEnd`), then each process
       removes its own bucket files (and stops its server); with `keep` (a run that may recover: the
       leader re-pushes the last version's buckets alone, no collective) a push's files and server stay
       in `state` until the next push succeeds.
    A process that failed to stage makes the leader raise (after the barrier); it raises its own error
    at its barrier. The leader's snapshot adds `weight_sync/staged_bytes_{max,min}_process` (tensor bytes
    one process staged) and `weight_sync/shard_stage_seconds` to its push's metrics.
    """
    key = state.next_key()
    answer = scorer.dispatch(question.prompt_ids, question.completion_ids)
    own = _stage_own(params, model_config, dtype, stager, serve, key)
    try:
        shared, error = _share(key, [b.descriptor() for b in own.mine], own.error), None
    except Exception as e:  # noqa: BLE001 - raised after the canary's collective, which every process joins
        shared, error = None, e
    answers = CanaryAnswers({spec_key(question): _computed(answer())})
    wait = _SentWait(key, own.served) if is_leader() and serve is not None else None
    end = PushEnd(key, state, own, keep, wait)
    if not is_leader():
        return StagedSnapshot(None, answers, {}, end)
    if error is not None:
        end(False)
        raise error
    buckets, per_process = shared
    metrics = {
        "weight_sync/staged_bytes_max_process": float(max(per_process)),
        "weight_sync/staged_bytes_min_process": float(min(per_process)),
        "weight_sync/shard_stage_seconds": own.seconds,  # the leader's own cast + copy + write
    }
    return StagedSnapshot(StagedBuckets(buckets, per_process, wait), answers, metrics, end)


def _computed(value: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: value


@dataclasses.dataclass
class PushEnd:
    """`self(pushed)`: the end of one sharded push on this process, once. The leader's `_SentWait` is
    released (followers that were never asked stop waiting), every process meets at the "push over"
    barrier, then this process's buckets are retired (kept for a recovery when `keep` and the push
    went through here). A process that failed to stage raises its error after the barrier."""

    key: str
    state: PushState
    own: _Staged
    keep: bool
    wait: _SentWait | None = None
    done: bool = False

    def __call__(self, pushed: bool) -> None:
        if self.done:
            return
        self.done = True
        try:
            if self.wait is not None:
                self.wait.release()
            barrier(f"{self.key}/pushed")
        finally:
            ok = pushed and self.own.error is None
            self.state.retire(self.own.units, keep=self.keep and ok)
        if self.own.error is not None and not is_leader():
            raise self.own.error


def _stage_own(params, model_config, dtype, stager, serve: Callable | None, key: str) -> _Staged:
    """Step 2 of `stage_sharded` on this process: cast, stage (and serve) the shards it owns. A failure is
    kept in the result (reported to the leader, raised after the collectives), not raised here."""
    from rljax import models

    own, t0 = _Staged([], []), time.perf_counter()
    try:
        items = models.iter_owned_hf_slices(model_config, cast_params(params, dtype), dtype)
        own.mine = own.units = stager.stage(items, first_index=jax.process_index() * BUCKETS_PER_PROCESS)
        if serve is not None:
            own.served = serve(own.mine)
            own.mine, own.units = own.served.buckets, [own.served]
            if not is_leader():
                _report_sent(key, own.served)
    except Exception as e:  # noqa: BLE001 - reported to the leader, raised after the collectives
        own.error = e
    own.seconds = time.perf_counter() - t0
    return own


def _report_sent(key: str, served) -> None:
    """A follower's side of `_SentWait`: once the leader says how many copies each bucket goes out (one
    per rollout host; 0: it does not wait), waits for this process's server to send them and reports
    whether it did. A daemon thread: the process itself goes on into the push's collectives."""
    me = jax.process_index()

    def run() -> None:
        with contextlib.suppress(Exception):  # the leader gone or not waiting: nobody reads the report
            client = kv_client()
            copies = int(client.blocking_key_value_get(f"{key}/copies", _SHARE_TIMEOUT_MS))
            ok = copies == 0 or served.wait_sent(copies, _SHARE_TIMEOUT_MS / 1000)
            client.key_value_set(f"{key}/sent/{me}", "1" if ok else "0")

    threading.Thread(target=run, name="rljax-ws-sent", daemon=True).start()


class _SentWait:
    """The leader's `StagedBuckets.wait_sent(copies, timeout_s)`: publishes `copies`, waits for its own
    server, then for every other process's report (`_report_sent`). `release()` (at the push's end)
    tells the followers' threads to stop if the leader never waited (e.g. a failure before the load)."""

    def __init__(self, key: str, served):
        self._key, self._served, self._asked = key, served, False

    def __call__(self, copies: int, timeout_s: float) -> bool:
        if self._asked:  # the same push again (a recovery after a server restart): the others reported
            return False  # already, so nobody would answer; the load call waits for the bytes instead
        client, self._asked = kv_client(), True
        client.key_value_set(f"{self._key}/copies", str(int(copies)), allow_overwrite=True)
        ok = self._served is None or self._served.wait_sent(copies, timeout_s)
        for p in range(1, jax.process_count()):
            try:
                ok &= client.blocking_key_value_get(f"{self._key}/sent/{p}", int(timeout_s * 1000)) == "1"
                client.key_value_delete(f"{self._key}/sent/{p}")
            except Exception:  # noqa: BLE001 - not sent in time: the load call reports what failed
                ok = False
        return ok

    def release(self) -> None:
        client = kv_client()
        if not self._asked:
            with contextlib.suppress(Exception):
                client.key_value_set(f"{self._key}/copies", "0", allow_overwrite=True)
        prefix, number = self._key.rsplit("/", 1)
        with contextlib.suppress(Exception):  # the previous push's: its followers read it while it ran
            client.key_value_delete(f"{prefix}/{int(number) - 1}/copies")


def _share(key: str, descriptors: list[dict], error: BaseException | None):
    """Leader: every process's buckets `(list[Bucket], bytes per process)`; raises if a process failed to
    stage. Others: publish theirs (or their error) and return None."""
    from rljax.weight_sync.staging import Bucket

    client = kv_client()
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


def single_host() -> bool:
    """True when every process of the job runs on this host (hostnames compared through the
    jax.distributed key-value store; every process calls it once, at start-up). With `shm` the servers
    map each process's bucket files, which they can only on one host; across trainer hosts every
    process serves its own buckets (tcp/zmq)."""
    import socket

    if jax.process_count() == 1:
        return True
    client = kv_client()
    key = f"rljax/host/{jax.process_index()}"
    client.key_value_set(key, json.dumps(socket.gethostname()), allow_overwrite=True)
    names = {
        client.blocking_key_value_get(f"rljax/host/{p}", _SHARE_TIMEOUT_MS)
        for p in range(jax.process_count())
    }
    return len(names) == 1


def share_question(spec: CanarySpec | None) -> CanarySpec:
    """The canary's question on every process: the leader's engine made it (`spec`; None elsewhere), the
    others read it from the key-value store. Every process calls it once, at start-up."""
    if jax.process_count() == 1:
        return spec
    client = kv_client()
    if is_leader():
        tokens = [list(map(int, spec.prompt_ids)), list(map(int, spec.completion_ids))]
        client.key_value_set("rljax/canary", json.dumps(tokens), allow_overwrite=True)
        return spec
    prompt, completion = json.loads(client.blocking_key_value_get("rljax/canary", _SHARE_TIMEOUT_MS))
    return CanarySpec(tuple(prompt), tuple(completion))
