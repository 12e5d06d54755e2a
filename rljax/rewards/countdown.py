"""Countdown verifier: an arithmetic expression that uses the given numbers and evaluates to the target.

The expression is taken from `<answer>...</answer>`, else the last `\\boxed{...}`, else the text after the
last "Answer:", else the last line; anything after an "=" is dropped. It is parsed with `ast` (only
integer literals, + - * / and parentheses; no names, calls or unary minus) and evaluated exactly with
fractions, so 7/2*2 is 7.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from rljax.rewards.base import REWARDS, declare_range
from rljax.rewards.math_verify import find_boxed

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_LINE_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_INVALID = (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError)


def extract_expression(completion: str) -> str | None:
    """The candidate expression of a completion (see module docstring), without any "= target" part."""
    tags = _ANSWER_TAG_RE.findall(completion)
    boxed = find_boxed(completion)
    lines = _ANSWER_LINE_RE.findall(completion)
    nonempty = [line for line in completion.strip().splitlines() if line.strip()]
    for candidates in (tags, boxed, lines, nonempty):
        if candidates:
            expression = candidates[-1].split("=")[0].strip()
            return expression.replace("\u00d7", "*").replace("\u00f7", "/").replace("\\times", "*") or None
    return None


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)}")


def evaluate_countdown(expression: str) -> tuple[Fraction, list[int]]:
    """(exact value, numbers used in order) of an expression; ValueError/SyntaxError if not allowed."""
    if len(expression) > 256:
        raise ValueError("expression too long")
    tree = ast.parse(expression, mode="eval")
    used: list[int] = []
    return _evaluate(tree.body, used), used


def check_countdown(expression: str, numbers: list[int], target: int, *, use_all: bool = True) -> bool:
    """True iff `expression` evaluates to `target` using each of `numbers` once (all of them if use_all,
    else a sub-multiset)."""
    try:
        value, used = evaluate_countdown(expression)
    except _INVALID:
        return False
    have, need = Counter(used), Counter(int(n) for n in numbers)
    numbers_ok = have == need if use_all else all(have[n] <= need[n] for n in have)
    return numbers_ok and value == target


@REWARDS.register("countdown")
@declare_range(
    lambda o: (min(0.0, o["correct"], o["format_score"]), max(0.0, o["correct"], o["format_score"]))
)
def countdown_reward(
    *,
    prompt: str,
    completion: str,
    example: dict[str, Any],
    use_all: bool = True,
    correct: float = 1.0,
    format_score: float = 0.0,
) -> float:
    """`correct` if the completion's expression reaches example["target"] with example["numbers"],
    `format_score` if an expression parses but is wrong, else 0.

    References: Countdown task as used in TinyZero (Pan et al. 2025) and "Stream of Search"
    (Gandhi et al. 2024, arXiv:2404.03683).
    """
    expression = extract_expression(completion)
    if expression is None:
        return 0.0
    target = int(example["target"] if "target" in example else example["answer"])
    if check_countdown(expression, list(example["numbers"]), target, use_all=use_all):
        return correct
    try:
        evaluate_countdown(expression)
    except _INVALID:
        return 0.0
    return format_score
