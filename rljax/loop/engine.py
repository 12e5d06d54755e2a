"""The loop's rollout engine: vLLM servers (owned or connected) with the trainer-side canary bound in.

`make_engine(cfg, workdir, model_config, mesh)` returns an object with `generate(prompt_ids, **sampling)`,
`push_weights(params, version)` and `close()`; `push_weights` converts the params to the engine's names
and layouts (`rljax.models.iter_hf_tensors`) and verifies the sync with the canary, whose trainer-side
log-probs come from the same `token_logprobs` path the update uses, on the same params.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import kernels, models, trainer
from rljax.config import Config, canary_tolerance, serving_dtype
from rljax.loop.distributed import host_params, is_leader, push_sharded, single_host, to_host
from rljax.loop.recovery import FaultPlan, call_with_recovery, kill_halfway, kill_when_running
from rljax.rollout import ClientOptions, RolloutError, VLLMEngine, placement
from rljax.rollout.auth import read_token_file
from rljax.rollout.server import options_from_config
from rljax.trajectory import Trajectory, build_loss_inputs
from rljax.weight_sync import SyncOptions
from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, ShardStager

RECOVERY_METRICS = (
    "recovery/restarts",
    "recovery/failed_restarts",
    "recovery/resubmitted",
    "recovery/seconds",
)


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


class LoopEngine:
    """The leader's VLLMEngine plus the collective parts of a sync, which every process runs.

    `push_weights(params, version)` must be called by every process: the canary's trainer log-probs and
    the host copy of the weights are collectives; only the leader (which holds the engine) pushes.

    Faults: `generate` and `push_weights` run under `call_with_recovery`. A dead or hung server (a
    `RolloutError`/`WeightSyncError`/`ServerError`) is restarted and re-synced to the current weights and
    version, from the host copy of the last pushed weights the leader keeps (no collectives, so the leader
    can recover alone, from any thread), and the call is resubmitted; after `rollout.vllm.max_restarts`
    restarts in a row the call raises `RecoveryExhaustedError`. One recovery runs at a time (a lock shared
    by the loop and the async producer's thread); a caller whose failure predates a recovery that already
    happened just retries. `push_weights` returns the recovery/* counts since the previous push.
    """

    def __init__(
        self,
        engine: VLLMEngine | None,
        model_config,
        canary_logprobs: Callable,
        *,
        max_restarts: int = 0,
        faults: FaultPlan | None = None,
        dtype: str | None = None,
        stager=None,
    ):
        self._engine, self._model_config, self._canary = engine, model_config, canary_logprobs
        self._stager = stager  # multi-process: this process's `ShardStager` (sharded staging)
        self._dtype = dtype  # the serving dtype: params are cast to it on device before staging
        self._max_restarts, self._faults = max_restarts, faults or FaultPlan()
        self._lock = threading.RLock()  # one recovery (or push) at a time
        self._epoch = 0  # recoveries done; a failure seen before the latest one needs no new restart
        self._current: tuple[Any, int] | None = None  # (host copy of the last pushed params, version)
        self._stats: dict[str, float] = dict.fromkeys(RECOVERY_METRICS, 0.0)
        self._stats_lock = threading.Lock()
        self.unpin_cpus: tuple[int, ...] = ()  # set when make_engine pinned this process (host placement)

    def generate(self, prompts, **sampling):
        faults = self._faults.next_call("generate")
        attempt = {"n": 0, "epoch": self._epoch}

        def op():
            attempt["n"], attempt["epoch"] = attempt["n"] + 1, self._epoch
            if attempt["n"] > 1:
                self._count({"recovery/resubmitted": float(len(prompts))})
            if "kill_server_mid_generate" not in faults or attempt["n"] > 1:
                return self._engine.generate(prompts, **sampling)
            done = threading.Event()
            killer = kill_when_running(self._engine.servers, done)
            try:
                out = self._engine.generate(prompts, **sampling)
            finally:
                done.set()
                killer["thread"].join()
                if not killer["killed"]:
                    self._faults.postpone("kill_server_mid_generate")
            if killer["killed"]:  # its last request may have been answered just before the kill landed
                raise RolloutError("RLJAX_FAULTS: the server was killed during this generate call")
            return out

        return self._with_recovery(op, lambda: self._recover_current(attempt["epoch"]), "generate")

    def _with_recovery(self, op: Callable, recover: Callable, what: str):
        stats: dict[str, float] = {}
        try:
            return call_with_recovery(op, recover, self._max_restarts, f"rollout {what}", stats=stats)
        finally:
            self._count(stats)

    def _count(self, stats: dict) -> None:
        with self._stats_lock:
            for k, v in stats.items():
                self._stats[k] = self._stats.get(k, 0.0) + v

    def _drain_stats(self) -> dict:
        with self._stats_lock:
            out, self._stats = self._stats, dict.fromkeys(RECOVERY_METRICS, 0.0)
        return out

    def _recover_current(self, seen_epoch: int) -> bool:
        """Restart + re-push of the last pushed weights and version (False: someone else recovered)."""
        with self._lock:
            if self._epoch != seen_epoch:
                return False
            if self._current is None:  # nothing pushed yet: a restarted server loads the same checkpoint
                self._engine.restart_unhealthy()
                self._engine.syncer.reset()
            else:
                host, version = self._current
                local = jax.device_put(host, jax.local_devices()[0])
                self._engine.recover(
                    models.iter_hf_tensors(self._model_config, local, self._dtype),
                    version,
                    trainer_logprobs=functools.partial(local_logprobs, self._model_config, local),
                )
            self._epoch += 1
            return True

    def _trainer_logprobs(self, params, host) -> Callable:
        if jax.process_count() == 1:
            return SpeculativeCanary(
                self._model_config, params, self._engine.syncer.canary, self._canary(params)
            )
        # the leader alone scores canary tokens, on one local device, from the gathered weights
        return functools.partial(local_logprobs, self._model_config, host)

    def _push_sharded(self, params, version: int) -> dict:
        """Multi-process: every process stages the shards it owns, the leader pushes them all in one
        update, the canary runs the sharded log-prob function (`distributed.push_sharded`)."""

        def push(staged, logprobs) -> dict:
            with self._lock:
                pushed: dict[str, dict] = {}

                def op():
                    if "metrics" in pushed:
                        return pushed["metrics"]
                    return self._engine.push_weights(staged, version, trainer_logprobs=logprobs)

                def recover():
                    pushed["metrics"] = self._engine.recover(staged, version, trainer_logprobs=logprobs)
                    self._epoch += 1

                return self._with_recovery(op, recover, "weight sync")

        self._faults.next_call("sync")  # mid-sync kills are injected in single-process runs only
        metrics = push_sharded(
            params,
            model_config=self._model_config,
            dtype=self._dtype,
            stager=self._stager,
            canary=self._canary,
            push=push if self._engine is not None else None,
        )
        if self._max_restarts > 0:  # a recovery outside a push re-pushes a gathered copy (not the sync path)
            host = host_params(params, self._dtype)
            self._current = (host, version) if self._engine is not None else None
        return metrics | self._drain_stats() if self._engine is not None else {}

    def push_weights(self, params, version: int) -> dict:
        if self._stager is not None and jax.process_count() > 1:
            return self._push_sharded(params, version)
        host = host_params(
            params, self._dtype
        )  # a collective in multi-process runs: every process calls this
        if self._engine is None:
            return {}
        faults = self._faults.next_call("sync")
        logprobs = self._trainer_logprobs(params, host)
        with self._lock:
            pushed: dict[str, dict] = {}
            first = [True]

            def tensors():
                out = models.iter_hf_tensors(self._model_config, host, self._dtype)
                if "kill_server_mid_sync" in faults and first[0]:
                    out = kill_halfway(list(out), self._engine.servers)
                first[0] = False
                return out

            def op():
                if "metrics" in pushed:  # the recovery pushed this version already
                    return pushed["metrics"]
                return self._engine.push_weights(tensors(), version, trainer_logprobs=logprobs)

            def recover():
                pushed["metrics"] = self._engine.recover(tensors(), version, trainer_logprobs=logprobs)
                self._epoch += 1

            metrics = self._with_recovery(op, recover, "weight sync")
            if isinstance(logprobs, SpeculativeCanary):
                metrics["weight_sync/canary_early_forward"] = float(logprobs.answered_early)
            if self._max_restarts > 0:  # the host copy a later recovery re-pushes (params get donated)
                self._current = (host if jax.process_count() > 1 else jax.tree.map(np.array, params), version)
        return metrics | self._drain_stats()

    def metrics(self) -> dict:
        return self._engine.metrics() if self._engine is not None else {}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        if self._stager is not None:
            self._stager.close()
        if self.unpin_cpus:  # the trainer's threads get back the cores they had before the server started
            placement.pin_process(self.unpin_cpus)


def make_engine(cfg: Config, workdir: str, model_config, mesh, data_parallel: int) -> LoopEngine:
    """The configured vLLM servers (`rollout.vllm.num_servers` started, or connected by URL, on the leader);
    logs in `workdir/vllm/replica_<i>/`."""
    canary = make_canary_logprobs(cfg, model_config, mesh, data_parallel)
    vc, ws = cfg.rollout.vllm, cfg.rollout.weight_sync
    stager = None
    if jax.process_count() > 1 and single_host():  # sharded staging: each process writes its own shards
        stager = ShardStager(
            DEFAULT_STAGING_DIR,
            bucket_bytes=ws.bucket_mb * 2**20,
            checksums=ws.checksums,
            spec=models.hf_tensor_specs(model_config, serving_dtype(cfg)),
        )
    if not is_leader():
        return LoopEngine(
            None, model_config, canary, dtype=serving_dtype(cfg), stager=stager, max_restarts=vc.max_restarts
        )
    client = ClientOptions(
        no_progress_timeout_s=vc.no_progress_timeout_s,
        max_retries=vc.max_retries,
        max_in_flight=cfg.rollout.max_in_flight,
    )
    sync = SyncOptions(
        bucket_bytes=ws.bucket_mb * 2**20,
        checksums=ws.checksums,
        canary_tolerance=canary_tolerance(cfg),
        transport=ws.transport,
        tcp_host=ws.tcp_host,
        tcp_timeout_s=ws.tcp_timeout_s,
    )
    place = placement.plan_placement(
        placement.allowed_cpus(),
        vc.placement,
        overlap=cfg.trainer.max_staleness > 0,
        server_on_host=not vc.urls and jax.process_count() == 1,
    )
    if vc.urls:
        token = read_token_file(vc.token_file) if vc.token_file else None  # servers started elsewhere
        engine = VLLMEngine.connect(
            list(vc.urls), cfg.model.path, client_options=client, sync_options=sync, token=token
        )
    else:
        server = options_from_config(cfg, cpus=place.server_cpus)
        engine = VLLMEngine.launch(
            cfg.model.path,
            os.path.join(workdir, "vllm"),
            replicas=vc.num_servers,
            host=vc.host,
            server_options=server,
            client_options=client,
            sync_options=sync,
        )
    loop_engine = LoopEngine(
        engine,
        model_config,
        canary,
        max_restarts=vc.max_restarts,
        faults=FaultPlan.from_env(),
        dtype=serving_dtype(cfg),
        stager=stager,
    )
    if place.trainer_cpus:  # after the server started: its processes keep the cores they were given
        loop_engine.unpin_cpus = placement.allowed_cpus()  # restored by close()
        placement.pin_process(place.trainer_cpus)
    return loop_engine
