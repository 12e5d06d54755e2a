"""The trainer's side of the rollout engine: JAX params -> a snapshot; `make_engine(cfg, ...)` from config.

`make_engine` builds the one `rljax.rollout.engine.RolloutEngine` of a run (owned or connected servers,
client, syncer, transport, recovery, host placement) and the run's weights, all chosen once from `cfg`.
A push goes one way (`push_params`):

    snapshot = weights.snapshot(params)          # JaxWeights (one process) or ShardedJaxWeights
    with snapshot:
        metrics = engine.push_weights(snapshot, version)

`JaxWeights.snapshot` casts the trainer's params to the serving dtype on device and dispatches the
canary's forward on the same `token_logprobs` path the update uses (`CanaryScorer`); the engine converts
them to its names and layouts (`rljax.models.iter_hf_tensors`) while it stages them (`snapshots.JaxSnapshot`).

Multi-process runs: only the leader holds the engine; every other process holds a `Follower`, which pushes
nothing. The weights are a `ShardedJaxWeights`: every process stages only the shards it owns
(`sharded_sync.stage_sharded`: nothing is gathered); with tcp/zmq each process also serves them from its
own host (`weight_sync.served`), so trainers on several hosts send their own shares straight to the
rollout nodes; with shm the servers map every process's files, which needs all trainer processes on the
servers' host. The canary's question is the leader engine's (`sharded_sync.share_question`); its answer
is the sharded log-prob function, computed by every process together when the snapshot is taken, so the
leader's push needs no collective and the others wait at the push's end (`with snapshot:`). A recovery
re-pushes the last push's buckets, kept (and served) by each process.
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
from rljax.loop.sharded_sync import PushState, share_question, single_host, stage_sharded
from rljax.loop.snapshots import AdapterSnapshot, CanaryAnswers, JaxSnapshot, StagedSnapshot, spec_key
from rljax.models import lora
from rljax.rollout import ClientOptions, RolloutEngine, placement
from rljax.rollout.auth import read_token_file
from rljax.rollout.server import options_from_config
from rljax.trajectory import Trajectory, build_loss_inputs
from rljax.weight_sync import SyncOptions, WeightSyncError, served, transports
from rljax.weight_sync.canary import CanarySpec
from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, ShardStager

LORA_DIR = "lora_adapters"  # <workdir>/lora_adapters/v<version>: a LoRA run's adapters, one per version


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


@dataclasses.dataclass(frozen=True)
class JaxWeights:
    """The trainer's params (a pytree of possibly sharded jax arrays) as snapshots, in one process.

    `canary_logprobs(params) -> CanaryScorer` (`make_canary_logprobs`); `canary`: the question every push
    is asked (`RolloutEngine.canary`); `dtype`: the serving dtype (params are cast to it on device
    before staging; None: as they are).
    """

    model_config: Any
    canary_logprobs: Callable
    canary: CanarySpec
    dtype: str | None = None

    def snapshot(self, params) -> JaxSnapshot:
        """`params` as one version: the canary's training-path forward is dispatched now (it runs while
        the weights are staged and loaded; the check then finds it done), the params cast on device."""
        if jax.process_count() > 1:
            raise RuntimeError("JaxWeights snapshots a single-process run's params; use ShardedJaxWeights")
        scorer = self.canary_logprobs(params)
        early = scorer.dispatch(self.canary.prompt_ids, self.canary.completion_ids)
        answers = CanaryAnswers({spec_key(self.canary): early}, scorer)  # other tokens: scored when asked
        # on device; converted one tensor at a time by the sync (fp8: scaled per tensor on the host)
        host = cast_params(params, None if self.dtype == FP8_SERVING else self.dtype)
        return JaxSnapshot(self.model_config, host, self.dtype, answers)

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class ShardedJaxWeights:
    """Multi-process: every process (leader and followers alike) calls `snapshot` at the same point; it
    stages that process's own shards and computes the canary's answer collectively
    (`sharded_sync.stage_sharded`). `serve` (tcp/zmq: `buckets -> weight_sync.served.ServedBuckets`,
    see `make_sharded_weights`): each process serves its own buckets; None (shm): the servers map every
    process's files on this host. With `max_restarts > 0` the processes keep the last push's buckets
    (and servers) and the leader's engine keeps the snapshot's answers, so a recovery re-pushes them
    with no collective and nothing gathered."""

    weights: JaxWeights
    stager: ShardStager
    max_restarts: int = 0
    serve: Callable | None = None
    state: PushState = dataclasses.field(default_factory=PushState)  # kept across `dataclasses.replace`

    def snapshot(self, params) -> StagedSnapshot:
        w = self.weights
        return stage_sharded(
            params,
            state=self.state,
            model_config=w.model_config,
            dtype=w.dtype,
            stager=self.stager,
            scorer=w.canary_logprobs(params),
            question=w.canary,
            keep=self.max_restarts > 0,
            serve=self.serve,
        )

    def close(self) -> None:
        self.state.release()
        self.stager.close()


@dataclasses.dataclass(frozen=True)
class AdapterWeights:
    """A LoRA run's weights (`model.lora_rank > 0`): `snapshot(adapter)` takes `TrainState.params` (the
    adapter) to PEFT tensors on the host (`rljax.models.lora.peft_tensors`: megabytes, gathered onto every
    process) and answers the canary with the training path's log-probs of the frozen `base` plus this
    adapter (`lora.combine`). In a multi-process job the answer is a collective, computed by every process
    when the snapshot is taken; the followers' engines push nothing."""

    model_config: Any
    base: Any
    canary_logprobs: Callable
    canary: CanarySpec
    base_path: str

    def snapshot(self, adapter) -> AdapterSnapshot:
        scorer = self.canary_logprobs(lora.combine(self.base, adapter))
        early = scorer.dispatch(self.canary.prompt_ids, self.canary.completion_ids)
        if jax.process_count() > 1:
            answer = early()
            answers = CanaryAnswers({spec_key(self.canary): lambda: answer})
        else:
            answers = CanaryAnswers({spec_key(self.canary): early}, scorer)
        tensors = lora.peft_tensors(self.model_config, jax.tree.map(to_host, adapter))
        return AdapterSnapshot(tensors, lora.peft_config(self.model_config, self.base_path), answers)

    def close(self) -> None:
        pass


