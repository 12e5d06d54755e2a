"""No production module reads a test-only environment variable: faults and slow-downs are wired in by the
tests (monkeypatch in-process, an entry script in tests/support/ for subprocess runs).

A test-only name is an environment-variable-shaped string (`UPPER_SNAKE`) with a word starting with TEST or
FAULT (`RLJAX_TEST_X`, `MY_FAULTS`; not `DEFAULTS`). The
scan flags (1) such a name used anywhere in rljax/ as a string literal (a constant later passed to
`os.environ.get` is caught where it is defined), and (2) any `os.environ[...]`, `os.environ.get(...)`,
`os.getenv(...)` or `... in os.environ` whose name is such a literal. ALLOWED only shrinks.
"""

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
# a word of the name (between underscores) starts with TEST or FAULT: RLJAX_TEST_X, MY_FAULTS; not DEFAULTS
TEST_ONLY = re.compile(r"^(?:[A-Z0-9]+_)*(?:TEST|FAULT)[A-Z0-9]*(?:_[A-Z0-9]+)*$")
# (module, name): known offenders being removed. Never add to this; delete an entry once it is gone.
ALLOWED: set[tuple[str, str]] = set()


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _env_reads(tree: ast.AST):
    """(line, name expression) of every environment read in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr in ("get", "pop", "setdefault")
                and _is_environ(f.value)
            ):
                yield node.lineno, node.args[0]
            elif (
                isinstance(f, ast.Attribute | ast.Name)
                and getattr(f, "attr", getattr(f, "id", "")) == "getenv"
            ):
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            yield node.lineno, node.left


def find_test_seams(source: str, module: str) -> list[tuple[str, int, str]]:
    """(module, line, name) of each test-only environment name in `source`."""
    tree, found = ast.parse(source), set()
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if TEST_ONLY.match(node.value):
                found.add((module, node.lineno, node.value))
    for line, name in _env_reads(tree):
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and TEST_ONLY.match(name.value):
            found.add((module, line, name.value))
    return sorted(found)


def test_the_scan_finds_planted_reads():
    planted = (
        "import os\nfrom os import environ, getenv\n"
        'A = os.environ.get("RLJAX_TEST_SLOW")\n'
        'B = os.environ["MY_FAULT"]\n'
        'C = getenv("X_TESTING")\n'
        'D = "RLJAX_FAULTS" in environ\n'
        'NAME = "SOME_FAULT_PLAN"\n'
        'OK = os.environ.get("RLJAX_STAGING_DIR"), "not a TEST name", os.environ.get("HOME"), "DEFAULTS"\n'
    )
    names = [(line, name) for _, line, name in find_test_seams(planted, "m.py")]
    assert names == [
        (3, "RLJAX_TEST_SLOW"),
        (4, "MY_FAULT"),
        (5, "X_TESTING"),
        (6, "RLJAX_FAULTS"),
        (7, "SOME_FAULT_PLAN"),
    ]


def test_no_production_module_reads_a_test_only_environment_variable():
    found = []
    for path in sorted((REPO / "rljax").rglob("*.py")):
        module = path.relative_to(REPO).as_posix()
        found += find_test_seams(path.read_text(), module)
    offenders = [f"{m}:{line}: {name}" for m, line, name in found if (m, name) not in ALLOWED]
    assert not offenders, "test-only settings read in production (wire them in from tests/):\n" + "\n".join(
        offenders
    )
    stale = ALLOWED - {(m, name) for m, _, name in found}
    assert not stale, f"remove these from ALLOWED, they are gone: {sorted(stale)}"


def test_fault_injection_lives_in_tests_support():
    """The fault plan and its kill helpers (tests/support/faults.py) are not in the package."""
    found = [
        str(f.relative_to(REPO))
        for f in sorted((REPO / "rljax").rglob("*.py"))
        if any(word in f.read_text() for word in ("FaultPlan", "kill_halfway", "kill_when_running"))
    ]
    assert not found, found
