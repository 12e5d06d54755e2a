"""The trainer's weights as values the rollout engine pushes: one type per kind of push, chosen once.

    snapshot = weights.snapshot(params)          # rljax.loop.engine: JaxWeights or ShardedJaxWeights
    with snapshot:
        metrics = engine.push_weights(snapshot, version)

A snapshot is taken on the trainer's side (params cast to the serving dtype, the canary's trainer side
started or computed), then handed to `RolloutEngine.push_weights` as a value: the engine pushes it
(`snapshot.push(syncer, version)`, one attempt), keeps a copy for a recovery's re-push (`keep()`), and
nothing calls back into the loop. `with snapshot:` ends the push on the trainer's side (a sharded push's
"push over" barrier and bucket clean-up; nothing for one process).

- `JaxSnapshot` (one process): the params in the serving dtype, converted to the engine's names and
  layouts one tensor at a time while the syncer stages them (`WeightSyncer.push_weights`);
- `StagedSnapshot` (a multi-process job): the buckets every process staged already (`rljax.loop.
  sharded_sync.stage_sharded`, `WeightSyncer.push_staged`); streamed (tcp/zmq: each process serves its
  own buckets) or mapped (shm) as `rollout.weight_sync.transport` chose when the weights were built.
- `AdapterSnapshot` (a LoRA run, `model.lora_rank > 0`): the adapter alone as PEFT tensors on the host,
  pushed as a new runtime-loaded adapter (`weight_sync.adapters.AdapterPublisher.publish`).
Each carries `CanaryAnswers`, the canary's trainer side of this version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rljax import models
from rljax.config import FP8_SERVING
from rljax.weight_sync import fp8
from rljax.weight_sync.canary import CanarySpec
from rljax.weight_sync.staging import StagedBuckets
from rljax.weight_sync.syncer import WeightSyncError


def question_key(prompt_ids, completion_ids) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A canary question as a hashable key (lists, tuples and arrays of the same tokens: one key)."""
    return tuple(int(t) for t in prompt_ids), tuple(int(t) for t in completion_ids)


def spec_key(spec: CanarySpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return question_key(spec.prompt_ids, spec.completion_ids)


class CanaryAnswers:
    """The canary's trainer side of one snapshot: `self(prompt_ids, completion_ids) -> f32[C]`.

    `pending`: `{question_key: wait}`, answers started when the snapshot was taken (`wait()` returns
    f32[C]: a dispatched forward, or an answer computed already); `scorer` (None: none) scores any other
    question. `frozen()`: the answers alone, waited for: a recovery's re-push is checked against the
    push's own answers (no forward; the sharded scorer is a collective the other processes no longer
    join), and a question the push did not see fails the check.
    """

    def __init__(self, pending: dict, scorer: Callable | None = None):
        self._pending, self._answers, self._scorer = dict(pending), {}, scorer

    def __call__(self, prompt_ids, completion_ids) -> np.ndarray:
        key = question_key(prompt_ids, completion_ids)
        if key not in self._answers:
            if key in self._pending:
                self._answers[key] = np.asarray(self._pending.pop(key)())
            elif self._scorer is None:
                raise WeightSyncError("canary: the re-pushed weights answered a prompt the push did not see")
            else:
                self._answers[key] = np.asarray(self._scorer(prompt_ids, completion_ids))
        return self._answers[key]

    def frozen(self) -> CanaryAnswers:
        for key in list(self._pending):
            self(*key)
        return CanaryAnswers({k: (lambda v=v: v) for k, v in self._answers.items()})


class _NoEnd:
    """A snapshot that needs nothing at the end of its push (one process)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class JaxSnapshot(_NoEnd):
    """One process's params in the serving dtype (`cast_params`), on device until `keep`."""

    model_config: Any
    host: Any
    dtype: str | None
    logprobs: CanaryAnswers  # the training path's canary answers of this version

    def tensors(self):
        """`(hf_name, array)` in the serving layout and dtype, converted one tensor at a time."""
        if self.dtype == FP8_SERVING:
            return fp8.fp8_tensors(models.iter_hf_tensors(self.model_config, self.host, "float32"))
        return models.iter_hf_tensors(self.model_config, self.host, self.dtype)

    def push(self, syncer, version: int) -> dict:
        return syncer.push_weights(self.tensors(), version, self.logprobs)

    def keep(self) -> JaxSnapshot:
        """A host copy of the weights (the next update donates the device arrays) and the canary's
        answers of this version (waited for here: async mode's trainer side)."""
        host = jax.tree.map(lambda x: np.array(x) if isinstance(x, jax.Array) else x, self.host)
        return JaxSnapshot(self.model_config, host, self.dtype, self.logprobs.frozen())


@dataclasses.dataclass(frozen=True)
class StagedSnapshot:
    """A multi-process job's version: the buckets every process staged (`staged`; None on the other
    processes, which push nothing), the canary's answers (computed by every process together when the
    snapshot was taken) and the leader's staging metrics. `end(pushed)`: the push's end on this process
    (`sharded_sync.PushEnd`: the "push over" barrier, then its bucket files), run by `with snapshot:`."""

    staged: StagedBuckets | None
    logprobs: CanaryAnswers
    metrics: dict
    end: Callable[[bool], None] | None = None

    def push(self, syncer, version: int) -> dict:
        return syncer.push_staged(self.staged, version, self.logprobs) | self.metrics

    def keep(self) -> StagedSnapshot:
        # the files (and their servers) stay until the next push; a re-push does not wait on the others
        staged = dataclasses.replace(self.staged, wait_sent=None)
        return StagedSnapshot(staged, self.logprobs.frozen(), self.metrics)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        if self.end is not None:
            self.end(kind is None)


@dataclasses.dataclass(frozen=True)
class AdapterSnapshot(_NoEnd):
    """A LoRA run's version: the adapter as PEFT tensors on the host (`tensors`, `config`: the
    `adapter_config.json`), pushed through the engine's `weight_sync.adapters.AdapterPublisher` (a new
    runtime-loaded adapter per version), and the canary's answers of the base plus this adapter."""

    tensors: dict
    config: dict
    logprobs: CanaryAnswers

    def push(self, adapters, version: int) -> dict:
        return adapters.publish(self.tensors, self.config, version, logprobs=self.logprobs)

    def keep(self) -> AdapterSnapshot:
        return AdapterSnapshot(self.tensors, self.config, self.logprobs.frozen())  # host arrays already
