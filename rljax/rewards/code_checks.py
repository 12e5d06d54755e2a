"""Trusted side of the code reward's assert tests: split each assert into probes and a check.

A test's top-level `assert` statements are parsed here, in the trusted process. Every maximal
sub-expression that depends on the solution (a call of its function, a name it defines) becomes a *probe*:
its source is sent to the sandbox, which returns the probe's value as plain JSON data (see
`_code_harness.py`). Everything else (the constants the value is compared with, `==`, `<`, `in`, `and`,
`not`, `abs(x - c)`, `math.isclose`, ...) stays here and is evaluated over the decoded plain values, so the
expected values never enter the sandbox and no object of the solution's reaches a comparison
(`__eq__`/`__hash__`/`__bool__` tricks are void). `==` is type-exact over JSON kinds: numbers (int and
float alike), bool, str, bytes, None, list, tuple, dict, set; a value of any other type equals nothing.

An expected value beyond the small constant grammar (set up by an assignment, a slice, a method call, a
comprehension, a library call, an f-string) is computed by a sandbox run that never sees the solution
(`TestPlan.expected_steps`; `rljax.rewards.code_split` decides which statements each run gets) and
enters the checks as a constant (`with_expected`). A constant that cannot be computed is an error of the
test (ValueError), never a silent fail. Sequences concatenate and repeat here (`[0] * 3`, `"ab" * 2`,
`(1,) + (2,)`), up to `_MAX_SEQUENCE` items.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from typing import Any

from rljax.rewards.code_records import _Opaque
from rljax.rewards.code_split import Scope, reads, solution_steps


class CheckFailed(Exception):
    """A check could not be evaluated (missing or failed probe, a type error): the test fails."""


@dataclasses.dataclass(frozen=True)
class TestPlan:
    """One test: `steps` go to the solution's sandbox (("setup", src) | ("probe", id, src)), `expected_steps`
    to a sandbox without the solution (the same kinds; probe ids of their own); `checks` stay here."""

    steps: tuple[tuple[Any, ...], ...]
    checks: tuple[tuple[Any, ...], ...]
    expected_steps: tuple[tuple[Any, ...], ...] = ()


_CONSTS = {
    "math.pi": math.pi,
    "math.e": math.e,
    "math.inf": math.inf,
    "math.nan": math.nan,
    "math.tau": math.tau,
}
_PURE = {
    **{f.__name__: f for f in (abs, round, len, sorted, set, frozenset, tuple, list, sum, min, max)},
    **{f.__name__: f for f in (int, float, str, bool, any, all)},
    **{f"math.{f.__name__}": f for f in (math.isclose, math.fabs, math.sqrt, math.floor, math.ceil)},
    "isclose": math.isclose,
}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_INT_EXPONENT = 64  # Why: a probe must not make the trusted process compute a huge power


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


_SEQUENCES = (str, bytes, list, tuple)
_MAX_SEQUENCE = 1 << 20  # items of a repeated or concatenated constant


def _sequence_op(op: type, a: Any, b: Any) -> Any:
    if op is ast.Add and type(a) is type(b) and type(a) in _SEQUENCES:
        size = len(a) + len(b)
    elif op is ast.Mult and {type(a), type(b)} & set(_SEQUENCES) and int in (type(a), type(b)):
        seq, n = (a, b) if type(b) is int else (b, a)
        size = len(seq) * max(n, 0)
    else:
        raise CheckFailed(f"arithmetic on {type(a).__name__} and {type(b).__name__}")
    if size > _MAX_SEQUENCE:
        raise CheckFailed(f"a sequence of {size} items (more than {_MAX_SEQUENCE})")
    return _BINOPS[op](a, b)


def _arithmetic(op: type, a: Any, b: Any) -> Any:
    numeric = (int, float)
    if type(a) in _SEQUENCES or type(b) in _SEQUENCES:
        return _sequence_op(op, a, b)
    if type(a) not in numeric or type(b) not in numeric:
        raise CheckFailed(f"arithmetic on {type(a).__name__} and {type(b).__name__}")
    if op is ast.Pow and isinstance(b, int) and abs(b) > _MAX_INT_EXPONENT:
        raise CheckFailed(f"exponent {b} is too large")
    return _BINOPS[op](a, b)


def _pure_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func) in _PURE and not any(
        isinstance(a, ast.Starred) for a in node.args
    ) and all(k.arg is not None for k in node.keywords)  # fmt: skip


def _children(node: ast.AST) -> list[ast.AST] | None:
    """Operands of a node the trusted side can apply itself, else None (then the node is a probe)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return [node.left, node.right]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return [node.operand]
    if _pure_call(node):
        return [*node.args, *(k.value for k in node.keywords)]
    return None


