"""Multi-turn, tool-using rollout environments (token in / token out).

`ENVS` maps `rollout.env` names to `EnvSpec`s whose `generate_groups(sampler, examples, seed)` has the
contract of `rljax.loop.rollout_phase.generate_groups`. Built in: calculator_math (the expression is
prefilled: the model closes the call, then answers), calculator_math_open (only the call's opening is
prefilled: the model writes the expression), python_math (the same task through the Python sandbox).
"""

from rljax.envs import math_env  # noqa: F401  (registers the built-in environments)
from rljax.envs.base import Environment, StepResult, StepTimeout, astep, call_with_timeout
from rljax.envs.driver import ENVS, EnvSpec, EpisodeLimits, generate_multi_turn_groups
from rljax.envs.parsing import MalformedCall, ToolCall, format_tool_call, parse_tool_call
from rljax.envs.tools import TOOLS, ToolError, ToolOutcome, calculate, run_tool

__all__ = [
    "ENVS",
    "TOOLS",
    "EnvSpec",
    "Environment",
    "EpisodeLimits",
    "MalformedCall",
    "StepResult",
    "StepTimeout",
    "ToolCall",
    "ToolError",
    "ToolOutcome",
    "astep",
    "calculate",
    "call_with_timeout",
    "format_tool_call",
    "generate_multi_turn_groups",
    "parse_tool_call",
    "run_tool",
]
