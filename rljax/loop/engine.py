"""The trainer's side of the rollout engine: JAX params -> a push, and `make_engine(cfg, ...)` from config.

`make_engine` builds the one `rljax.rollout.engine.RolloutEngine` of a run (owned or connected servers,
client, syncer, transport, recovery, host placement), all chosen once from `cfg`. Its `weights` is a
`JaxWeights`: `push_weights(params, version)` converts the trainer's params to the engine's names, layouts
and serving dtype (`rljax.models.iter_hf_tensors`) and answers the canary with log-probs from the same
`token_logprobs` path the update uses, on the same params.

Multi-process runs: only the leader holds the engine; every other process holds a `Follower`, whose
`push_weights` takes part in the push's collectives and pushes nothing. The weights are a
`ShardedJaxWeights`: every process stages only the shards it owns (`sharded_sync.push_sharded`: nothing
is gathered); with tcp/zmq each process also serves them from its own host (`weight_sync.served`), so
trainers on several hosts send their own shares straight to the rollout nodes; with shm the servers map
every process's files, which needs all trainer processes on the servers' host. The canary's trainer side
is the sharded log-prob function, a collective the leader drives; a recovery re-pushes the last push's
buckets, kept (and served) by each process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rljax import device_plan, models, trainer
from rljax.config import FP8_SERVING, Config, canary_tolerance, serving_dtype
from rljax.distributed import cast_params, is_leader, to_host
from rljax.loop.sharded_sync import PushState, push_sharded, single_host
from rljax.rollout import ClientOptions, RolloutEngine, placement
from rljax.rollout.auth import read_token_file
from rljax.rollout.server import options_from_config
from rljax.trajectory import Trajectory, build_loss_inputs
from rljax.weight_sync import SyncOptions, WeightSyncError, fp8, served, transports
from rljax.weight_sync.canary import CanarySpec
from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, ShardStager


def make_canary_logprobs(cfg: Config, model_config, mesh, data_parallel: int) -> Callable:
    """`fn(params) -> CanaryScorer`: the canary's trainer side, the training path's log-prob function
    (`trainer.make_logprob_fn`: compute dtype, `trainer.logprob_impl`, sharded params; temperature 1).
    The one log-prob scorer of the canary in every layout."""
    logprob_fn = trainer.make_logprob_fn(cfg, model_config, mesh)
    return lambda params: CanaryScorer(logprob_fn, mesh, data_parallel, params)


@dataclasses.dataclass(frozen=True)
class CanaryScorer:
    """`self(prompt_ids, completion_ids) -> f32[C]`: the training path's log-probs of the completion;
    `dispatch(...)` starts the same forward without waiting and returns the function that waits. In a
    multi-process job both are collectives (every process calls them with the same tokens)."""

    logprob_fn: Callable
    mesh: Any
    data_parallel: int
    params: Any

    def dispatch(self, prompt_ids, completion_ids) -> Callable[[], np.ndarray]:
        traj = Trajectory(list(prompt_ids), list(completion_ids), [-1.0] * len(completion_ids), 0.0, 0, 0)
        batch = build_loss_inputs([traj] * self.data_parallel, np.zeros(self.data_parallel), temperature=1.0)
        logp, _ = self.logprob_fn(self.params, trainer.shard_batch(batch, self.mesh))
        start = len(prompt_ids) - 1
        return lambda: to_host(logp)[0, start : start + len(completion_ids)]

    def __call__(self, prompt_ids, completion_ids) -> np.ndarray:
        return self.dispatch(prompt_ids, completion_ids)()


class EarlyCanary:
    """The canary's trainer side started before the server is asked: `self(prompt, completion) -> f32[C]`.

    The canary's question is fixed (`spec.prompt_ids + spec.completion_ids`, `weight_sync.canary`), so
    the training-path forward that answers it (`scorer.dispatch`) is dispatched when the push starts and
    runs while the weights are staged and loaded; the check then finds it done. Any other tokens are
    scored by the same scorer when asked.
    """

    def __init__(self, scorer: CanaryScorer, spec: CanarySpec):
        self._scorer = scorer
        self._question = ([int(t) for t in spec.prompt_ids], [int(t) for t in spec.completion_ids])
        self._early = scorer.dispatch(*self._question)

    def __call__(self, prompt_ids, completion_ids) -> np.ndarray:
        prompt, completion = [int(t) for t in prompt_ids], [int(t) for t in completion_ids]
        if (prompt, completion) == self._question:
            return self._early()
        return self._scorer(prompt, completion)


@dataclasses.dataclass(frozen=True)
class JaxWeights:
    """The engine's `WeightSource` for the trainer's params (a pytree of possibly sharded jax arrays).

    `canary_logprobs(params) -> CanaryScorer` (`make_canary_logprobs`); `dtype`: the serving dtype
    (params are cast to it on device before staging; None: as they are).
    """

    model_config: Any
    canary_logprobs: Callable
    dtype: str | None = None

    def push(self, params, canary: CanarySpec | None, push: Callable | None) -> dict:
        """`push(snapshot)` of a single-process run (multi-process runs push through `ShardedJaxWeights`)."""
        if jax.process_count() > 1:
            raise RuntimeError("JaxWeights pushes a single-process run's params; use ShardedJaxWeights")
        early = EarlyCanary(self.canary_logprobs(params), canary)
        # on device; converted one tensor at a time by the sync (fp8: scaled per tensor on the host)
        host = cast_params(params, None if self.dtype == FP8_SERVING else self.dtype)
        return push(JaxSnapshot(self.model_config, host, self.dtype, _Memo(early)))

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class JaxSnapshot:
    model_config: Any
    host: Any  # the params in the serving dtype (`cast_params`), on device until `keep`
    dtype: str | None
    logprobs: _Memo  # the training path's canary answers of this push (`EarlyCanary`)

    def tensors(self):
        """`(hf_name, array)` in the serving layout and dtype, converted one tensor at a time."""
        if self.dtype == FP8_SERVING:
            return fp8.fp8_tensors(models.iter_hf_tensors(self.model_config, self.host, "float32"))
        return models.iter_hf_tensors(self.model_config, self.host, self.dtype)

    def push(self, syncer, version: int) -> dict:
        return syncer.push_weights(self.tensors(), version, self.logprobs)

    def keep(self) -> Callable[[], JaxSnapshot]:
        """A host copy of the weights (the next update donates the device arrays) and the canary's
        answers of this push (a recovery's re-push is checked against them, `_Memo`)."""
        host = jax.tree.map(lambda x: np.array(x) if isinstance(x, jax.Array) else x, self.host)
        kept = JaxSnapshot(self.model_config, host, self.dtype, self.logprobs.frozen())
        return lambda: kept


@dataclasses.dataclass(frozen=True)
class ShardedJaxWeights:
    """Multi-process: every process (leader and followers alike) calls `push`, which stages its own shards
    and wraps the leader's `push(snapshot)` in the collectives of `sharded_sync.push_sharded`. `serve`
    (tcp/zmq: `buckets -> weight_sync.served.ServedBuckets`, see `make_sharded_weights`): each process
    serves its own buckets; None (shm): the servers map every process's files on this host.
    With `max_restarts > 0` the processes keep the last push's buckets (and servers) and the leader keeps
    the canary's trainer-side answers of that push, so a recovery re-pushes them with no collective and
    nothing gathered."""

    weights: JaxWeights
    stager: ShardStager
    max_restarts: int = 0
    serve: Callable | None = None
    state: PushState = dataclasses.field(default_factory=PushState)  # kept across `dataclasses.replace`

    def push(self, params, canary: CanarySpec | None, push: Callable | None) -> dict:
        w = self.weights

        def leader_push(staged, logprobs) -> dict:
            return push(_StagedSnapshot(staged, _Memo(logprobs)))

        return push_sharded(
            params,
            state=self.state,
            model_config=w.model_config,
            dtype=w.dtype,
            stager=self.stager,
            canary=w.canary_logprobs,
            push=leader_push if push is not None else None,
            keep=self.max_restarts > 0,
            serve=self.serve,
        )

    def close(self) -> None:
        self.state.release()
        self.stager.close()


def make_sharded_weights(cfg: Config, weights: JaxWeights) -> ShardedJaxWeights:
    """The multi-process `ShardedJaxWeights` of `cfg`: each process serves its own buckets with a streaming
    `rollout.weight_sync.transport`; with `shm` every trainer process must share the servers' host."""
    ws = cfg.rollout.weight_sync
    serve = None
    if transports.streams(ws.transport):  # this host's address, found once (a bad list fails at start-up)
        host = transports.local_address(ws.tcp_host)
        serve = functools.partial(
            served.serve_buckets, transport=ws.transport, hosts=host, timeout_s=ws.tcp_timeout_s
        )
    elif not single_host():
        raise WeightSyncError(
            "rollout.weight_sync.transport=shm maps bucket files on one host, but the trainer processes "
            "run on several: use tcp or zmq (with tcp_host listing every trainer host's address)"
        )
    stager = ShardStager(
        DEFAULT_STAGING_DIR,
        bucket_bytes=ws.bucket_mb * 2**20,
        checksums=ws.checksums,
        spec=models.hf_tensor_specs(weights.model_config, serving_dtype(cfg)),
    )
    return ShardedJaxWeights(weights, stager, max_restarts=cfg.rollout.vllm.max_restarts, serve=serve)


class _Memo:
    """The canary's trainer side of one sharded push, remembered: a recovery's re-push asks the restarted
    server the same question and gets the answers the push computed (the sharded scorer is a
    collective the other processes no longer join). A question not asked at push time fails the check."""

    def __init__(self, logprobs: Callable | None):
        self._logprobs, self._answers = logprobs, {}

    def __call__(self, prompt_ids, completion_ids) -> np.ndarray:
        key = (tuple(int(t) for t in prompt_ids), tuple(int(t) for t in completion_ids))
        if key not in self._answers:
            if self._logprobs is None:
                raise WeightSyncError("canary: the re-pushed weights answered a prompt the push did not see")
            self._answers[key] = np.asarray(self._logprobs(prompt_ids, completion_ids))
        return self._answers[key]

    def frozen(self) -> _Memo:
        memo = _Memo(None)
        memo._answers = dict(self._answers)
        return memo


@dataclasses.dataclass(frozen=True)
class _StagedSnapshot:
    """The buckets every process staged (`StagedBuckets`) and the leader's side of the sharded canary."""

    staged: Any
    logprobs: _Memo

    def push(self, syncer, version: int) -> dict:
        return syncer.push_staged(self.staged, version, self.logprobs)

    def keep(self) -> Callable[[], _StagedSnapshot]:
        # the files (and their servers) stay until the next push; a re-push does not wait on the others
        kept = _StagedSnapshot(dataclasses.replace(self.staged, wait_sent=None), self.logprobs.frozen())
        return lambda: kept


@dataclasses.dataclass(frozen=True)
class Follower:
    """A non-leader process's side of the engine: joins each push's collectives, serves nothing."""

    weights: JaxWeights | ShardedJaxWeights

    def push_weights(self, params, version: int) -> dict:
        self.weights.push(params, None, None)  # the push's collectives
        return {}

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        self.weights.close()


def make_engine(
    cfg: Config, workdir: str, model_config, mesh, data_parallel: int
) -> RolloutEngine | Follower:
    """The configured vLLM servers (`rollout.vllm.num_servers` started, or connected by URL, on the leader);
    logs in `workdir/vllm/replica_<i>/`."""
    canary = make_canary_logprobs(cfg, model_config, mesh, data_parallel)
    vc, ws = cfg.rollout.vllm, cfg.rollout.weight_sync
    weights = JaxWeights(model_config, canary, serving_dtype(cfg))
    if jax.process_count() > 1:  # sharded staging: each process writes (and serves) its own shards
        weights = make_sharded_weights(cfg, weights)
    if not is_leader():
        return Follower(weights)
    place = placement.plan_placement(
        placement.allowed_cpus(),
        vc.placement,
        overlap=cfg.trainer.max_staleness > 0,
        server_on_host=not vc.urls and jax.process_count() == 1,
    )
    common = dict(
        weights=weights,
        max_restarts=vc.max_restarts,
        client_options=ClientOptions(
            no_progress_timeout_s=vc.no_progress_timeout_s,
            max_retries=vc.max_retries,
            max_in_flight=cfg.rollout.max_in_flight,
        ),
        sync_options=SyncOptions(
            bucket_bytes=ws.bucket_mb * 2**20,
            checksums=ws.checksums,
            canary_tolerance=canary_tolerance(cfg),
            transport=ws.transport,
            tcp_host=ws.tcp_host,
            tcp_timeout_s=ws.tcp_timeout_s,
        ),
    )
    if vc.urls:
        token = read_token_file(vc.token_file) if vc.token_file else None  # servers started elsewhere
        engine = RolloutEngine.connect(list(vc.urls), cfg.model.path, token=token, **common)
    else:
        engine = RolloutEngine.launch(
            cfg.model.path,
            os.path.join(workdir, "vllm"),
            replicas=vc.num_servers,
            host=vc.host,
            server_options=options_from_config(
                cfg,
                cpus=place.server_cpus,
                devices=device_plan.owned_server_devices(device_plan.local_plan(cfg)),
            ),
            **common,
        )
    if place.trainer_cpus:  # after the server started: its processes keep the cores they were given
        engine.unpin_cpus = placement.allowed_cpus()  # restored by close()
        placement.pin_process(place.trainer_cpus)
    return engine
