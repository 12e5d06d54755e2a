"""The reward registry and name resolution (built-in names or "package.module:function")."""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, Protocol

from rljax.registry import Registry


class RewardFn(Protocol):
    """One completion's scalar reward. Extra keyword options come from the reward spec."""

    def __call__(self, *, prompt: str, completion: str, example: dict[str, Any], **options: Any) -> float: ...


REWARDS: Registry[RewardFn] = Registry("reward function")


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
