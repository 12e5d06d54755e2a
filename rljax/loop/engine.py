"""The loop's rollout engine: vLLM servers (owned or connected) with the trainer-side canary bound in.

`make_engine(cfg, workdir, model_config, mesh)` returns an object with `generate(prompt_ids, **sampling)`,
`push_weights(params, version)` and `close()`; `push_weights` converts the params to the engine's names
and layouts (`rljax.models.iter_hf_tensors`) and verifies the sync with the canary, whose trainer-side
log-probs come from the same `token_logprobs` path the update uses, on the same params.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from rljax import models, trainer
from rljax.config import Config
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
    return np.asarray(logp)[0, start : start + len(completion_ids)]


class LoopEngine:
    """A VLLMEngine whose `push_weights` always runs the canary with the trainer's log-probs."""

    def __init__(self, engine: VLLMEngine, model_config, canary_logprobs: Callable):
        self._engine, self._model_config, self._canary = engine, model_config, canary_logprobs

    def generate(self, prompts, **sampling):
        return self._engine.generate(prompts, **sampling)

    def push_weights(self, params, version: int) -> dict:
        tensors = models.iter_hf_tensors(self._model_config, params)
        return self._engine.push_weights(tensors, version, trainer_logprobs=self._canary(params))

    def recover(self, params, version: int) -> dict:
        tensors = models.iter_hf_tensors(self._model_config, params)
        return self._engine.recover(tensors, version, trainer_logprobs=self._canary(params))

    def metrics(self) -> dict:
        return self._engine.metrics()

    def close(self) -> None:
        self._engine.close()


def make_engine(cfg: Config, workdir: str, model_config, mesh, data_parallel: int) -> LoopEngine:
    """Starts (or connects to) the configured vLLM servers; server logs go to `workdir/vllm/`."""
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
    canary = make_canary_logprobs(cfg, model_config, mesh, data_parallel)
    return LoopEngine(engine, model_config, canary)
