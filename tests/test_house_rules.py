"""House rules a reviewer would otherwise check by eye: modules of at most 400 lines, and no name switches
(`cfg.algo.family == "ppo"`) at call sites: a variant is a registered function resolved when the run is
built (HOUSE_STYLE.md, "Variants: one small registry per axis").

A name switch is a comparison (==, !=, in, not in) of an attribute named like a string field of the config
(`family`, `advantage`, `name`, `remat`, `transport`, ...) with a string literal. The sentinel "auto"
("resolve this for me") is not a variant name and is allowed.

Today's offenders are listed below, each with its count. The lists only shrink: a new offender fails, and
so does a listed count that is now too high (lower it, or delete the entry, in the same change).
"""

import ast
import pathlib

from rljax import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 400

# module -> its line count today. Split before adding to it; do not raise a number.
TOO_LONG = {}

# module -> name switches in it today (see the module doc). Replace each by a registry lookup at build time.
NAME_SWITCHES = {}
SENTINELS = {"auto"}


def modules() -> list[pathlib.Path]:
    return sorted((REPO / "rljax").rglob("*.py"))


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO))


def string_fields() -> set[str]:
    """Leaf names of the config's str fields (e.g. "family", "advantage", "transport")."""
    return {key.rsplit(".", 1)[1] for key, typ in config_lib.field_types().items() if typ is str}


def _strings(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return values if len(values) == len(node.elts) else None
    return None


def name_switches(source: str, fields: set[str]) -> list[str]:
    """Each `<x>.<field> ==/!=/in <string literal(s)>` in `source`, as `line: code`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
            continue
        if not isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
            continue
        left, right = node.left, node.comparators[0]
        for attr, other in ((left, right), (right, left)):
            values = _strings(other)
            if isinstance(attr, ast.Attribute) and attr.attr in fields and values:
                if not set(values) <= SENTINELS:
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_switch_finder():
    fields = {"family", "name"}
    src = 'if cfg.algo.family == "ppo": pass\nx = opt.name in ("adamw", "sgd")\ny = m.family != "auto"\n'
    src += 'z = cfg.algo.family == other\nw = "ppo" == cfg.algo.family\nv = cfg.size == "x"\n'
    assert name_switches(src, fields) == [
        "1: cfg.algo.family == 'ppo'",
        "2: opt.name in ('adamw', 'sgd')",
        "5: 'ppo' == cfg.algo.family",
    ]


def test_no_module_over_400_lines():
    lines = {rel(p): len(p.read_text().splitlines()) for p in modules()}
    over = {m: n for m, n in lines.items() if n > MAX_LINES}
    grown = {m: (n, TOO_LONG.get(m)) for m, n in over.items() if n > TOO_LONG.get(m, MAX_LINES)}
    assert not grown, f"over {MAX_LINES} lines (now, allowed): {grown}; split the module instead"
    stale = {m: (lines.get(m), n) for m, n in TOO_LONG.items() if lines.get(m, 0) < n}
    assert not stale, f"shrink TOO_LONG to today's counts (now, listed): {stale}"


MAX_FUNCTION_LINES = 60


def test_whether_a_reference_is_needed_is_derived_once():
    """`algo.needs_reference` is the one place `beta > 0` is decided; elsewhere nothing compares beta."""
    found = []
    for p in modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(x, ast.Attribute) and x.attr == "beta" for x in [node.left, *node.comparators]
            ):
                found.append(f"{rel(p)}:{node.lineno}")
    assert [f.split(":")[0] for f in found] == ["rljax/config/schema.py"], found


def test_no_function_over_60_lines():
    """A function (or method) of rljax, from its `def` to its last line, docstring included."""
    long = []
    for p in modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel(p)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines; split them:\n" + "\n".join(long)


def test_no_name_switches_outside_registries():
    fields = string_fields()
    assert {"family", "advantage", "transport", "name"} <= fields
    found = {rel(p): name_switches(p.read_text(), fields) for p in modules()}
    found = {m: hits for m, hits in found.items() if hits}
    grown = {m: hits for m, hits in found.items() if len(hits) > NAME_SWITCHES.get(m, 0)}
    assert not grown, f"new name switches (resolve through a registry at build time): {grown}"
    stale = {m: (len(found.get(m, [])), n) for m, n in NAME_SWITCHES.items() if len(found.get(m, [])) < n}
    assert not stale, f"shrink NAME_SWITCHES to today's counts (now, listed): {stale}"
