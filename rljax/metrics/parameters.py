"""The parameter table at start-up (`clu.parameter_overview`): name, shape, dtype, size and sharding of
every parameter, with the total count and bytes; printed and written to `workdir/parameters.txt`.

Reads only metadata (shapes, dtypes, shardings): nothing is gathered or copied to the host, so it is
safe on a sharded multi-host model, and each process can call it on its own.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from clu import parameter_overview  # parameter_overview needs no TensorFlow (metric_writers would)

FILENAME = "parameters.txt"


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flat_parameters(params: Any) -> dict[str, Any]:
    """{"a/b/c": leaf} for any pytree of arrays (nested dicts, flax NNX states: the `.value` of each
    NNX Variable is left out of its name); the leaves themselves are untouched."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [_key_name(k) for k in path]
        if len(names) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
            names = names[:-1]
        out["/".join(names)] = leaf
    return out


def parameter_table(params: Any) -> str:
    """clu's table (columns Name, Shape, Dtype, Size, Sharding; the sharding is the PartitionSpec over
    the mesh axes) followed by `Total: <count> -- <bytes> bytes`."""
    return parameter_overview.get_parameter_overview(flat_parameters(params), include_stats="sharding")


def write_parameter_overview(params: Any, workdir: str) -> str:
    """Writes `parameter_table(params)` to `workdir/parameters.txt` and returns it."""
    table = parameter_table(params)
    with open(os.path.join(workdir, FILENAME), "w") as f:
        f.write(table + "\n")
    return table
