"""`RolloutEngine`: the one trainer-side boundary to vLLM: servers, generation, the weight push, recovery.

    engine = RolloutEngine.launch(model_path, workdir, weights=source)   # or RolloutEngine.connect(urls, ...)
    completions = engine.generate(prompt_ids, n=8, temperature=1.0, max_tokens=64, stop_token_ids=[eos])
    metrics = engine.push_weights(params, version)                        # weight_sync/* and recovery/*
    engine.start_push(params, version, on_served=...)  # async mode: delivered off this thread
    engine.close()

It composes the owned servers' lifecycle (`VLLMServer`, or servers started elsewhere), the rollout client
(`RolloutClient`), the weight syncer (`WeightSyncer`: staging, transport, canary) and recovery
(`rljax.rollout.recovery`). Every push goes to every server, each answers the canary and must then report
the pushed version (`/weight_info`).

What `params` is comes from the engine's `weights` (a `WeightSource`, chosen once): the host loop's
`rljax.loop.engine.JaxWeights` takes the trainer's JAX params; `StateDictWeights` takes Hugging Face
tensors on the host (`state_dict.items()`) with a reference model as the canary's trainer side (tests,
notebooks, benchmarks).

Recovery (`max_restarts` > 0): a `generate` or `push_weights` that fails with a recoverable error (a dead or
hung server) restarts every owned server that died or stopped answering, re-pushes the last pushed weights
and version (from a copy the engine keeps) and resubmits the call; after `max_restarts` restarts in a row
the call raises `RecoveryExhaustedError`. A server that crashes again after a restart with the same root-
cause line in its log (a deterministic engine crash) ends the call at once with `EngineCrashError` quoting
that line and naming the log: it stops within one restart. One recovery runs at a time (a lock shared by the
loop and the async producer's thread); a caller whose failure predates a recovery that already happened just
retries. Until the re-push the gate is broken: a generate call that comes in meanwhile fails, waits for the
recovery and is resubmitted, instead of sampling a restarted server's checkpoint under the previous
version's label. With `max_restarts` = 0 the first error is raised as it is.

`model_path` is the local checkpoint directory the servers loaded: the syncer checks names and shapes
against its safetensors headers and sizes the canary from its `config.json` (vocabulary) and the servers'
KV block size. This module and everything it imports run in the trainer's process: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from rljax.config import DEFAULTS
from rljax.hf_config import read_hf_config
from rljax.rollout import placement
from rljax.rollout.auth import bearer_headers
from rljax.rollout.background import BackgroundPush
from rljax.rollout.client import ClientOptions, Completion, RolloutClient
from rljax.rollout.recovery import RECOVERY_METRICS, EngineCrashError, call_with_recovery
from rljax.rollout.server import ServerOptions, VLLMServer, launch_servers, served_model_name
from rljax.weight_sync.canary import (
    DEFAULT_BLOCK_SIZE,
    CanarySpec,
    TrainerLogprobs,
    make_canary,
    server_block_size,
)
from rljax.weight_sync.gate import PolicyGate
from rljax.weight_sync.syncer import SyncOptions, WeightSyncer, WeightSyncError
from rljax.weight_sync.wire import read_checkpoint_spec


class Snapshot(Protocol):
    """One version of the policy's weights; its type says how it is pushed (host tensors the syncer stages:
    `WeightSyncer.push_weights`; buckets every trainer process staged already: `push_staged`)."""

    def push(self, syncer: WeightSyncer, version: int) -> dict[str, float]:
        """Pushes these weights through `syncer` as policy `version` (a fresh push on every call)."""

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> np.ndarray:
        """f32[C]: the trainer's log-probs (temperature 1) of `completion_ids` (the canary's trainer side)."""

    def keep(self) -> Callable[[], Snapshot]:
        """A copy that outlives the trainer's arrays (the next update donates them), for a later re-push."""


class WeightSource(Protocol):
    def push(self, params: Any, canary: CanarySpec, push: Callable[[Snapshot], dict]) -> dict:
        """`push(snapshot of params)`: the snapshot `push_weights(params, version)` pushes; `canary` is the
        prompt it will be asked. A source whose snapshot takes collectives across trainer processes (the
        sharded staging of `rljax.loop.engine`) wraps them around the push."""

    def close(self) -> None:
        """Releases what the source holds (e.g. its staging directory)."""


