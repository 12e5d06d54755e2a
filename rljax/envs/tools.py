"""Built-in tools and the one way they are run: `run_tool(name, arguments, timeout_s)`.

A tool is `fn(arguments: dict) -> str`; it raises `ToolError` (or anything else) on bad input. `run_tool`
never raises: it returns a `ToolOutcome` whose status is "ok", "error" (exception, unknown tool, bad
arguments) or "timeout" (the call was abandoned after `timeout_s`, see `rljax.envs.base`).

- calculator: arithmetic on int/float literals with + - * / // % ** and parentheses, evaluated by walking
  the AST (never `eval`); exponents, operand sizes and the expression length are bounded so that no
  input can run for long or allocate much.
- python: the code runs in `rljax.rewards.run_python`'s sandbox (no network, resource limits, killed at
  its own timeout); the tool returns stdout, or the error and stderr tail on failure.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

from rljax.envs.base import StepTimeout, call_with_timeout
from rljax.registry import Registry

Tool = Callable[[dict[str, Any]], str]
TOOLS: Registry[Tool] = Registry("tool")

MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 64  # |b| in a ** b
MAX_INT_BITS = 1024  # operands and results; beyond this the calculator refuses
MAX_OUTPUT_CHARS = 512


class ToolError(ValueError):
    """Bad arguments or a refused computation; the message is shown to the model."""


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """`text` is what the model sees; `status` is "ok", "error" or "timeout"."""

    text: str
    status: str


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _checked(value: int | float) -> int | float:
    if not isinstance(value, (int, float)):  # e.g. (-8) ** 0.5 is complex
        raise ToolError(f"result is {type(value).__name__}, not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not finite")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} exceeds {MAX_EXPONENT}")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
    raise ToolError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError on anything else.

    >>> calculate("2 * (3 + 4) ** 2")
    98
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"syntax error: {e.msg}") from None
    return _evaluate(tree.body)


def format_number(value: int | float) -> str:
    """Integers as digits; floats with 12 significant digits, integral ones without ".0"."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _string_argument(arguments: dict[str, Any], key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ToolError(f'needs a string argument "{key}", got {sorted(arguments)}')
    return value


@TOOLS.register("calculator")
def calculator_tool(arguments: dict[str, Any]) -> str:
    """{"expression": "3 * (4 + 5)"} -> "27"."""
    return format_number(calculate(_string_argument(arguments, "expression")))


@TOOLS.register("python")
def python_tool(arguments: dict[str, Any], *, timeout_s: float = 5.0) -> str:
    """{"code": "print(2 ** 10)"} -> "1024" (stdout), run in the sandbox with its own wall-time limit."""
    from rljax.rewards import run_python

    result = run_python(_string_argument(arguments, "code"), timeout_s=timeout_s)
    if result.timed_out or result.killed_reason == "timeout":
        raise StepTimeout(f"python code did not finish within {timeout_s} s")
    if result.returncode != 0:
        reason = result.killed_reason or f"exit code {result.returncode}"
        raise ToolError(f"{reason}: {result.stderr.strip()[-MAX_OUTPUT_CHARS:]}")
    return result.stdout.strip()


def run_tool(name: str, arguments: dict[str, Any], *, timeout_s: float) -> ToolOutcome:
    """Runs tool `name` with a deadline; every failure becomes an outcome, never an exception."""
    if name not in TOOLS:
        return ToolOutcome(f"error: unknown tool {name!r}; available: {', '.join(TOOLS.names())}", "error")
    try:
        text = call_with_timeout(TOOLS.get(name), arguments, timeout_s=timeout_s)
    except StepTimeout:
        return ToolOutcome(f"error: {name} timed out after {timeout_s} s", "timeout")
    except Exception as e:  # noqa: BLE001  (a tool's failure is data for the model, not a crash)
        return ToolOutcome(f"error: {type(e).__name__}: {e}"[:MAX_OUTPUT_CHARS], "error")
    if not isinstance(text, str):
        return ToolOutcome(f"error: {name} returned {type(text).__name__}, not text", "error")
    return ToolOutcome(text[:MAX_OUTPUT_CHARS], "ok")