def sharded_serve(cfg: Config) -> Callable | None:
    """How each process of a multi-process job serves its own buckets with a streaming
    `rollout.weight_sync.transport` (None: shm, where every trainer process must share the servers'
    host; checked here, before any server starts). Every process calls it at start-up."""
    ws = cfg.rollout.weight_sync
    if transports.streams(ws.transport):  # this host's address, found once (a bad list fails at start-up)
        host = transports.local_address(ws.tcp_host)
        return functools.partial(
            served.serve_buckets, transport=ws.transport, hosts=host, timeout_s=ws.tcp_timeout_s
        )
    if not single_host():
        raise WeightSyncError(
            "rollout.weight_sync.transport=shm maps bucket files on one host, but the trainer processes "
            "run on several: use tcp or zmq (with tcp_host listing every trainer host's address)"
        )
    return None


def make_sharded_weights(cfg: Config, weights: JaxWeights, serve: Callable | None) -> ShardedJaxWeights:
    """The multi-process `ShardedJaxWeights` of `cfg` (`serve`: `sharded_serve(cfg)`)."""
    ws = cfg.rollout.weight_sync
    stager = ShardStager(
        DEFAULT_STAGING_DIR,
        bucket_bytes=ws.bucket_mb * 2**20,
        checksums=ws.checksums,
        spec=models.hf_tensor_specs(weights.model_config, serving_dtype(cfg)),
    )
    return ShardedJaxWeights(weights, stager, max_restarts=cfg.rollout.vllm.max_restarts, serve=serve)


@dataclasses.dataclass(frozen=True)
class Follower:
    """A non-leader process's side of the engine: its snapshots join each push's collectives (when they
    are taken, and at the end of the push, `with snapshot:`); it pushes nothing and serves nothing."""

    def push_weights(self, snapshot, version: int) -> dict:
        return {}

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def push_params(engine: RolloutEngine | Follower, weights, params, version: int) -> dict:
    """Serves `params` as policy `version`: `weights.snapshot(params)` (the trainer's side), then
    `engine.push_weights(snapshot, version)`; returns its metrics ({} on a follower)."""
    with weights.snapshot(params) as snapshot:
        return engine.push_weights(snapshot, version)


def make_engine(
    cfg: Config, workdir: str, model_config, mesh, data_parallel: int, base: Any = None
) -> tuple[RolloutEngine | Follower, JaxWeights | ShardedJaxWeights | AdapterWeights]:
    """`(engine, weights)`: the configured vLLM servers (`rollout.vllm.num_servers` started, or connected
    by URL, on the leader; logs in `workdir/vllm/replica_<i>/`) and the trainer's side of each push,
    every push then `push_params(engine, weights, params, version)`. Every process calls it. A LoRA run
    (`model_config.lora_rank > 0`) passes its frozen `base` params and pushes adapters (`AdapterWeights`;
    written under `workdir/lora_adapters/`, which every server must be able to read)."""
    multi, lora_run = jax.process_count() > 1, model_config.lora_rank > 0
    serve = sharded_serve(cfg) if multi and not lora_run else None  # before any server starts
    engine = _leader_engine(cfg, workdir) if is_leader() else Follower()
    question = share_question(engine.canary if is_leader() else None)
    scorer = make_canary_logprobs(cfg, model_config, mesh, data_parallel)
    if lora_run:  # each version an adapter: the base stays on the servers
        return engine, AdapterWeights(model_config, base, scorer, question, cfg.model.path)
    weights = JaxWeights(model_config, scorer, question, serving_dtype(cfg))
    if multi:  # sharded staging: each process writes (and serves) its own shards
        weights = make_sharded_weights(cfg, weights, serve)
    return engine, weights


def _leader_engine(cfg: Config, workdir: str) -> RolloutEngine:
    """The leader's `RolloutEngine` of `cfg`, its host placement applied."""
    vc, ws = cfg.rollout.vllm, cfg.rollout.weight_sync
    place = placement.plan_placement(
        placement.allowed_cpus(),
        vc.placement,
        overlap=cfg.trainer.max_staleness > 0,
        server_on_host=not vc.urls and jax.process_count() == 1,
    )
    common = dict(
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
    if cfg.model.lora_rank:
        common["lora_root"] = os.path.join(os.path.abspath(workdir), LORA_DIR)
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
