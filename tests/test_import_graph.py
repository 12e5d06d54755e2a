"""No import cycles inside `rljax/`, counting imports inside functions (a lazy import hides a cycle, it does
not remove it), and `rljax.envs` never imports the loop that drives it.

The graph has one node per module (a package is its `__init__`). `import a.b.c` / `from a.b import c`
add an edge to the deepest module that exists (`a.b.c` if it is a module, else `a.b`); importing a module
also runs each enclosing package's `__init__`, so that is an edge too, except for a package the importer
is itself inside (Python has already started that `__init__`).
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rljax"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The deepest existing module that `name` (a module or a module's attribute) names."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module: str, path: pathlib.Path) -> list[str]:
    """Every `rljax...` name imported anywhere in the file (module level and inside functions)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per extra dot
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return [n for n in names if n == "rljax" or n.startswith("rljax.")]


def edges(module: str) -> set[str]:
    out = set()
    for name in imported_names(module, MODULES[module]):
        target = resolve(name)
        if target is None:
            continue
        out.add(target)
        parts = target.split(".")
        for i in range(2, len(parts)):  # enclosing packages' __init__ (rljax/__init__.py imports nothing)
            package = ".".join(parts[:i])
            if package in MODULES and not (module + ".").startswith(package + "."):
                out.add(package)
    out.discard(module)
    return out


def graph() -> dict[str, set[str]]:
    return {m: edges(m) for m in MODULES}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state = {}  # module -> 1 on the current path, 2 done
    for root in sorted(g):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(g[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(g[nxt])))
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    g = graph()
    assert "rljax.trainer.step" in g["rljax.trainer"]  # `from rljax.trainer.step import ...`
    assert "rljax.algos.advantages" in g["rljax.algos"]  # `from .advantages import ...`
    assert "rljax.loop.train" in g["rljax.main"]  # imported inside `start`
    assert "rljax.envs" in g["rljax.loop.rollout_phase"]  # a package's __init__ runs for an outsider


def test_find_cycle_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_envs_do_not_import_the_loop():
    """Environments produce `Group`s (`rljax.trajectory`); the loop consumes them: one direction."""
    g = graph()
    bad = [f"{m} -> {t}" for m in g if m.startswith("rljax.envs") for t in g[m] if t.startswith("rljax.loop")]
    assert not bad, bad
