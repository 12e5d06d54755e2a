"""Enforces the dependency direction of HOUSE_STYLE.md by parsing every module's imports."""

import ast
import json
import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)

# Pure layers: jax/numpy/optax and the stdlib only (plus the named rljax modules).
# The metric schema and how values combine by it: pure (stdlib, numpy, registry), the one reduction table
# the trainer (over an update's steps) and the host (over a step's parts) both use.
PURE_METRICS = ("rljax.metrics.schema", "rljax.metrics.values")
PURE = {"jax", "numpy", "optax", "jaxtyping"}
RULES = {
    "rljax/algos": PURE | {"rljax.registry", "rljax.types"},
    "rljax/types.py": PURE,
    "rljax/registry.py": set(),
    "kernels": PURE | {"rljax.registry", "rljax.kernels", "jax_triton", "triton"},
    "rljax/models": PURE
    | {
        "flax",
        "safetensors",
        "rljax.models",
        "rljax.kernels",
        "rljax.sharding",
        "rljax.registry",
        "rljax.types",  # pure (jax, numpy): the batch contract's segment-id encoding (BRANCH_SHIFT)
        "rljax.hf_config",
        "transformers",
        "torch",
        "tokenizers",
        "ml_dtypes",
    },
    "rljax/sharding.py": PURE,
    "rljax/trainer": PURE
    | {
        "flax",
        "chex",
        "rljax.trainer",
        "rljax.algos",
        "rljax.models",
        "rljax.kernels",
        "rljax.sharding",
        "rljax.types",
        "rljax.config",
        "rljax.registry",
        *PURE_METRICS,
    },
}
# Entry-point modules inside a layer, each with the one module outside its rule it may use: the CLI's
# one-line user errors (`rljax.errors.fail`).
ENTRY_POINT_IMPORTS = {"rljax/models/fetch.py": {"rljax.errors"}}
# Side-effect packages: only the host loop (and start-up, CLIs, and the packages themselves) touch these.
HOST_ONLY = ["rljax.rollout", "rljax.weight_sync", "rljax.rewards", "rljax.checkpoint", "rljax.metrics"]
HOST_MODULES = (
    "rljax/loop",
    "rljax/runtime.py",
    "rljax/main.py",
    "rljax/monitor.py",
    "rljax/report.py",
    "rljax/envs",
    "rljax/preflight.py",
    "rljax/launch.py",
    "rljax/ray_launch.py",  # launchers like rljax.launch: the job's token (rljax.rollout.auth)
    "rljax/k8s_render.py",
    "rljax/replay.py",
    "rljax/eval.py",  # an entry point that serves a model and grades it, like the loop's evaluation
    "rljax/export.py",  # reads a run's checkpoints (its saved config and a LoRA base's identity), like replay
)