@dataclasses.dataclass(frozen=True)
class StateDictWeights:
    """`params` as Hugging Face tensors on the host, in the serving layout and dtype: a re-iterable
    collection of `(hf_name, array)` items such as `state_dict.items()` (or the syncer's other item
    forms); `logprobs(prompt_ids, completion_ids) -> f32[C]` is the canary's trainer side (e.g. a
    transformers reference holding the same weights)."""

    logprobs: TrainerLogprobs

    def push(self, params: Iterable[tuple], canary: CanarySpec, push: Callable[[Snapshot], dict]) -> dict:
        return push(_Items(params, self.logprobs))

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _Items:
    items: Iterable[tuple]
    logprobs: TrainerLogprobs

    def tensors(self) -> Iterable[tuple]:
        return iter(self.items)

    def push(self, syncer: WeightSyncer, version: int) -> dict[str, float]:
        return syncer.push_weights(self.tensors(), version, self.logprobs)

    def keep(self) -> Callable[[], _Items]:
        kept = _Items(list(self.items), self.logprobs)  # host arrays the caller does not donate
        return lambda: kept


def canary_block_size(urls: Sequence[str], headers: dict | None = None) -> int:
    """The largest KV block size among the servers (what the canary's prompt must span), vLLM's largest
    default where a server does not report it."""
    return max(server_block_size(u, headers=headers) or DEFAULT_BLOCK_SIZE for u in urls)


def _restarting(servers: Sequence[VLLMServer]) -> str:
    return f"restarting {', '.join(s.url for s in servers)}; serving again after the re-push"


