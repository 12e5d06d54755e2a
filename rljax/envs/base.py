"""The environment protocol and the timeout helpers every step goes through.

An environment is a small state machine over text: `reset(example)` returns the first observation (the
prompt, possibly ending in a prefilled assistant turn), `step(action)` takes the text of one model turn
and returns a `StepResult`. The multi-turn driver (`rljax.envs.driver`) owns the tokens; environments only
see and produce text, so the token history is never rebuilt from text.

Steps run in daemon threads with a deadline (`call_with_timeout`, `astep` for asyncio callers): a step
that hangs is abandoned, not waited for. Abandoning a thread cannot stop it, so anything that can really
hang or burn CPU (untrusted code) must also bound itself, as the Python tool does with its sandbox.
The verdict on an episode's final answer is not computed in a step at all: the step hands its text over
(`StepResult.grade`) and the driver scores it in the reward pool, where a grader that hangs is killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one `step` returns: `observation` text to append (ignored when `done`), the step's reward,
    whether the episode ended, `info` (keys used by the driver: "tool", "tool_status"), and `grade`: the
    final answer's text, which the driver has the run's reward functions score in the reward pool's
    worker processes (killed at `reward.timeout_s`) once the episodes end, never in the step's thread."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    grade: str | None = None


class Environment(Protocol):
    """One episode at a time; a fresh instance per episode (the driver calls the factory)."""

    def reset(self, example: dict[str, Any]) -> str:
        """The first observation for `example`: the full prompt text."""
        ...

    def step(self, action: str) -> StepResult:
        """Consumes one model turn (decoded with special tokens kept, e.g. `</tool_call>`)."""
        ...


class StepTimeout(TimeoutError):
    """A call passed its deadline; the thread running it was abandoned."""


def submit_in_thread(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """Runs `fn(*args)` in a new daemon thread (so a hung call never blocks interpreter exit)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001  (handed to the caller through the future)
            future.set_exception(e)

    threading.Thread(target=target, daemon=True, name=f"rljax-env-{getattr(fn, '__name__', 'call')}").start()
    return future


def call_with_timeout(fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
    """`fn(*args)`, or StepTimeout after `timeout_s` seconds; exceptions of `fn` propagate."""
    future = submit_in_thread(fn, *args)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise StepTimeout(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout_s} s") from None


async def astep(env: Environment, action: str, *, timeout_s: float) -> StepResult:
    """`env.step(action)` for asyncio callers, off the event loop, with a deadline (StepTimeout)."""
    future = asyncio.wrap_future(submit_in_thread(env.step, action))
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        raise StepTimeout(f"env step did not return within {timeout_s} s") from None
