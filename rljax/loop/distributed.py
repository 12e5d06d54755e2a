"""Multi-process helpers for the host loop (one JAX process per GPU or host, no Ray).

Process 0 (the leader) owns the rollout engine, the reward workers, evaluation and the writers; every
process runs the sharded update. The leader's batch reaches the others with `broadcast_tree`, and the
weights pushed to the engine are gathered to host numpy with `host_params` (collectives: every process
must call them at the same point). In a single-process run all of these are cheap no-ops.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_tree(tree: Any | None, like: Any | None = None) -> Any:
    """The leader's pytree of numpy arrays on every process. Non-leaders pass `None` and a `like` tree
    with the structure (shapes may differ: they are broadcast first)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    template = tree if is_leader() else like
    leaves, treedef = jax.tree.flatten(template)
    ndims = [np.ndim(x) for x in leaves]
    shapes = np.zeros((len(leaves), max(ndims + [1])), np.int64)
    if is_leader():
        for i, x in enumerate(leaves):
            shapes[i, : np.ndim(x)] = np.shape(x)
    shapes = np.asarray(multihost_utils.broadcast_one_to_all(shapes))
    local = [
        np.asarray(x) if is_leader() else np.zeros(tuple(shapes[i, : ndims[i]]), np.asarray(x).dtype)
        for i, x in enumerate(leaves)
    ]
    out = multihost_utils.broadcast_one_to_all(local)
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in out])


def host_params(params: Any) -> Any:
    """Params as fully addressable host values: the arrays themselves in one process (converted lazily,
    one tensor at a time, by the weight sync), a gathered numpy copy per process otherwise."""
    if jax.process_count() == 1:
        return params
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(params, tiled=True)


def to_host(x: Any) -> np.ndarray:
    """A (possibly multi-process, sharded) array as numpy on every process."""
    if jax.process_count() == 1 or getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def barrier(name: str) -> None:
    """All processes reach this point before any goes on (e.g. before exiting for a requeue)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
