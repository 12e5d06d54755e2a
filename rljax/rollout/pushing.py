"""The engine's weight push: a snapshot of the trainer's weights in, verified and served, metrics out.

    snapshot = weights.snapshot(params)            # the trainer's side: rljax.loop.snapshots, or HostWeights
    metrics = engine.push_weights(snapshot, version)   # `WeightPush.push`

A `Snapshot` is one version of the policy's weights, taken by its weights object and pushed as a value: its
type says how (host tensors the syncer stages, `WeightSyncer.push_weights`; buckets every trainer process
staged already, `push_staged`), and it carries the canary's trainer side of that version. `push_verified`
is one attempt: the snapshot through the syncer (stage, pause, load, finish as `version`, canary, resume),
then every server must serve `version`: vLLM publishes the version `finish_weight_update` was given, and
only when the update finished (`/weight_info`, the engine core's weight version). `WeightPush` adds
recovery (`rljax.rollout.recovery.Recovery`) and keeps each pushed version for a later re-push.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol

from rljax.weight_sync.canary import TrainerLogprobs
from rljax.weight_sync.syncer import WeightSyncer, WeightSyncError


class Snapshot(Protocol):
    """One version of the policy's weights, as the engine pushes it."""

    def push(self, syncer: WeightSyncer, version: int) -> dict[str, float]:
        """Pushes these weights through `syncer` as policy `version` (a fresh push on every call)."""

    def keep(self) -> Snapshot:
        """A copy that outlives the trainer's arrays (the next update donates them) and answers the
        canary as this one did: what a recovery re-pushes, and what async mode delivers."""


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
    """Hugging Face tensors on the host in the serving layout and dtype (`items`, re-iterable `(hf_name,
    array)` such as `state_dict.items()`, or the syncer's other item forms) and the canary's trainer side
    (`logprobs(prompt_ids, completion_ids) -> f32[C]`)."""

    items: Iterable[tuple]
    logprobs: TrainerLogprobs

    def tensors(self) -> Iterable[tuple]:
        return iter(self.items)

    def push(self, syncer: WeightSyncer, version: int) -> dict[str, float]:
        return syncer.push_weights(self.tensors(), version, self.logprobs)

    def keep(self) -> HostSnapshot:
        return HostSnapshot(list(self.items), self.logprobs)  # host arrays the caller does not donate


@dataclasses.dataclass(frozen=True)
class HostWeights:
    """Weights held as host tensors (tests, notebooks, benchmarks): `snapshot(items) -> HostSnapshot` with
    `logprobs` as the canary's trainer side (e.g. a transformers reference holding the same weights)."""

    logprobs: TrainerLogprobs

    def snapshot(self, items: Iterable[tuple]) -> HostSnapshot:
        return HostSnapshot(items, self.logprobs)


def push_verified(syncer: WeightSyncer, snapshot: Snapshot, version: int) -> dict[str, float]:
    """One push of `snapshot` as `version` (recovery repeats it); then every server must serve `version`."""
    metrics = snapshot.push(syncer, version)
    for url in syncer.urls:
        served = syncer.server_version(url)
        if served != str(version):
            raise WeightSyncError(f"{url} serves weight version {served!r} after pushing {version}")
    return metrics


class WeightPush:
    """`push(snapshot, version) -> metrics`: `push_verified` with recovery (`recovery`, a
    `rljax.rollout.recovery.Recovery` over the same syncer); returns weight_sync/* and the recovery/*
    counts since the previous push. Raises WeightSyncError (no recovery) or RecoveryExhaustedError."""

    def __init__(self, syncer: WeightSyncer, recovery):
        self.syncer, self.recovery = syncer, recovery

    def push(self, snapshot: Snapshot, version: int) -> dict[str, float]:
        recovery = self.recovery
        with recovery.lock:
            pushed: dict[str, dict] = {}

            def op():  # after a recovery that pushed this version already: done
                return pushed["metrics"] if "metrics" in pushed else self.attempt(snapshot, version)

            def recover():
                recovery.restart_unhealthy()
                pushed["metrics"] = self.attempt(snapshot, version)
                recovery.recovered()

            metrics = recovery.call(op, recover, "weight sync")
            recovery.remember(snapshot, version)
        return metrics | recovery.drain()

    def attempt(self, snapshot: Snapshot, version: int) -> dict[str, float]:
        """One verified push, no recovery (`push_verified`)."""
        return push_verified(self.syncer, snapshot, version)