def import_lines(path: pathlib.Path) -> dict[str, int]:
    """{imported name: the first line importing it} of the module at `path`, imports inside functions too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines: dict[str, int] = {}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module != "rljax":  # `from rljax import algos` imports rljax.algos, not all of rljax
                names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            lines[name] = min(lines.get(name, node.lineno), node.lineno)
    return lines


def imports_of(path: pathlib.Path) -> set[str]:
    return set(import_lines(path))


def allowed(name: str, allow: set[str]) -> bool:
    top = name.split(".")[0]
    if top in STDLIB and top != "rljax":
        return True
    return any(name == a or name.startswith(a + ".") for a in allow) or (top != "rljax" and top in allow)


def files_under(rel: str):
    p = REPO / rel
    return [p] if p.is_file() else sorted(p.rglob("*.py"))


@pytest.mark.parametrize("rel", sorted(RULES))
def test_pure_layers_import_only_what_they_may(rel):
    bad = []
    own = rel.removesuffix(".py").replace("/", ".")
    own = "rljax.kernels" if own == "kernels" else own
    for f in files_under(rel):
        if f.name.startswith("bench_"):  # benchmarks are scripts, not the library layer
            continue
        allow = RULES[rel] | ENTRY_POINT_IMPORTS.get(str(f.relative_to(REPO)), set())
        for name in imports_of(f):
            if name.startswith("rljax.") and name.count(".") >= 2 and allowed(name.rsplit(".", 1)[0], allow):
                continue  # `from rljax.x import y` records both rljax.x and rljax.x.y
            if not allowed(name, allow | {own}):
                bad.append(f"{f.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_side_effect_packages_only_reached_from_the_host_loop():
    bad = []
    for f in sorted((REPO / "rljax").rglob("*.py")):
        rel = str(f.relative_to(REPO))
        if rel.startswith(HOST_MODULES):
            continue
        own = rel.replace("/", ".").removesuffix(".py")
        if any(own == pkg or own.startswith(pkg + ".") for pkg in HOST_ONLY):
            continue  # the host-side packages may use each other (rollout <-> weight_sync)
        for name in imports_of(f):
            if name.startswith(PURE_METRICS):
                continue
            for pkg in HOST_ONLY:
                if name == pkg or name.startswith(pkg + "."):
                    bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


def test_only_entry_points_read_flags():
    """Library code never reads flags; the CLIs (main, preflight, launch) do."""
    bad = []
    for f in sorted((REPO / "rljax").rglob("*.py")) + sorted((REPO / "kernels").rglob("*.py")):
        rel = str(f.relative_to(REPO))
        if rel in ("rljax/main.py", "rljax/preflight.py", "rljax/launch.py") or f.name.startswith("bench_"):
            continue
        names = imports_of(f)
        if names & {"absl.flags", "ml_collections.config_flags"}:
            bad.append(rel)
    assert not bad, bad


def test_no_top_level_kernels_module_is_installed(tmp_path):
    import subprocess

    import rljax.kernels

    assert pathlib.Path(rljax.kernels.__file__).parent == REPO / "kernels"
    # Outside the repo (no checkout on sys.path), `kernels` must not resolve to our folder: that name
    # belongs to another distribution that transformers looks for.
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else 'none')"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    origin = out.stdout.strip()
    assert origin == "none" or "site-packages" in origin, origin


# The vLLM boundary: the worker side (loaded by vLLM in its own processes) is the only rljax code that
# imports torch or vLLM; the trainer side (the engine, client, syncer, the loop) never does, not even lazily.
WORKER_SIDE = "rljax/weight_sync/worker/"
# rljax/models converts checkpoints with transformers (torch) outside the trainer's import path
# (`models.tiny`, the HF reference in tests); its own rule is RULES["rljax/models"].
TORCH_ALLOWED = ("rljax/models",)


def test_only_the_vllm_worker_side_imports_torch_or_vllm():
    bad = []
    for f in sorted((REPO / "rljax").rglob("*.py")):
        rel = str(f.relative_to(REPO))
        if rel.startswith(WORKER_SIDE):
            continue
        for name in imports_of(f):
            top = name.split(".")[0]
            if top == "vllm" or (top == "torch" and not rel.startswith(TORCH_ALLOWED)):
                bad.append(f"{rel} imports {name}")
            if name.startswith("rljax.weight_sync.worker"):  # the worker room is vLLM's to load, by name
                bad.append(f"{rel} imports the worker-side {name}")
    assert not bad, "\n".join(bad)


# What vLLM's processes load of rljax: the worker room and the shared wire format, transports and
# idle-spin settings (stdlib, numpy and the registry class below them); no syncer, loop, config or rollout.
WORKER_LOADS = {
    "rljax", "rljax.lockdir", "rljax.registry",
    "rljax.weight_sync", "rljax.weight_sync.staging", "rljax.weight_sync.transports",
    "rljax.weight_sync.wire", "rljax.weight_sync.idle_spin",
    "rljax.weight_sync.worker", "rljax.weight_sync.worker.plugin", "rljax.weight_sync.worker.engine",
    "rljax.weight_sync.worker.fanout",
}  # fmt: skip


def test_the_worker_room_loads_only_the_shared_modules():
    import subprocess

    code = (
        "import json, sys, rljax.weight_sync.worker.plugin, rljax.weight_sync.worker.engine;"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'rljax')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "rljax.weight_sync.worker.engine" in loaded and loaded <= WORKER_LOADS, loaded - WORKER_LOADS


def test_the_trainer_side_of_the_boundary_loads_no_torch_or_vllm():
    import subprocess

    code = (
        "import sys, rljax.main, rljax.loop.engine, rljax.rollout, rljax.weight_sync;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def declared_distributions() -> dict[str, set[str]]:
    """setup.py's requirement names (normalized), by where they are declared: "core" or the extra's name."""
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name) and t.id in ("CORE", "EXTRAS")
    }
    groups = {"core": values["CORE"], **values["EXTRAS"]}
    name = re.compile(r"[A-Za-z0-9._-]+")
    return {g: {normalized(name.match(r).group(0)) for r in reqs} for g, reqs in groups.items()}


def normalized(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


# Modules whose distribution is not installed on this machine, or comes with a declared one.
NOT_INSTALLED_HERE = {"jax_triton": "jax-triton"}  # the gpu extra
COMES_WITH = {"triton": "jax-triton"}  # the GPU kernels' triton is jax-triton's (and torch's) dependency


def test_every_third_party_import_is_a_declared_dependency():
    """A package the library imports is in setup.py itself (not only there because vLLM or a test tool
    pulls it in): e.g. pyzmq, which the trainer side of the zmq transport imports."""
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    declared = declared_distributions()
    everything = set().union(*declared.values())
    undeclared = []
    for root in ("rljax", "kernels"):
        for f in sorted((REPO / root).rglob("*.py")):
            for top in sorted({n.split(".")[0] for n in imports_of(f)} - STDLIB - {"rljax", "__future__"}):
                dists = {normalized(d) for d in installed.get(top, ())}
                dists |= {d for d in (NOT_INSTALLED_HERE.get(top), COMES_WITH.get(top)) if d}
                if not dists & everything:
                    where = sorted(dists) or "not installed"
                    undeclared.append(f"{f.relative_to(REPO)} imports {top} ({where})")
    assert not undeclared, "\n".join(undeclared)
    # the optional features' packages have extras of their own (not only the test extra)
    assert {"pyarrow", "datasets"} <= declared["data"] and "wandb" in declared["wandb"]
    assert "pyzmq" in declared["core"]


# ------------------------------------------------------------------------- the package graph, entry points
# The commands (`python -m rljax.<name>`): they parse and call; no library module imports one.
ENTRY_POINTS = (
    "rljax.main",
    "rljax.launch",
    "rljax.preflight",
    "rljax.replay",
    "rljax.report",
    "rljax.monitor",
    "rljax.eval",
    "rljax.export",
    "rljax.metrics.__main__",
    "rljax.models.fetch",
    "rljax.rollout.serve",
)


def module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def unit_of(name: str) -> str | None:
    """The package (or top-level module) of rljax that the module `name` belongs to: rljax.<first part>;
    None outside rljax or for a name that is not one of its modules (`from rljax import config` records
    `rljax.config`, a package, which counts; a class in a module counts as its module)."""
    parts = name.split(".")
    if parts[0] != "rljax" or len(parts) < 2:
        return None
    base = REPO / "rljax" / parts[1]
    return f"rljax.{parts[1]}" if base.is_dir() or base.with_suffix(".py").is_file() else None


def package_graph() -> dict[str, dict[str, str]]:
    """{unit: {unit it imports: "file:line" of the first such import}}: every import counts, the lazy ones
    inside functions too (they run as surely as the others, only later)."""
    graph: dict[str, dict[str, str]] = {}
    for f in sorted((REPO / "rljax").rglob("*.py")):
        src = unit_of(module_name(f))
        for name, line in sorted(import_lines(f).items(), key=lambda item: item[1]):
            dst = unit_of(name)
            if dst not in (None, src):
                graph.setdefault(src, {}).setdefault(dst, f"{f.relative_to(REPO)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = {"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}
    assert cycles(planted) == [["a", "b", "c"]]
    assert cycles({"a": {"b": ""}, "b": {"c": ""}, "d": {"a": ""}}) == []


def test_the_package_graph_has_no_cycle():
    graph = package_graph()
    assert graph.get("rljax.loop") and graph.get("rljax.rollout")  # the graph was read
    report = [
        f"{a} -> {b} ({graph[a][b]})" for c in cycles(graph) for a in c for b in graph.get(a, {}) if b in c
    ]
    assert not report, "packages import each other:\n" + "\n".join(report)


def test_no_library_module_imports_an_entry_point():
    bad = []
    for f in sorted((REPO / "rljax").rglob("*.py")):
        if module_name(f) in ENTRY_POINTS:
            continue  # a command may call another's functions (launch runs preflight's checks)
        for name in imports_of(f):
            if any(name == e or name.startswith(e + ".") for e in ENTRY_POINTS):
                bad.append(f"{f.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_every_entry_point_is_a_command():
    for name in ENTRY_POINTS:
        text = (REPO / (name.replace(".", "/") + ".py")).read_text()
        assert name.endswith("__main__") or '__name__ == "__main__"' in text, name


def test_jax_internals_are_imported_in_one_adapter_only():
    """`jax._src` (private, moves between releases) only in `rljax.distributed.kv_client`, which says why."""
    users = sorted(
        str(f.relative_to(REPO))
        for root in ("rljax", "kernels")
        for f in (REPO / root).rglob("*.py")
        if any(n == "jax._src" or n.startswith("jax._src.") for n in imports_of(f))
    )
    assert users == ["rljax/distributed.py"], users


def test_the_pure_metric_modules_stay_pure():
    for name in PURE_METRICS:
        f = REPO / (name.replace(".", "/") + ".py")
        outside = [n for n in imports_of(f) if not allowed(n, {"numpy", "rljax.registry", *PURE_METRICS})]
        assert not [n for n in outside if n != "__future__"], (name, outside)
