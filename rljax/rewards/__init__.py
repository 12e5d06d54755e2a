"""Rewards and verifiers: the `REWARDS` registry, custom "package.module:function" rewards, the sandbox
and the `RewardPool` that scores batches in isolated worker processes.

Built in: math, format, length_penalty, overlong, code, countdown. Signature of every reward:
`fn(*, prompt: str, completion: str, example: dict, **options) -> float`.
"""

from rljax.rewards import code, countdown, math_verify, penalties  # noqa: F401  (registers the built-ins)
from rljax.rewards.base import REWARDS, RewardFn, resolve
from rljax.rewards.pool import RewardPool
from rljax.rewards.sandbox import SandboxError, SandboxResult, SandboxUnavailable, run_python, sandbox_info

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardPool",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
    "resolve",
    "run_python",
    "sandbox_info",
]
