"""Trainer side of a weight sync: stage -> pause -> load through vLLM's RL endpoints -> verify -> resume.

One `WeightSyncer.push_weights(tensors, version, trainer_logprobs)` call (a snapshot's push, one level down;
`push_staged` for buckets every process of a job staged already, `weight_sync.staging.StagedBuckets`):

1. stage: `tensors` (e.g. `rljax.models.iter_hf_tensors(config, params)`) into bucket files
   (`staging.stage_buckets`), names and shapes checked against the served checkpoint, all before the
   pause, so generation waits only for the engine;
2. under the gate's exclusive side (no generate batch in flight): `/pause?mode=wait` (clears the prefix
   cache), `/start_weight_update`, `/update_weights` (one call for all pre-staged buckets, else one per
   bucket), `/finish_weight_update` with the version, `/resume`, on every replica in turn.

Transport (`SyncOptions.transport`, resolved in `transports.TRANSPORTS`): "shm", the worker maps the
bucket files (trainer and server on one host, `staging_dir` in /dev/shm); "tcp" or "zmq", the trainer
serves the same files from a bucket server on `tcp_host` (an address of the trainer that the servers can
reach) and one worker per node pulls each of them (`fanout`; servers on other hosts); `tcp_timeout_s`
bounds connect and every receive on both ends. Buckets that arrive with a `source` (sharded staging: each
trainer process serves its own, `weight_sync.served`) are pulled from it instead.
3. the canary (`rljax.weight_sync.canary`) on every replica, then the gate's version becomes `version`.

Any failure raises `WeightSyncError` (within the HTTP timeouts; a dead server fails at once). If the
engine may hold a mix of old and new weights, the replica stays paused and the gate is marked broken,
so generation refuses to run until a later full sync (after `restart` if the server died) succeeds.

Metrics: weight_sync/{seconds, bytes, gb_per_s, stage_seconds, pause_seconds, engine_seconds,
canary_logprob_max_abs_diff, canary_logprob_mean_abs_diff}.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import urlsplit

import numpy as np
import requests

from rljax.config import DEFAULTS
from rljax.config import canary_tolerance as config_canary_tolerance
from rljax.weight_sync import canary as canary_lib
from rljax.weight_sync import transports
from rljax.weight_sync.gate import PolicyGate
from rljax.weight_sync.staging import (
    DEFAULT_STAGING_DIR,
    Bucket,
    RunDir,
    StagedBuckets,
    stage_buckets,
    sweep_stale_run_dirs,
)

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A sync failed: a tensor was rejected, a server died or timed out, or the canary disagreed."""


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    # Fields the config sets default to the config's defaults (rljax.config.DEFAULTS, declared once there).
    bucket_bytes: int = DEFAULTS.rollout.weight_sync.bucket_mb * 2**20
    checksums: bool = DEFAULTS.rollout.weight_sync.checksums
    canary_tolerance: float = config_canary_tolerance(DEFAULTS)
    staging_dir: str = DEFAULT_STAGING_DIR
    control_timeout_s: float = 30.0  # pause, start, finish, resume, canary requests
    update_timeout_s: float = 120.0  # one bucket
    clear_prefix_cache: bool = True  # False only to show that the canary catches a stale cache
    repack_tied_lm_head: bool = True  # False only to show that the canary catches vLLM's tied-head bug
    transport: str = DEFAULTS.rollout.weight_sync.transport  # a name in `transports.TRANSPORTS`
    tcp_host: str = DEFAULTS.rollout.weight_sync.tcp_host  # tcp/zmq: the trainer address the servers reach
    tcp_timeout_s: float = DEFAULTS.rollout.weight_sync.tcp_timeout_s  # tcp/zmq: connect and each receive
    direct_load: bool = True  # False: every layer through vLLM's layerwise reload (vLLM's own path)

    def __post_init__(self):
        transports.get(self.transport)  # ValueError naming the valid ones
        for name in ("bucket_bytes", "control_timeout_s", "update_timeout_s", "tcp_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"weight sync: {name} must be > 0, got {getattr(self, name)!r}")


class WeightSyncer:
    """Pushes weights into one or more vLLM servers started with `--weight-transfer-config
    '{"backend": "shm"}'` (same host: the bucket files live in `staging_dir`)."""

    def __init__(
        self,
        urls: list[str],
        model: str,
        *,
        spec: dict | None,
        canary: canary_lib.CanarySpec,
        gate: PolicyGate,
        options: SyncOptions = SyncOptions(),
        headers: dict[str, str] | None = None,
    ):
        self.urls, self.model, self.spec, self.canary = list(urls), model, spec, canary
        self.gate, self.options = gate, options
        self.headers = dict(headers or {})  # on every request: the servers' bearer token (rljax.rollout.auth)
        self._initialized: dict[str, dict] = {}
        sweep_stale_run_dirs(options.staging_dir)  # leftovers of SIGKILLed trainers would pin RAM in /dev/shm
        self._run_dir: RunDir | None = None  # this trainer's private bucket directory, made at the first sync

    def _post(
        self,
        url: str,
        path: str,
        body: dict | None = None,
        *,
        timeout_s: float | None = None,
        params: dict | None = None,
    ) -> dict:
        try:
            r = requests.post(
                url + path,
                json=body,
                params=params,
                headers=self.headers,
                timeout=(5.0, timeout_s or self.options.control_timeout_s),
            )
        except requests.RequestException as e:
            raise WeightSyncError(f"{path} on {url} failed: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise WeightSyncError(f"{path} on {url} failed: HTTP {r.status_code}: {r.text[:1000]}")
        return r.json()

    def reset(self) -> None:
        """Forget per-server state (call after a server restart)."""
        self._initialized.clear()

    def _init(self, url: str) -> None:
        info = {
            "repack_tied_lm_head": self.options.repack_tied_lm_head,
            "direct_load": self.options.direct_load,
        }
        if self._initialized.get(url) != info:
            # The first call into a (re)started server's workers: slower than the other control calls.
            body, timeout_s = {"init_info": info}, self.options.update_timeout_s
            self._post(url, "/init_weight_transfer_engine", body, timeout_s=timeout_s)
            self._initialized[url] = info

    def _start_update(self, url: str) -> None:
        """`/start_weight_update`; a session left open by a trainer that died mid-sync (the server refuses a
        second one) is aborted first: the full push that follows overwrites whatever it had loaded, and
        the canary checks the result."""
        try:
            self._post(url, "/start_weight_update")
            return
        except WeightSyncError as e:
            if "already active" not in str(e):
                raise
        log.warning("%s: aborting a weight update left open by an earlier trainer (killed mid-sync?)", url)
        try:  # fails on purpose: a failing update_weights is how vLLM's worker ends a session
            self._post(url, "/update_weights", {"update_info": {"abort": True}})
        except WeightSyncError as e:
            if "aborted by the trainer" not in str(e):
                raise WeightSyncError(f"{url}: could not abort the open weight update: {e}") from e
        self._post(url, "/start_weight_update")

    def server_version(self, url: str) -> str | None:
        """The weight version a server reports (`/weight_info`)."""
        try:
            r = requests.get(
                url + "/weight_info", headers=self.headers, timeout=self.options.control_timeout_s
            )
            r.raise_for_status()
        except requests.RequestException as e:
            raise WeightSyncError(f"/weight_info on {url} failed: {e}") from e
        return r.json()["weight_version"]

    def close(self) -> None:
        """Removes this trainer's bucket directory (a SIGKILLed trainer's goes with its reaper)."""
        if self._run_dir is not None:
            self._run_dir.close()
            self._run_dir = None

    def _stage(self, tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[Bucket]:
        o = self.options
        if self._run_dir is None:
            self._run_dir = RunDir(o.staging_dir)
        return stage_buckets(
            tensors,
            bucket_bytes=o.bucket_bytes,
            directory=self._run_dir.path,
            checksums=o.checksums,
            spec=self.spec,
        )

    def push_weights(
        self,
        tensors: Iterable[tuple[str, np.ndarray]],
        version: int,
        trainer_logprobs: canary_lib.TrainerLogprobs,
    ) -> dict[str, float]:
        """Stages `tensors` (host arrays, `(hf_name, array)` items) and pushes them to every server as policy
        `version`, verifies, resumes; returns metrics."""
        return self._push_buckets(lambda: self._stage(tensors), version, trainer_logprobs, remote_sent=None)

    def push_staged(
        self, staged: StagedBuckets, version: int, trainer_logprobs: canary_lib.TrainerLogprobs
    ) -> dict[str, float]:
        """Pushes buckets that every process of a multi-process job staged already (sharded staging, their
        files left to the processes that wrote them); those with a `source` are served by their process
        (`staged.wait_sent`). Otherwise as `push_weights`."""
        return self._push_buckets(lambda: staged.buckets, version, trainer_logprobs, staged.wait_sent)

    def _push_buckets(
        self, stage: Callable[[], Iterable[Bucket]], version: int, trainer_logprobs, remote_sent
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        staged: list[Bucket] = []
        try:
            staged = self._checked(lambda: list(stage()))
            self._check_complete(staged)
            t_staged = time.perf_counter()
            with self.gate.exclusive(self.options.update_timeout_s):
                pause_s, engine_s, nbytes, sent = self._push(staged, version, remote_sent)
                diffs = [
                    self._checked(
                        lambda u=u: canary_lib.check_canary(
                            u,
                            self.model,
                            self.canary,
                            trainer_logprobs,
                            tolerance=self.options.canary_tolerance,
                            timeout_s=self.options.control_timeout_s,
                            headers=self.headers,
                        )
                    )
                    for u in self.urls
                ]
                self.gate.version, self.gate.broken = version, None
        finally:
            for b in staged:
                b.unlink()
        seconds = time.perf_counter() - t0
        return {
            "weight_sync/seconds": seconds,
            "weight_sync/bytes": float(nbytes),
            "weight_sync/gb_per_s": nbytes / 1e9 / max(seconds, 1e-9),
            "weight_sync/stage_seconds": t_staged - t0,
            "weight_sync/pause_seconds": pause_s,
            "weight_sync/engine_seconds": engine_s,
            "weight_sync/canary_logprob_max_abs_diff": max(d[0] for d in diffs),
            "weight_sync/canary_logprob_mean_abs_diff": float(np.mean([d[1] for d in diffs])),
        } | ({} if sent is None else {"weight_sync/sent_before_pause": float(sent)})

    def _check_complete(self, staged: list[Bucket]) -> None:
        """Raises naming the first checkpoint tensor that was not staged."""
        if self.spec is None:
            return
        missing = sorted(set(self.spec) - {e.name for b in staged for e in b.entries})
        if missing:
            raise WeightSyncError(
                f"weight sync: tensor {missing[0]!r} was not pushed ({len(missing)} missing)"
            )

    @staticmethod
    def _checked(fn):
        try:
            return fn()
        except (ValueError, OSError, canary_lib.CanaryError) as e:
            raise WeightSyncError(str(e)) from e

    def _push(
        self, buckets: list[Bucket], version: int, remote_sent=None
    ) -> tuple[float, float, int, bool | None]:
        """Pause, load every bucket into every server, finish, resume. Returns (pause s, engine s, bytes,
        whether every streamed bucket was out before the pause: None when none was streamed).
        Buckets with a `source` are served by the trainer process that staged them (`remote_sent`: its
        `StagedBuckets.wait_sent`); this process serves the others itself (tcp/zmq) or the workers map
        their files (shm)."""
        for url in self.urls:
            self._init(url)
        own = any(b.source is None for b in buckets) and transports.streams(self.options.transport)
        server = None
        if own:
            server = transports.serve(
                self.options.transport, self.options.tcp_host, self.options.tcp_timeout_s
            )
        try:
            return self._push_via(buckets, version, server, remote_sent)
        finally:
            if server is not None:
                server.close()

    def _push_via(
        self, buckets: list[Bucket], version: int, server, remote_sent=None
    ) -> tuple[float, float, int, bool | None]:
        o = self.options

        def info(bucket: Bucket) -> dict:  # the staged files live until the sync ends: the worker maps them
            d = bucket.update_info(copy=False)
            if bucket.source is not None:
                d["source"] = bucket.source
            elif server is not None:
                server.add(bucket.index, bucket.path)
                d["source"] = server.address(o.tcp_timeout_s)
            return d

        # tcp/zmq: the workers receive every bucket in the background before the pause.
        prefetch = bool(buckets) and (server is not None or any(b.source is not None for b in buckets))
        sent = self._send_ahead(buckets, info, server, remote_sent) if prefetch else None
        t_pause = time.perf_counter()
        for url in self.urls:
            self._post(
                url, "/pause", params={"mode": "wait", "clear_cache": str(o.clear_prefix_cache).lower()}
            )
        self.gate.broken = "a weight sync was interrupted; the servers may hold mixed weights"
        engine_s, nbytes = self._load_paused(buckets, info, version, started=prefetch)
        for url in self.urls:
            self._post(url, "/resume")
        return time.perf_counter() - t_pause, engine_s, nbytes, sent

    def _send_ahead(self, buckets: list[Bucket], info: Callable, server, remote_sent) -> bool:
        """Starts every server's background receive of `buckets` and waits until the bytes are out (one
        receiver per node: each bucket goes once to each host among the servers' urls): this process's
        own from `server`, the others' by `remote_sent` (the processes that staged them serve them).
        False when a stream failed or timed out (the load call then reports what failed)."""
        self._prefetch([info(b) for b in buckets])
        mine = [b for b in buckets if b.source is None] if server is not None else []
        copies, timeout_s = _hosts(self.urls), self.options.tcp_timeout_s * len(buckets)
        sent = not mine or server.wait_sent(len(mine) * copies, timeout_s)
        if len(mine) < len(buckets):
            sent = (remote_sent is not None and remote_sent(copies, timeout_s)) and sent
        return sent

    def _load_paused(
        self, buckets: list[Bucket], info: Callable, version: int, started: bool
    ) -> tuple[float, int]:
        """On the paused servers: start the update (unless `_send_ahead` did), one load call for all the
        buckets, finish it as `version`. (engine seconds, bytes). On any failure every server is finalized
        (no layer stays on the meta device) and stays paused: the gate says the sync broke."""
        o, engine_s, nbytes = self.options, 0.0, 0
        try:
            for url in self.urls if not started else ():
                self._start_update(url)
            if buckets:  # one load call for all of them
                t = time.perf_counter()
                infos = [info(b) for b in buckets]
                body = {"update_info": infos[0] if len(infos) == 1 else {"buckets": infos}}
                for url in self.urls:
                    self._post(url, "/update_weights", body, timeout_s=o.update_timeout_s * len(buckets))
                engine_s += time.perf_counter() - t
                nbytes += sum(b.nbytes for b in buckets)
            t = time.perf_counter()
            for url in self.urls:
                body = {"weight_version": str(version)}
                self._post(url, "/finish_weight_update", body, timeout_s=o.update_timeout_s)
            engine_s += time.perf_counter() - t
        except BaseException:
            for url in self.urls:
                try:
                    self._post(url, "/finish_weight_update", timeout_s=o.control_timeout_s)
                except WeightSyncError:
                    pass
            raise
        return engine_s, nbytes

    def _prefetch(self, infos: list[dict]) -> None:
        """`/start_weight_update` and a background receive of `infos` on every server (not paused)."""
        started = []
        try:
            for url in self.urls:
                self._start_update(url)
                started.append(url)
                body = {"update_info": {"buckets": infos, "prefetch": True}}
                self._post(url, "/update_weights", body)
        except BaseException:
            for url in started:  # nothing was loaded: ends the session, the old weights serve on
                try:
                    self._post(url, "/finish_weight_update", timeout_s=self.options.control_timeout_s)
                except WeightSyncError:
                    pass
            raise


def _hosts(urls: list[str]) -> int:
    """How many hosts the servers at `urls` run on (streamed buckets land once per host)."""
    return len({urlsplit(u).hostname for u in urls}) or 1
