"""The reward registry and name resolution (built-in names or "package.module:function")."""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from rljax.registry import Registry


class RewardFn(Protocol):
    """One completion's scalar reward. Extra keyword options come from the reward spec."""

    def __call__(self, *, prompt: str, completion: str, example: dict[str, Any], **options: Any) -> float: ...


REWARDS: Registry[RewardFn] = Registry("reward function")
Range = tuple[float, float]
UNBOUNDED: Range = (-math.inf, math.inf)
_F = TypeVar("_F")


def declare_range(bounds: Range | Callable[[dict[str, Any]], Range]) -> Callable[[_F], _F]:
    """Decorator declaring a reward's range: (lo, hi), or a function of the call's options (the reward's
    keyword defaults filled in) returning (lo, hi). The pool clamps every value into it and counts those
    outside; failures (exceptions, timeouts, NaN/inf) score `lo`. Undeclared rewards are UNBOUNDED."""

    def decorator(fn: _F) -> _F:
        fn.reward_range = bounds  # type: ignore[attr-defined]
        return fn

    return decorator


def reward_range(fn: Any, options: dict[str, Any]) -> Range:
    """The declared (lo, hi) of `fn` called with `options`; raises ValueError for an invalid range."""
    bounds = getattr(fn, "reward_range", UNBOUNDED)  # the one default for undeclared (custom) rewards
    if callable(bounds):
        try:
            bound = inspect.signature(fn).bind_partial(**options)
        except TypeError as e:
            raise ValueError(f"reward {fn!r}: options {sorted(options)} do not fit its signature: {e}") from e
        bound.apply_defaults()
        bounds = bounds(dict(bound.arguments))
    lo, hi = float(bounds[0]), float(bounds[1])
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"reward {fn!r}: invalid range ({lo}, {hi})")
    return lo, hi


def failure_score(bounds: Range) -> float:
    """What a failed call (exception, timeout, NaN, non-number) scores: the range's minimum, or 0.0 for a
    range unbounded below (clipped into the range)."""
    lo, hi = bounds
    return lo if math.isfinite(lo) else min(max(0.0, lo), hi)


def clamp(value: float, bounds: Range) -> tuple[float, bool]:
    """(value clipped into bounds, whether it was outside)."""
    lo, hi = bounds
    clipped = min(max(value, lo), hi)
    return clipped, clipped != value


def resolve(name: str) -> RewardFn:
    """Returns the reward registered as `name`, or imports "package.module:function".

    Raises ValueError naming the spec when the module cannot be imported, the attribute is missing or
    not callable; a plain unknown name raises KeyError listing the registered rewards.
    """
    if ":" not in name:
        return REWARDS.get(name)
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"custom reward {name!r} must have the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"custom reward {name!r}: cannot import module {module_name!r}: {e}") from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"custom reward {name!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"custom reward {name!r}: {attr!r} is not callable")
    return target


def check_value(value: Any) -> tuple[float | None, str | None, str]:
    """(float value, None, "") for a finite real number, else (None, "type" | "nonfinite", message)."""
    if isinstance(value, str | bytes | complex) or not isinstance(value, numbers.Real):
        return None, "type", f"reward returned {type(value).__name__}, not a real number: {value!r:.80}"
    result = float(value)
    if not math.isfinite(result):
        return None, "nonfinite", f"reward returned {result}"
    return result, None, ""


def call_reward(
    fn: Any, options: dict[str, Any], item: dict[str, Any]
) -> tuple[float | None, str | None, str]:
    """Calls one reward on one item; exceptions become ("exception", message)."""
    try:
        value = fn(prompt=item["prompt"], completion=item["completion"], example=item["example"], **options)
    except Exception as e:  # noqa: BLE001 - any failure of user code scores 0 and is counted
        return None, "exception", f"{type(e).__name__}: {e}"
    return check_value(value)