class RolloutEngine:
    """Generation + verified weight push + recovery over one or more vLLM servers; see the module docstring.

    Built from its parts (`client`, `syncer`, owned `servers`); `launch` and `connect` build them.
    """

    def __init__(
        self,
        client: RolloutClient,
        syncer: WeightSyncer,
        *,
        servers: Sequence[VLLMServer] = (),
        token: str | None = None,
        weights: WeightSource | None = None,
        max_restarts: int = 0,
    ):
        self.client, self.syncer, self.servers, self.token = client, syncer, list(servers), token
        self.weights, self._max_restarts = weights, max_restarts
        self._lock = threading.RLock()  # one recovery (or push) at a time
        self._epoch = 0  # recoveries done; a failure seen before the latest one needs no new restart
        self._last_crash: str | None = None  # root cause of the crash the latest restart followed
        self._current: tuple[Callable[[], Snapshot], int] | None = None  # (last pushed weights, version)
        self._stats: dict[str, float] = dict.fromkeys(RECOVERY_METRICS, 0.0)
        self._stats_lock = threading.Lock()
        self.unpin_cpus: tuple[int, ...] = ()  # set by whoever pinned this process (host placement)
        self._background: BackgroundPush | None = None  # made by the first start_push

    @classmethod
    def launch(
        cls,
        model_path: str | os.PathLike,
        workdir: str | os.PathLike,
        *,
        replicas: int = DEFAULTS.rollout.vllm.num_servers,
        host: str = DEFAULTS.rollout.vllm.host,
        server_options: ServerOptions = ServerOptions(),
        sync_options: SyncOptions = SyncOptions(),
        **kwargs,
    ) -> RolloutEngine:
        """Starts `replicas` owned servers (`launch_servers`) and connects to them; their weight-transfer
        backend is named after `sync_options.transport` and their workers map buckets only from
        `sync_options.staging_dir`."""
        server_options = dataclasses.replace(
            server_options,
            weight_transfer_backend=sync_options.transport,
            staging_dir=sync_options.staging_dir,
        )
        servers = launch_servers(model_path, workdir, replicas=replicas, host=host, options=server_options)
        try:
            urls = [s.url for s in servers]
            return cls.connect(urls, model_path, servers=servers, sync_options=sync_options, **kwargs)
        except BaseException:
            for s in servers:
                s.stop()
            raise

    @classmethod
    def connect(
        cls,
        urls: Sequence[str],
        model_path: str | os.PathLike,
        *,
        servers: Sequence[VLLMServer] = (),
        client_options: ClientOptions = ClientOptions(),
        sync_options: SyncOptions = SyncOptions(),
        version: int = 0,
        token: str | None = None,
        **kwargs,
    ) -> RolloutEngine:
        """An engine over servers at `urls` (owned `servers`, or started elsewhere: same host for the "shm"
        transport, any host for "tcp"); `token` defaults to the owned servers' one."""
        tokens = {s.token for s in servers}
        if token is None and len(tokens) > 1:
            raise ValueError("RolloutEngine: the owned servers have different tokens; pass one token to all")
        token = token if token is not None else next(iter(tokens), None)
        headers, gate = bearer_headers(token), PolicyGate(version)
        model = served_model_name(urls[0], headers=headers)
        vocab = read_hf_config(model_path)["vocab_size"]
        client = RolloutClient(urls, model, gate=gate, options=client_options, token=token)
        syncer = WeightSyncer(
            list(urls),
            model,
            spec=read_checkpoint_spec(model_path),
            canary=make_canary(vocab, block_size=canary_block_size(urls, headers)),
            gate=gate,
            options=sync_options,
            headers=headers,
        )
        return cls(client, syncer, servers=servers, token=token, **kwargs)

    @property
    def urls(self) -> list[str]:
        return self.client.urls

    @property
    def gate(self) -> PolicyGate:
        return self.client.gate

    @property
    def version(self) -> int:
        return self.gate.version

    # --- generation --------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], **sampling) -> list[Completion]:
        """See `RolloutClient.generate`; a dead or hung server is recovered and the call resubmitted."""
        attempt = {"n": 0, "epoch": self._epoch}

        def op():
            attempt["n"], attempt["epoch"] = attempt["n"] + 1, self._epoch
            if attempt["n"] > 1:
                self._count({"recovery/resubmitted": float(len(prompts))})
            return self._generate_attempt(prompts, sampling)

        return self._with_recovery(op, lambda: self._recover(attempt["epoch"]), "generate")

    def _generate_attempt(self, prompts: Sequence[Sequence[int]], sampling: dict) -> list[Completion]:
        """One attempt of `generate` (recovery repeats it)."""
        return self.client.generate(prompts, **sampling)

    # --- the weight push ---------------------------------------------------------------------------------

    def push_weights(self, params: Any, version: int) -> dict[str, float]:
        """Pushes `params` (what `weights` takes) to every server as policy `version`, verified by the
        canary and each server's reported version; returns weight_sync/* metrics and the recovery/*
        counts since the previous push. Raises WeightSyncError (no recovery) or RecoveryExhaustedError."""
        if self.weights is None:
            raise ValueError("RolloutEngine: push_weights needs the engine's `weights` (a WeightSource)")
        self.wait_pushed()  # a `start_push` still in flight is delivered (or raised) first
        return self.weights.push(
            params, self.syncer.canary, functools.partial(self._push_snapshot, version=version)
        )

    def start_push(self, params: Any, version: int, on_served: Callable[[int], None] | None = None) -> None:
        """`push_weights`, delivered on a background thread once the trainer's side (the canary's forward,
        a host copy of the weights) is done; `on_served(version)` when the servers serve it, verified.
        Waits for the previous such push first and raises its failure (`rljax.rollout.background`)."""
        if self.weights is None:
            raise ValueError("RolloutEngine: start_push needs the engine's `weights` (a WeightSource)")
        if self._background is None:
            spec = self.syncer.canary
            self._background = BackgroundPush(
                lambda params, push: self.weights.push(params, spec, push),
                lambda snapshot, version: self._push_snapshot(snapshot, version=version),
                spec,
            )
        self._background.start(params, version, on_served)

    def wait_pushed(self) -> None:
        """Waits for the push `start_push` began (if any); raises its failure."""
        if self._background is not None:
            self._background.wait()

    def pushed_metrics(self) -> dict[str, float]:
        """weight_sync/* and recovery/* of the `start_push` pushes delivered since the last call."""
        return self._background.metrics() if self._background is not None else {}

    def _push_snapshot(self, snapshot: Snapshot, *, version: int) -> dict[str, float]:
        with self._lock:
            pushed: dict[str, dict] = {}

            def op():  # after a recovery that pushed this version already: done
                return pushed["metrics"] if "metrics" in pushed else self._push_attempt(snapshot, version)

            def recover():
                self.restart_unhealthy()
                pushed["metrics"] = self._push_attempt(snapshot, version)
                self._epoch += 1

            metrics = self._with_recovery(op, recover, "weight sync")
            if self._max_restarts > 0:  # what a later recovery re-pushes
                self._current = (snapshot.keep(), version)
        return metrics | self._drain_stats()

    def _push_attempt(self, snapshot: Snapshot, version: int) -> dict[str, float]:
        """One push of `snapshot` (recovery repeats it), then every server must report `version`."""
        metrics = snapshot.push(self.syncer, version)
        for url in self.urls:
            served = self.syncer.server_version(url)
            if served != str(version):
                raise WeightSyncError(f"{url} serves weight version {served!r} after pushing {version}")
        return metrics

    # --- recovery ----------------------------------------------------------------------------------------

    def restart_unhealthy(self) -> list[VLLMServer]:
        """Restarts (all at once) the owned servers that died or do not answer `/health` and forgets the
        syncer's per-server state; returns the restarted servers. A full push must follow (it also
        repairs a live server left with mixed weights by a failed push). Until it succeeds the gate is
        broken: a restarted server serves the checkpoint, not the gate's version, so a generate call that
        came in meanwhile would get samples labelled with the wrong policy version."""
        dead = [s for s in self.servers if not s.healthy()]
        self._check_repeated_crash(dead)
        if dead and not self.gate.broken:  # (a failed push's "mixed weights" stays until its re-push)
            self.gate.broken = _restarting(dead)
        for s in dead:
            s.stop()
            s.spawn()
        for s in dead:
            s.wait_healthy(s.options.startup_timeout_s)
        self.syncer.reset()
        return dead

    def _check_repeated_crash(self, dead: Sequence[VLLMServer]) -> None:
        """Raises EngineCrashError when a server crashed with the root cause (`VLLMServer.crash_cause`) of
        the crash the previous restart followed, with no call succeeding in between: the same requests
        crash the same engine again, so restarting more only repeats it."""
        crashes = [(s, cause) for s in dead if (cause := s.crash_cause())]
        for server, cause in crashes:
            if cause == self._last_crash:
                raise EngineCrashError(
                    f"vLLM server {server.url} crashed again after a restart with the same error, not "
                    f"retried: {cause} (server log: {server.log_path})"
                )
        self._last_crash = crashes[0][1] if crashes else None

    def _recover(self, seen_epoch: int) -> bool:
        """Restart + re-push of the last pushed weights and version (False: someone else recovered)."""
        with self._lock:
            if self._epoch != seen_epoch:
                return False
            dead = self.restart_unhealthy()
            if self._current is not None:
                kept, version = self._current
                self._push_attempt(kept(), version)
            elif dead and self.gate.broken == _restarting(dead):  # nothing was pushed: a restarted
                self.gate.broken = None  # server serves the same checkpoint as before
            self._epoch += 1
            return True

    def _with_recovery(self, op: Callable, recover: Callable, what: str):
        if self._max_restarts == 0:
            return op()
        stats: dict[str, float] = {}
        try:
            result = call_with_recovery(op, recover, self._max_restarts, f"rollout {what}", stats=stats)
            self._last_crash = None  # a crash after a call that worked is a new one
            return result
        finally:
            self._count(stats)

    def _count(self, stats: dict) -> None:
        with self._stats_lock:
            for k, v in stats.items():
                self._stats[k] = self._stats.get(k, 0.0) + v

    def _drain_stats(self) -> dict[str, float]:
        with self._stats_lock:
            out, self._stats = self._stats, dict.fromkeys(RECOVERY_METRICS, 0.0)
        return out

    # --- the rest ----------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """rollout/* metrics of the generate calls since the last call."""
        return self.client.metrics()

    def close(self) -> None:
        """Stops the client, the syncer and the owned servers; gives pinned cores back."""
        if self._background is not None:  # the push in flight first: it uses the client and the syncer
            self._background.close()
        self.client.close()
        self.syncer.close()
        for s in self.servers:
            s.stop()
        if self.weights is not None:
            self.weights.close()
        if self.unpin_cpus:  # the trainer's threads get back the cores they had before the server started
            placement.pin_process(self.unpin_cpus)
