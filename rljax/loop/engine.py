"""The loop's rollout engine: vLLM servers (owned or connected) with the trainer-side canary bound in.

`make_engine(cfg, workdir, model_config, mesh)` returns an object with `generate(prompt_ids, **sampling)`,
`push_weights(params, version)` and `close()`; `push_weights` converts the params to the engine's names
and layouts (`rljax.models.iter_hf_tensors`) and verifies the sync with the canary, whose trainer-side
log-probs come from the same `token_logprobs` path the update uses, on the same params.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax import kernels, models, trainer
from rljax.config import Config
from rljax.loop.distributed import host_params, is_leader, to_host
from rljax.loop.trajectory import Trajectory, build_loss_inputs
from rljax.rollout import ClientOptions, ServerOptions, VLLMEngine
from rljax.weight_sync import SyncOptions


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
    """

    def __init__(self, engine: VLLMEngine | None, model_config, canary_logprobs: Callable):
        self._engine, self._model_config, self._canary = engine, model_config, canary_logprobs

    def generate(self, prompts, **sampling):
        return self._engine.generate(prompts, **sampling)

    def _verified_push(self, push: Callable, params, version: int) -> dict:
        host = host_params(params)  # a collective in multi-process runs: every process calls this
        if self._engine is None:
            return {}
        if jax.process_count() == 1:
            trainer_logprobs = self._canary(params)
        else:  # the leader alone scores canary tokens, on one local device, from the gathered weights
            trainer_logprobs = functools.partial(local_logprobs, self._model_config, host)
        return push(
            models.iter_hf_tensors(self._model_config, host), version, trainer_logprobs=trainer_logprobs
        )

    def push_weights(self, params, version: int) -> dict:
        return self._verified_push(self._engine.push_weights if self._engine else None, params, version)

    def recover(self, params, version: int) -> dict:
        return self._verified_push(self._engine.recover if self._engine else None, params, version)

    def metrics(self) -> dict:
        return self._engine.metrics() if self._engine is not None else {}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def make_engine(cfg: Config, workdir: str, model_config, mesh, data_parallel: int) -> LoopEngine:
    """The configured vLLM servers (started or connected, on the leader); logs in `workdir/vllm/`."""
    canary = make_canary_logprobs(cfg, model_config, mesh, data_parallel)
    if not is_leader():
        return LoopEngine(None, model_config, canary)
    vc, ws = cfg.rollout.vllm, cfg.rollout.weight_sync
    client = ClientOptions(request_timeout_s=vc.request_timeout_s, max_retries=vc.max_retries)
    sync = SyncOptions(
        bucket_bytes=ws.bucket_mb * 2**20, checksums=ws.checksums, canary_tolerance=ws.canary_tolerance
    )
    if vc.urls:
        engine = VLLMEngine.connect(list(vc.urls), cfg.model.path, client_options=client, sync_options=sync)
    else:
        server = ServerOptions(
            dtype=cfg.model.param_dtype,
            max_model_len=vc.max_model_len,
            gpu_memory_utilization=vc.gpu_memory_utilization,
            kvcache_space_gib=vc.kvcache_space_gib,
            seed=cfg.trainer.seed,
            startup_timeout_s=vc.startup_timeout_s,
            extra_args=tuple(vc.extra_args),
        )
        engine = VLLMEngine.launch(
            cfg.model.path,
            os.path.join(workdir, "vllm"),
            host=vc.host,
            server_options=server,
            client_options=client,
            sync_options=sync,
        )
    return LoopEngine(engine, model_config, canary)
