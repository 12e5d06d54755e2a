"""Async rollouts: batch j+1 is generated while step j trains, never staler than `trainer.max_staleness`.

A producer thread generates the batch for step j once the served policy version is >= j - max_staleness
(version v = the weights after v updates), and the trainer serves v + 1 only after that batch (j = v +
max_staleness) is generated: batch j comes from policy j - max_staleness exactly, not from thread
timing. Generation and weight sync exclude each other through the engine's policy gate, so every
sample is tagged with exactly one version. `snapshot()` waits for the
batch in flight, then returns the buffered (generated, not yet trained on) batches together with the
data position, so a checkpoint resumes exactly; `restore()` puts them back.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from rljax.trajectory import Group, Trajectory


def group_to_json(g: Group) -> dict:
    return {
        "example": g.example,
        "trajectories": [dataclasses.asdict(t) for t in g.trajectories],
        "per_fn": {k: [float(x) for x in v] for k, v in g.per_fn.items()},
    }


def group_from_json(d: dict) -> Group:
    trajs = [
        Trajectory(**{k: (list(v) if isinstance(v, list) else v) for k, v in t.items()})
        for t in d["trajectories"]
    ]
    return Group(d["example"], trajs, {k: np.asarray(v, np.float32) for k, v in d["per_fn"].items()})


class AsyncProducer:
    """Background rollout generation bounded by staleness. `produce(step) -> (groups, metrics)`."""

    def __init__(
        self,
        produce: Callable,
        *,
        start_step: int,
        max_staleness: int,
        version: int,
        data_state: Callable[[], dict],
    ):
        self._produce, self._data_state = produce, data_state
        self._k = max_staleness
        self._cv = threading.Condition()
        self._version = version
        self._next = start_step  # the next step to generate for
        self._buffer: dict[int, tuple[list[Group], dict]] = {}
        self._busy = self._hold = self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="rljax-rollout", daemon=True)

    def start(self) -> AsyncProducer:
        self._thread.start()
        return self

    def set_version(self, version: int) -> None:
        """Called after each weight sync: lets the producer run up to `version + max_staleness`."""
        with self._cv:
            self._version = version
            self._cv.notify_all()

    def await_generator_of(self, version: int) -> None:
        """Before `version` is served: waits until the last batch its predecessor may generate (step
        version - 1 + max_staleness) is generated, so a push never overtakes a batch that has not
        started. Batch j then always comes from policy max(j - max_staleness, the start's), whatever the
        threads' timing: runs and their resumes train on the same samples (checked bitwise)."""
        with self._cv:
            self._cv.wait_for(
                lambda: self._next >= version + self._k or self._closed or self._error is not None
            )

    def _may_generate(self) -> bool:
        ahead = self._next - self._version  # staleness the next batch would have when trained on
        return not (self._hold or self._closed) and ahead <= self._k

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._may_generate())
                if self._closed:
                    return
                step, self._busy = self._next, True
            try:
                result = self._produce(step)
            except BaseException as e:  # surfaced by take(); the loop stops producing
                with self._cv:
                    self._error, self._busy = e, False
                    self._cv.notify_all()
                return
            with self._cv:
                self._buffer[step] = result
                self._next, self._busy = step + 1, False
                self._cv.notify_all()

    def take(self, step: int) -> tuple[list[Group], dict]:
        """The batch for `step` (blocks until generated); re-raises a producer failure."""
        with self._cv:
            self._cv.wait_for(lambda: step in self._buffer or self._error is not None)
            if step not in self._buffer:
                raise RuntimeError(f"async rollout producer failed: {self._error}") from self._error
            groups, metrics = self._buffer.pop(step)
            self._cv.notify_all()
        return groups, dict(metrics)

    def snapshot(self) -> dict:
        """{buffer, next_step, data}: consistent with each other (waits for the batch in flight)."""
        with self._cv:
            self._hold = True
            self._cv.wait_for(lambda: not self._busy)
            try:
                return {
                    "buffer": [
                        {"step": s, "groups": [group_to_json(g) for g in gs], "metrics": _json_metrics(m)}
                        for s, (gs, m) in sorted(self._buffer.items())
                    ],
                    "next_step": self._next,
                    "data": self._data_state(),
                }
            finally:
                self._hold = False
                self._cv.notify_all()

    def restore(self, snapshot: dict) -> None:
        """Puts back the buffered batches of a snapshot (call before `start`)."""
        for item in snapshot["buffer"]:
            self._buffer[int(item["step"])] = ([group_from_json(g) for g in item["groups"]], item["metrics"])
        self._next = int(snapshot["next_step"])

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=600)


def _json_metrics(m: dict) -> dict:
    return {k: (v if isinstance(v, list) else float(v)) for k, v in m.items()}
