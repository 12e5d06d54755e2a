"""The trainer's side of the rollout engine: JAX params -> a push, and `make_engine(cfg, ...)` from config.

`make_engine` builds the one `rljax.rollout.engine.RolloutEngine` of a run (owned or connected servers,
client, syncer, transport, recovery, host placement), all chosen once from `cfg`. Its `weights` is a
`JaxWeights`: `push_weights(params, version)` converts the trainer's params to the engine's names, layouts
and serving dtype (`rljax.models.iter_hf_tensors`) and answers the canary with log-probs from the same
`token_logprobs` path the update uses, on the same params.

Multi-process runs: only the leader holds the engine; every other process holds a `Follower`, whose
`push_weights` takes part in the push's collectives and pushes nothing. On one host the weights are a
`ShardedJaxWeights`: every process stages only the shards it owns (`distributed.push_sharded`: nothing is
gathered) and the canary's trainer side is the sharded log-prob function, a collective the leader drives;
a recovery re-pushes the last push's files, kept by each process. Trainer processes on several hosts
still gather the params to the leader (`host_params`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import kernels, models, trainer
from rljax.config import Config, canary_tolerance, serving_dtype
from rljax.loop.distributed import host_params, is_leader, push_sharded, single_host, to_host
from rljax.rollout import ClientOptions, RolloutEngine, placement
from rljax.rollout.auth import read_token_file
from rljax.rollout.server import options_from_config
from rljax.trajectory import Trajectory, build_loss_inputs
from rljax.weight_sync import SyncOptions, WeightSyncError
from rljax.weight_sync.canary import CanarySpec
from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, ShardStager


def make_canary_logprobs(cfg: Config, model_config, mesh, data_parallel: int) -> Callable:
    """`fn(params) -> (fn(prompt_ids, completion_ids) -> f32[C])`: the trainer's log-probs (temperature 1)."""
    logprob_fn = trainer.make_logprob_fn(cfg, model_config, mesh)
    return lambda params: lambda p, c: _canary_logprobs(logprob_fn, mesh, data_parallel, params, p, c)


def _canary_logprobs(logprob_fn, mesh, data_parallel, params, prompt_ids, completion_ids) -> np.ndarray:
    traj = Trajectory(list(prompt_ids), list(completion_ids), [-1.0] * len(completion_ids), 0.0, 0, 0)
    batch = build_loss_inputs([traj] * data_parallel, np.zeros(data_parallel), temperature=1.0)
    logp, _ = logprob_fn(params, trainer.shard_batch(batch, mesh))
    start = len(prompt_ids) - 1
    return to_host(logp)[0, start : start + len(completion_ids)]


@functools.partial(jax.jit, static_argnums=0)
def _local_token_logprobs(model_config, params, input_ids, targets):
    hidden = models.hidden_states(model_config, params, input_ids)[0]
    return kernels.token_logprobs(hidden, models.unembed_matrix(model_config, params), targets)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _greedy_then_logprobs(model_config, params, ids, prompt_len):
    """(g i32[], logp f32[C]): the trainer's greedy token after `ids[:prompt_len]`, then the log-probs
    (temperature 1) of `ids[prompt_len:]` with its first token replaced by g. `ids` i32[P + C]."""
    unembed = models.unembed_matrix(model_config, params)
    last = models.hidden_states(model_config, params, ids[None, :prompt_len])[0, -1]
    g = jnp.argmax(last.astype(jnp.float32) @ unembed.T.astype(jnp.float32)).astype(ids.dtype)
    ids = ids.at[prompt_len].set(g)
    hidden = models.hidden_states(model_config, params, ids[None, :-1])[0]
    return g, kernels.token_logprobs(hidden, unembed, ids[1:])[prompt_len - 1 :]


class SpeculativeCanary:
    """The canary's trainer side started before the server is asked: `self(prompt, completion) -> f32[C]`.

    Dispatches (without waiting) the trainer's forward of `spec.prompt_ids + [g] + spec.completion_ids[1:]`
    with its own greedy token g, so it runs while the weights are staged and loaded. The canary asks for
    the server's greedy token first: when it equals g, the answer is that forward's log-probs
    (`answered_early`); otherwise (or for any other tokens) `exact(prompt, completion)` computes them.
    Either way the values compared with the server's are the trainer's log-probs of exactly the tokens
    the server scored.
    """

    def __init__(self, model_config, params, spec, exact: Callable):
        self._prompt, self._fixed, self._exact = list(spec.prompt_ids), list(spec.completion_ids), exact
        ids = jnp.asarray(self._prompt + self._fixed, jnp.int32)
        self._g, self._logp = _greedy_then_logprobs(model_config, params, ids, len(self._prompt))
        self.answered_early = False

    def __call__(self, prompt_ids, completion_ids) -> np.ndarray:
        ours = list(prompt_ids) == self._prompt and list(completion_ids[1:]) == self._fixed[1:]
        if ours and len(completion_ids) == len(self._fixed) and int(completion_ids[0]) == int(self._g):
            self.answered_early = True
            return np.asarray(self._logp)
        return self._exact(prompt_ids, completion_ids)


