"""A weight push delivered off the trainer's thread (async mode): `RolloutEngine.start_push`.

In async mode (`trainer.max_staleness` >= 1) the producer keeps generating from the served version while
the trainer updates, so nothing on the trainer's side needs the new weights served before its next
update. `BackgroundPush.start(snapshot, version)` therefore does on the trainer's thread only what needs
the trainer's arrays (the next update donates them): the snapshot's `keep()`, a host copy of the weights in
the serving dtype (the copy a recovery re-pushes anyway) with the canary's trainer side waited for (its
forward was dispatched when the snapshot was taken). Staging, the pause, the load, the canary's server side,
the version check and any recovery then run on one background thread; `on_served(version)` (the
producer's `set_version`) is called once the servers serve the new version, verified.

One push is in flight at a time: `start` first waits for the previous one and raises its failure (so a
failed push stops the run at the next step at the latest). `wait()` waits for the push in flight (before
an evaluation, and at the last step, so the run ends served). `metrics()` returns the pushes delivered
since its last call, combined by each metric's reduction (`combine_metrics`): in steady state a step
logs the previous step's push.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rljax.metrics.values import combine_metrics

log = logging.getLogger(__name__)


class BackgroundPush:
    """`start(snapshot, version, on_served)`, `wait()`, `metrics()`, `close()`.

    `deliver(snapshot, version) -> metrics`: the engine's verified push of a snapshot, with recovery
    (`rljax.rollout.pushing.WeightPush.push`).
    """

    def __init__(self, deliver: Callable):
        self._deliver = deliver
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rljax-push")
        self._pending: Future | None = None
        self._delivered: list[dict[str, float]] = []

    def start(self, snapshot: Any, version: int, on_served: Callable[[int], None] | None = None) -> None:
        self.wait()
        kept = snapshot.keep()  # host copy and the canary's answers: the next update donates the params
        self._pending = self._pool.submit(self._run, kept, version, on_served)

    def _run(self, snapshot, version: int, on_served) -> dict[str, float]:
        metrics = self._deliver(snapshot, version)
        if on_served is not None:
            on_served(version)
        return metrics

    def wait(self) -> None:
        """Waits for the push in flight (if any); raises its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._delivered.append(pending.result())

    def metrics(self) -> dict[str, float]:
        """weight_sync/* and recovery/* of the pushes delivered since the last call."""
        out, self._delivered = combine_metrics(self._delivered), []
        return out

    def close(self) -> None:
        """Waits for the push in flight (bounded by the sync's own timeouts); logs its failure."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - closing: the run is ending either way
            log.error("the last background weight push failed: %s", e)
        finally:
            self._pool.shutdown(wait=True)
