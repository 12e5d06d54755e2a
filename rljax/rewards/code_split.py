"""Which side of an assert test may see the solution: names, taint, and the two sandbox runs' statements.

A test's setup statements and expressions are sorted by the names they read (`reads`):
- a *solution name* is a free name the test does not define (the solution's function, class, globals);
- a setup statement is *tainted* when it reads a solution name or a name a tainted statement bound
  (`r = f(3)`); it runs only where the solution runs;
- an expression is *solution-dependent* when it reads such a name; any other expression (the expected side:
  `expected`, `sorted(data)[:2]`, `[x * 2 for x in xs]`, `f"{a}-{b}"`) is computed in a sandbox run that
  never sees the solution (the *expected run*), or by the trusted evaluator when it is a small constant.

The solution run gets the solution, the tainted statements, the probes, and only those untainted
statements whose names the solution side reads (its inputs: `x = [3, 1]; assert f(x) == [1, 3]` passes `x`)
or that bind nothing and read only such names and imported modules (`random.seed(0)`). A statement that
binds both an input the solution side reads and a name the expected side reads would put the expected
value next to the solution: that test is refused (ValueError) rather than run.
"""

from __future__ import annotations

import ast
import builtins

BUILTIN_NAMES = frozenset(dir(builtins)) - {"__import__"}


def _local_names(node: ast.AST) -> set[str]:
    """Names bound for a scope of their own inside `node`: comprehension targets, function and lambda
    arguments, and every name a function body assigns (over-approximate: such a name is never free)."""
    names: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension):
            names |= {x.id for x in ast.walk(n.target) if isinstance(x, ast.Name)}
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            body = n.body if isinstance(n.body, list) else [n.body]
            names |= {
                x.id
                for b in body
                for x in ast.walk(b)
                if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)
            }
    return names


def reads(node: ast.AST) -> set[str]:
    """Free names `node` reads (an augmented assignment reads its target too)."""
    loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        loads.add(node.target.id)
    return loads - _local_names(node)


def binds(statement: ast.stmt) -> set[str]:
    """Names a statement binds in the test's namespace (targets, imports, def and class names)."""
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {statement.name}
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in statement.names}
    targets: list[ast.AST] = []
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
        targets = [statement.target]
    elif isinstance(statement, ast.With | ast.AsyncWith):
        targets = [i.optional_vars for i in statement.items if i.optional_vars is not None]
    names = {
        n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    walrus = {n.target.id for n in ast.walk(statement) if isinstance(n, ast.NamedExpr)}
    return names | walrus


class Scope:
    """Names the test defined without the solution so far (`defined`; imports in `modules`), read in order."""

    def __init__(self) -> None:
        self.defined: set[str] = set()
        self.modules: set[str] = set()

    def depends(self, node: ast.AST) -> bool:
        """True when `node` reads a name only the solution (or a statement using it) provides."""
        return bool(reads(node) - self.defined - BUILTIN_NAMES)

    def add(self, statement: ast.stmt) -> bool:
        """Records a setup statement; returns whether it is tainted."""
        tainted = self.depends(statement)
        if tainted:
            self.defined -= binds(statement)
        else:
            self.defined |= binds(statement)
            if isinstance(statement, ast.Import | ast.ImportFrom):
                self.modules |= binds(statement)
        return tainted


def solution_steps(
    steps: list[tuple], modules: set[str], expected_reads: set[str], index: int
) -> list[tuple]:
    """The solution run's share of a test's steps, in order. `steps` holds ("setup", src, node, tainted)
    and ("probe", id, src, node) items; probes and tainted statements always run there, an untainted
    statement when the solution side reads what it binds, or it binds nothing and reads only such names
    and modules (see the module docstring). ValueError for a statement binding both sides' names."""
    need: set[str] = set()
    keep: list[bool] = []
    for step in reversed(steps):
        node = step[-2] if step[0] == "setup" else step[-1]
        if step[0] == "probe" or step[-1] is True:
            need |= reads(node)
            keep.append(True)
            continue
        bound = binds(node)
        wanted = bool(bound & need) or (not bound and reads(node) - BUILTIN_NAMES <= need | modules)
        if wanted and bound & (expected_reads - need):
            raise ValueError(
                f"test {index}: `{ast.unparse(node)[:80]}` binds both what the solution is given and what "
                "it is checked against; bind the expected value in a statement of its own"
            )
        if wanted:
            need |= reads(node)
        keep.append(wanted)
    kept = [step for step, k in zip(steps, reversed(keep), strict=True) if k]
    return [(s[0], s[1]) if s[0] == "setup" else (s[0], s[1], s[2]) for s in kept]