def local_logprobs(model_config, params, prompt_ids, completion_ids) -> np.ndarray:
    """f32[C] log-probs (temperature 1) of `completion_ids` after `prompt_ids` on this process's device."""
    ids = jnp.asarray([list(prompt_ids) + list(completion_ids)], jnp.int32)
    logp = _local_token_logprobs(model_config, params, ids[:, :-1], ids[0, 1:])
    start = len(prompt_ids) - 1
    return np.asarray(logp)[start : start + len(completion_ids)]


@dataclasses.dataclass(frozen=True)
class JaxWeights:
    """The engine's `WeightSource` for the trainer's params (a pytree of possibly sharded jax arrays).

    `canary_logprobs(params) -> fn(prompt_ids, completion_ids) -> f32[C]` (`make_canary_logprobs`);
    `dtype`: the serving dtype (params are cast to it on device before staging; None: as they are).
    """

    model_config: Any
    canary_logprobs: Callable
    dtype: str | None = None

    def push(self, params, canary: CanarySpec | None, push: Callable | None) -> dict:
        """`push(snapshot)` on the leader; on other processes (`push` None) only the gather's collective."""
        if push is None:
            host_params(params, self.dtype)  # the leader's gather needs every process
            return {}
        return push(self.snapshot(params, canary))

    def close(self) -> None:
        pass

    def snapshot(self, params, canary: CanarySpec) -> JaxSnapshot:
        """Must be called by every process: the host copy of the weights is a collective."""
        host = host_params(params, self.dtype)
        if jax.process_count() > 1:  # the leader alone scores canary tokens, on one device, from `host`
            logprobs = functools.partial(local_logprobs, self.model_config, host)
            return JaxSnapshot(self.model_config, host, self.dtype, logprobs, kept=host)  # numpy already
        early = SpeculativeCanary(self.model_config, params, canary, self.canary_logprobs(params))
        # kept: copied to numpy by keep(), since the next update donates the device arrays
        return JaxSnapshot(self.model_config, host, self.dtype, early, kept=params, early=early)


@dataclasses.dataclass(frozen=True)
class JaxSnapshot:
    model_config: Any
    host: Any  # fully addressable params in the serving dtype (`host_params`)
    dtype: str | None
    logprobs: Callable
    kept: Any  # what `keep` copies to host memory
    early: SpeculativeCanary | None = None  # the canary's trainer side started before the push

    def tensors(self):
        return models.iter_hf_tensors(self.model_config, self.host, self.dtype)

    def keep(self) -> Callable[[], JaxSnapshot]:
        """A host copy; the returned function puts it on one local device (only when a recovery needs it,
        so the copy costs device memory only during that recovery)."""
        host = jax.tree.map(lambda x: np.array(x) if isinstance(x, jax.Array) else x, self.kept)

        def on_device() -> JaxSnapshot:
            local = jax.device_put(host, jax.local_devices()[0])
            logprobs = functools.partial(local_logprobs, self.model_config, local)
            return JaxSnapshot(self.model_config, local, self.dtype, logprobs, kept=host)

        return on_device

    def metrics(self) -> dict[str, float]:
        if self.early is None:
            return {}
        return {"weight_sync/canary_early_forward": float(self.early.answered_early)}


@dataclasses.dataclass(frozen=True)
class ShardedJaxWeights:
    """Multi-process on one host: every process (leader and followers alike) calls `push`, which stages its
    own shards and wraps the leader's `push(snapshot)` in the collectives of `distributed.push_sharded`.
    With `max_restarts > 0` the processes keep the last push's bucket files and the leader keeps the
    canary's trainer-side answers of that push, so a recovery re-pushes them with no collective and
    nothing gathered."""

    weights: JaxWeights
    stager: ShardStager
    max_restarts: int = 0

    def push(self, params, canary: CanarySpec | None, push: Callable | None) -> dict:
        w = self.weights

        def leader_push(staged, logprobs) -> dict:
            return push(_StagedSnapshot(staged, _Memo(logprobs)))

        return push_sharded(
            params,
            model_config=w.model_config,
            dtype=w.dtype,
            stager=self.stager,
            canary=w.canary_logprobs,
            push=leader_push if push is not None else None,
            keep=self.max_restarts > 0,
        )

    def close(self) -> None:
        self.stager.close()


class _Memo:
    """The canary's trainer side of one sharded push, remembered: a recovery's re-push asks the restarted
    server the same greedy question and gets the answers the push computed (the sharded scorer is a
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

    def tensors(self):
        return self.staged  # already staged: the syncer passes them through

    def keep(self) -> Callable[[], _StagedSnapshot]:
        kept = _StagedSnapshot(self.staged, self.logprobs.frozen())  # the files stay until the next push
        return lambda: kept

    def metrics(self) -> dict[str, float]:
        return {}


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
    if jax.process_count() > 1 and single_host():  # sharded staging: each process writes its own shards
        stager = ShardStager(
            DEFAULT_STAGING_DIR,
            bucket_bytes=ws.bucket_mb * 2**20,
            checksums=ws.checksums,
            spec=models.hf_tensor_specs(model_config, serving_dtype(cfg)),
        )
        weights = ShardedJaxWeights(weights, stager, max_restarts=vc.max_restarts)
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
            server_options=options_from_config(cfg, cpus=place.server_cpus),
            **common,
        )
    if place.trainer_cpus:  # after the server started: its processes keep the cores they were given
        engine.unpin_cpus = placement.allowed_cpus()  # restored by close()
        placement.pin_process(place.trainer_cpus)
    return engine
