"""Length-based shaping: a linear length penalty and DAPO's soft overlong punishment.

Lengths are counted in `unit`: "chars" (default), "words", or "tokens", which reads the integer
`example[length_key]` (the loop can put the completion's token count there, e.g. "num_completion_tokens").
"""

from __future__ import annotations

import math
from typing import Any

from rljax.rewards.base import REWARDS, declare_range


def completion_length(completion: str, example: dict[str, Any], unit: str, length_key: str) -> int:
    """Length of a completion in `unit` ("chars", "words" or "tokens" = int(example[length_key]))."""
    if unit == "chars":
        return len(completion)
    if unit == "words":
        return len(completion.split())
    if unit == "tokens":
        if length_key not in example:
            raise KeyError(f"unit='tokens' needs example[{length_key!r}]; example has {sorted(example)}")
        return int(example[length_key])
    raise ValueError(f"unknown length unit {unit!r}; valid: chars, words, tokens")


def _length_penalty_range(o: dict[str, Any]) -> tuple[float, float]:
    floor = -math.inf if o["max_penalty"] is None else -o["max_penalty"]  # max(value, floor)
    if o["coef"] >= 0:  # value = -coef * excess <= 0
        return min(floor, max(0.0, floor)), max(0.0, floor)
    return max(0.0, floor), math.inf


@REWARDS.register("length_penalty")
@declare_range(_length_penalty_range)
def length_penalty(
    *,
    prompt: str,
    completion: str,
    example: dict[str, Any],
    coef: float = 1e-3,
    target: int = 0,
    max_penalty: float | None = None,
    unit: str = "chars",
    length_key: str = "num_completion_tokens",
) -> float:
    """-coef * max(0, L - target), floored at -max_penalty when given (L = completion length in `unit`).

    References: linear length penalties as in Kimi k1.5 (Kimi Team 2025, arXiv:2501.12599), without
    its per-group normalisation (this reward sees one completion).
    """
    length = completion_length(completion, example, unit, length_key)
    value = -coef * max(0, length - target)
    return value if max_penalty is None else max(value, -max_penalty)


@REWARDS.register("overlong")
@declare_range(lambda o: (min(0.0, -o["penalty"]), max(0.0, -o["penalty"])))
def overlong_penalty(
    *,
    prompt: str,
    completion: str,
    example: dict[str, Any],
    max_length: int,
    buffer: int,
    penalty: float = 1.0,
    unit: str = "tokens",
    length_key: str = "num_completion_tokens",
) -> float:
    """Soft overlong punishment: 0 up to max_length - buffer, then linear down to -penalty at max_length
    and -penalty beyond it.

        r(L) = 0                                   if L <= max_length - buffer
             = penalty * (max_length - buffer - L) / buffer   if max_length - buffer < L <= max_length
             = -penalty                            if L > max_length

    References: DAPO (Yu et al. 2025, arXiv:2503.14476), Eq. 13.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong needs 0 < buffer <= max_length, got {buffer=}, {max_length=}")
    length = completion_length(completion, example, unit, length_key)
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return penalty * (start - length) / buffer
    return -penalty
