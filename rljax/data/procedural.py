"""Procedural tasks for small-scale validation: arithmetic and countdown, deterministic given `seed`.

Generated with the stdlib `random.Random(seed)`, whose integer streams are stable across Python
versions, so a seed names the same data set everywhere.
"""

from __future__ import annotations

import random
from fractions import Fraction

from rljax.data.sources import SOURCES, Example

_ARITHMETIC_OPS = ("+", "-", "*")


def _arithmetic_example(rng: random.Random, ops, min_value, max_value, num_terms, template) -> Example:
    terms = [rng.randint(min_value, max_value) for _ in range(num_terms)]
    chosen = [rng.choice(ops) for _ in range(num_terms - 1)]
    expr = str(terms[0]) + "".join(f" {op} {t}" for op, t in zip(chosen, terms[1:], strict=True))
    # Safe: expr is built from ints and +,-,* only; eval applies the usual precedence.
    answer = eval(expr, {"__builtins__": {}})  # noqa: S307
    return {
        "prompt": template.format(expr=expr),
        "answer": str(answer),
        "expr": expr,
        "num_terms": num_terms,
        "max_value": max_value,
    }


@SOURCES.register("arithmetic")
def arithmetic_source(
    *,
    num_examples: int = 1000,
    seed: int = 0,
    ops: tuple[str, ...] = ("+", "*"),
    min_value: int = 0,
    max_value: int = 9,
    num_terms: int = 2,
    template: str = "{expr} =",
) -> list[Example]:
    """Integer expressions like "7 + 3 * 5" with the answer as a string.

    Difficulty knobs: operand range [min_value, max_value], num_terms (>= 2) and ops (subset of + - *).
    """
    bad = [op for op in ops if op not in _ARITHMETIC_OPS]
    if bad or not ops:
        raise ValueError(f"arithmetic ops must be a non-empty subset of {_ARITHMETIC_OPS}, got {ops!r}")
    if num_terms < 2 or min_value > max_value:
        raise ValueError(
            f"need num_terms >= 2 and min_value <= max_value, got {num_terms}, {min_value}..{max_value}"
        )
    rng = random.Random(seed)
    return [
        _arithmetic_example(rng, tuple(ops), min_value, max_value, num_terms, template)
        for _ in range(num_examples)
    ]


def _combine(rng: random.Random, leaves: list[tuple[Fraction, str]]) -> tuple[Fraction, str]:
    """A random expression tree over `leaves` (value, text) with positive-integer intermediate results."""
    if len(leaves) == 1:
        return leaves[0]
    cut = rng.randint(1, len(leaves) - 1)
    (a, ta), (b, tb) = _combine(rng, leaves[:cut]), _combine(rng, leaves[cut:])
    options = [("+", a + b), ("*", a * b)]
    if a > b:
        options.append(("-", a - b))
    if a % b == 0:  # operands are positive integers, so b != 0
        options.append(("/", a / b))
    op, value = rng.choice(options)
    return value, f"({ta} {op} {tb})"


def _countdown_example(rng, num_numbers, min_number, max_number, max_target, template) -> Example | None:
    numbers = [rng.randint(min_number, max_number) for _ in range(num_numbers)]
    order = numbers[:]
    rng.shuffle(order)
    tree = _combine(rng, [(Fraction(n), str(n)) for n in order])
    if not 1 <= tree[0] <= max_target:
        return None
    target = int(tree[0])
    solution = tree[1][1:-1] if num_numbers > 1 else tree[1]
    listed = ", ".join(map(str, numbers))
    return {
        "prompt": template.format(numbers=listed, target=target),
        "answer": str(target),
        "numbers": numbers,
        "target": target,
        "solution": solution,
    }


@SOURCES.register("countdown")
def countdown_source(
    *,
    num_examples: int = 1000,
    seed: int = 0,
    num_numbers: int = 3,
    min_number: int = 1,
    max_number: int = 20,
    max_target: int = 100,
    template: str = "Using the numbers {numbers} once each with + - * / and parentheses, make {target}.",
) -> list[Example]:
    """Countdown puzzles: reach `target` from `numbers`, each used exactly once (score with the
    `countdown` reward). Every puzzle is solvable: the target is the value of a random expression over
    the numbers with positive-integer intermediate results (kept as example["solution"]).

    References: Countdown as used in TinyZero (Pan et al. 2025) and "Stream of Search"
    (Gandhi et al. 2024, arXiv:2404.03683).
    """
    if num_numbers < 1 or min_number < 1 or min_number > max_number:
        raise ValueError("need num_numbers >= 1 and 1 <= min_number <= max_number")
    rng = random.Random(seed)
    examples: list[Example] = []
    attempts = 0
    while len(examples) < num_examples:
        attempts += 1
        if attempts > 100 * num_examples + 1000:
            raise ValueError(f"countdown: could not make {num_examples} puzzles with targets <= {max_target}")
        example = _countdown_example(rng, num_numbers, min_number, max_number, max_target, template)
        if example is not None:
            examples.append(example)
    return examples