def _is_const(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) or _dotted(node) in _CONSTS:
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(not isinstance(e, ast.Starred) and _is_const(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_const(k) for k in node.keys) and all(map(_is_const, node.values))
    children = _children(node)
    return children is not None and all(map(_is_const, children))


class _Planner:
    """Splits assert expressions into solution probes (numbered from `next_id`), expected probes (numbered
    from 0, computed without the solution) and trusted check trees."""

    def __init__(self, next_id: int, scope: Scope):
        self.next_id, self.scope = next_id, scope
        self.probes: list[tuple[int, str, ast.AST]] = []
        self.expected: list[tuple[int, str, ast.AST]] = []

    def check(self, node: ast.AST) -> tuple[Any, ...]:
        if isinstance(node, ast.BoolOp):
            return ("all" if isinstance(node.op, ast.And) else "any", [self.check(v) for v in node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ("not", self.check(node.operand))
        if isinstance(node, ast.Compare):
            operands = [self.value(x) for x in [node.left, *node.comparators]]
            return ("compare", [type(op) for op in node.ops], operands)
        return ("truth", self.value(node))

    def _trusted_part(self, node: ast.AST) -> bool:
        """Whether some part of `node` is evaluated without the solution (a constant, an expected value)."""
        children = _children(node)
        return (
            _is_const(node)
            or not self.scope.depends(node)
            or (children is not None and any(map(self._trusted_part, children)))
        )

    def value(self, node: ast.AST) -> tuple[Any, ...]:
        if _is_const(node):
            try:
                return ("const", evaluate(self._plan_const(node), {}))
            except Exception as e:  # the test's own constant: its error, not a silent fail
                raise ValueError(f"the constant `{ast.unparse(node)[:80]}` cannot be evaluated: {e}") from e
        if not self.scope.depends(node):
            self.expected.append((len(self.expected), ast.unparse(node), node))
            return ("expected", self.expected[-1][0])
        if not self._trusted_part(node):
            probe_id, self.next_id = self.next_id, self.next_id + 1
            self.probes.append((probe_id, ast.unparse(node), node))
            return ("probe", probe_id)
        return self._apply(node, [self.value(c) for c in _children(node) or []])

    def _plan_const(self, node: ast.AST) -> tuple[Any, ...]:
        if isinstance(node, ast.Constant):
            return ("const", node.value)
        if _dotted(node) in _CONSTS:
            return ("const", _CONSTS[_dotted(node)])
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return ("build", type(node), [self._plan_const(e) for e in node.elts])
        if isinstance(node, ast.Dict):
            return (
                "build",
                ast.Dict,
                [self._plan_const(e) for pair in zip(node.keys, node.values, strict=True) for e in pair],
            )
        return self._apply(node, [self._plan_const(c) for c in _children(node) or []])

    def _apply(self, node: ast.AST, plans: list[tuple[Any, ...]]) -> tuple[Any, ...]:
        if isinstance(node, ast.BinOp):
            return ("binop", type(node.op), plans)
        if isinstance(node, ast.UnaryOp):
            return ("call", _UNARY[type(node.op)], plans, [])
        names = [k.arg for k in node.keywords]
        return (
            "call",
            _PURE[_dotted(node.func)],
            plans[: len(node.args)],
            list(zip(names, plans[len(node.args) :], strict=True)),
        )


def _has_nested_check(statement: ast.stmt) -> bool:
    return any(isinstance(n, ast.Assert | ast.Raise) for n in ast.walk(statement))


def plan_tests(sources: list[str]) -> list[TestPlan]:
    """Plans of assert-style tests; ValueError for a test whose checks are not top-level asserts, whose
    constant cannot be evaluated, or that would hand its expected value to the solution."""
    plans, next_id = [], 0
    for index, source in enumerate(sources):
        planner = _Planner(next_id, Scope())
        steps, expected_steps, checks = [], [], []
        for statement in ast.parse(source).body:
            if isinstance(statement, ast.Assert):
                first, first_expected = len(planner.probes), len(planner.expected)
                checks.append(planner.check(statement.test))
                steps += [("probe", *p) for p in planner.probes[first:]]
                expected_steps += [("probe", i, src) for i, src, _ in planner.expected[first_expected:]]
            elif _has_nested_check(statement):
                raise ValueError(
                    f"test {index}: an assert or raise inside {type(statement).__name__} cannot be checked "
                    f"outside the sandbox; write the checks as top-level assert statements: {source!r:.200}"
                )
            else:
                tainted = planner.scope.add(statement)
                steps.append(("setup", ast.unparse(statement), statement, tainted))
                if not tainted:
                    expected_steps.append(("setup", ast.unparse(statement)))
        if not checks:
            raise ValueError(f"test {index} has no top-level assert statement: {source!r:.200}")
        expected_reads = set().union(*(reads(node) for _, _, node in planner.expected))
        solution = solution_steps(steps, planner.scope.modules, expected_reads, index)
        if not planner.expected:
            expected_steps = []
        plans.append(TestPlan(tuple(solution), tuple(checks), tuple(expected_steps)))
        next_id = planner.next_id
    return plans


def with_expected(plan: TestPlan, values: dict[int, Any], index: int) -> TestPlan:
    """`plan` with its expected values (from the run without the solution) as constants; ValueError when
    one could not be computed (a broken test, never a silent fail)."""

    def fill(node: Any) -> Any:
        if isinstance(node, tuple) and node and node[0] == "expected":
            if node[1] not in values:
                sources = {s[1]: s[2] for s in plan.expected_steps if s[0] == "probe"}
                raise ValueError(
                    f"test {index}: the expected value `{sources[node[1]][:80]}` failed to compute"
                )
            return ("const", values[node[1]])
        if isinstance(node, tuple | list):
            return type(node)(fill(x) for x in node)
        return node

    return dataclasses.replace(plan, checks=tuple(fill(c) for c in plan.checks), expected_steps=())


def _kind(value: Any) -> Any:
    kind = type(value)
    if kind in (int, float):
        return "number"
    return "set" if kind in (set, frozenset) else kind


def strict_eq(a: Any, b: Any) -> bool:
    """Type-exact equality over plain data (int and float are one kind, bool is not a number)."""
    kind = _kind(a)
    if kind != _kind(b) or kind is _Opaque:
        return False
    if kind in (list, tuple):
        return len(a) == len(b) and all(map(strict_eq, a, b))
    if kind in (dict, "set"):
        if len(a) != len(b):
            return False
        b_keys = {k: k for k in b}  # hashing and == here run on plain data only
        same_keys = all(k in b_keys and strict_eq(k, b_keys[k]) for k in a)
        return same_keys and (kind == "set" or all(strict_eq(a[k], b[k]) for k in a))
    return a == b


def _contains(container: Any, item: Any) -> bool:
    if type(container) in (str, bytes):
        if type(item) is not type(container):
            raise CheckFailed(f"'in' of {type(item).__name__} in {type(container).__name__}")
        return item in container
    if type(container) not in (list, tuple, dict, set, frozenset):
        raise CheckFailed(f"'in' needs a plain container, got {type(container).__name__}")
    return any(strict_eq(item, x) for x in container)


_COMPARE = {
    ast.Eq: strict_eq,
    ast.NotEq: lambda a, b: not strict_eq(a, b),
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: _contains(b, a),
    ast.NotIn: lambda a, b: not _contains(b, a),
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_BUILD = {
    ast.Tuple: tuple,
    ast.List: list,
    ast.Set: set,
    ast.Dict: lambda xs: dict(zip(xs[::2], xs[1::2], strict=True)),
}


def _plain_bool(value: Any) -> bool:
    if type(value) is bool:
        return value
    if type(value) not in (int, float, str, bytes, list, tuple, dict, set, frozenset, type(None)):
        raise CheckFailed(f"no plain truth value for {type(value).__name__}")
    return bool(value)


def evaluate(plan: tuple[Any, ...], values: dict[int, Any]) -> Any:
    """Evaluates a check tree over decoded probe values; CheckFailed if a needed probe is missing/failed."""
    head = plan[0]
    if head == "const":
        return plan[1]
    if head == "probe":
        if plan[1] not in values:
            raise CheckFailed(f"probe {plan[1]} has no (single, valid) value")
        return values[plan[1]]
    if head in ("all", "any"):
        results = (_plain_bool(evaluate(p, values)) for p in plan[1])
        return all(results) if head == "all" else any(results)
    if head == "not":
        return not _plain_bool(evaluate(plan[1], values))
    if head == "truth":
        return _plain_bool(evaluate(plan[1], values))
    if head == "compare":
        operands = [evaluate(p, values) for p in plan[2]]
        pairs = zip(plan[1], operands, operands[1:], strict=False)
        return all(_plain_bool(_COMPARE[op](a, b)) for op, a, b in pairs)
    if head == "binop":
        return _arithmetic(plan[1], *(evaluate(p, values) for p in plan[2]))
    if head == "build":
        return _BUILD[plan[1]]([evaluate(p, values) for p in plan[2]])
    _, fn, args, kwargs = plan
    return fn(*(evaluate(p, values) for p in args), **{k: evaluate(p, values) for k, p in kwargs})


def passes(plan: TestPlan, values: dict[int, Any]) -> bool:
    """True iff every check of the test holds; any failure to evaluate is a fail."""
    try:
        return all(evaluate(check, values) is True for check in plan.checks)
    except Exception:  # noqa: BLE001 - type errors, missing probes, bad data: the test fails
        return False
