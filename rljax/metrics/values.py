"""Host-side conversion and combination of metric values (python, numpy or jax scalars; histograms).

A scalar value is anything `np.asarray` turns into one element (python numbers, numpy scalars, 0-d or
one-element jax arrays: converting one copies it to the host). A histogram value is a list/array of counts
indexed by integer value (`counts[k]`), or a dict `{k: count}` with non-negative integer keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax.metrics.schema import lookup

Number = int | float


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What every writer receives for one step: host-side python values only."""

    step: int
    scalars: dict[str, Number]
    hists: dict[str, list[Number]]
    wall_time: float
    eta_s: float | None = None


def to_scalar(value: Any) -> Number:
    """One python int/float from a python, numpy or jax scalar; raises ValueError for several elements."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"expected a scalar, got an array of shape {arr.shape}")
    item = arr.reshape(()).item()
    return int(item) if isinstance(item, (bool, np.bool_)) else item


def to_counts(value: Any) -> list[Number]:
    """Histogram counts as a list indexed by value k = 0..K-1, from a list/array or a `{k: count}` dict.

    Raises ValueError for negative counts, non-integer or negative keys, or a non-1-D array.
    """
    if isinstance(value, Mapping):
        keys = {}
        for k, c in value.items():
            key = int(k) if isinstance(k, str) and k.isdigit() else k
            if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
                raise ValueError(f"histogram keys must be non-negative integers, got {k!r}")
            keys[int(key)] = to_scalar(c)
        counts: list[Number] = [0] * (max(keys) + 1 if keys else 0)
        for k, c in keys.items():
            counts[k] = c
    else:
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"histogram counts must be 1-D, got shape {arr.shape}")
        counts = [to_scalar(c) for c in arr]
    if any(c < 0 for c in counts):
        raise ValueError(f"histogram counts must be non-negative, got {counts}")
    return counts


def is_histogram(name: str, value: Any) -> bool:
    """True for a schema hist metric, or for an unknown name whose value is a dict or a 1-D array."""
    spec = lookup(name)
    if spec is not None:
        return spec.kind == "histogram"
    return isinstance(value, Mapping) or np.ndim(value) == 1


def split_metrics(metrics: Mapping[str, Any]) -> tuple[dict[str, Number], dict[str, list[Number]]]:
    """Converts a metrics dict on the host into (scalars, histograms), both plain python."""
    scalars: dict[str, Number] = {}
    hists: dict[str, list[Number]] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric names must be non-empty strings, got {name!r}")
        if is_histogram(name, value):
            hists[name] = to_counts(value)
        else:
            try:
                scalars[name] = to_scalar(value)
            except ValueError as err:
                raise ValueError(f"metric {name!r}: {err}") from None
    return scalars, hists


def _combine(reduction: str, values: list[Any]) -> Any:
    if reduction == "hist":
        counts = [to_counts(v) for v in values]
        out = [0] * max(len(c) for c in counts)
        for c in counts:
            for k, n in enumerate(c):
                out[k] += n
        return out
    nums = [to_scalar(v) for v in values]
    if reduction == "max":
        return max(nums)
    if reduction == "min":
        return min(nums)
    if reduction == "sum":
        return sum(nums)
    if reduction == "last":
        return nums[-1]
    return float(np.mean(nums))  # mean, ratio and std: averaged (std of equal-size parts: approximate)


def combine_metrics(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Combines several metric dicts of one step (e.g. one per minibatch) by each name's reduction.

    Names missing from some parts are combined over the parts that have them. Unknown names are averaged.
    Example: combine_metrics([{"loss/total": 1.0, "is/weight_max": 2.0}, {"loss/total": 3.0,
    "is/weight_max": 5.0}]) == {"loss/total": 2.0, "is/weight_max": 5.0}.
    """
    names: dict[str, list[Any]] = {}
    for part in parts:
        for name, value in part.items():
            names.setdefault(name, []).append(value)
    out = {}
    for name, values in names.items():
        spec = lookup(name)
        out[name] = _combine(spec.reduction if spec else "mean", values)
    return out
