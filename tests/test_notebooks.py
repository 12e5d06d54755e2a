"""The notebooks run top to bottom on CPU (nbclient, the test's own Python as the kernel) and are committed
stripped of outputs and in step with their sources in notebooks/src/.

Each notebook builds what it needs (01 and 02 start the real vLLM CPU build once each); the kernel gets
JAX_PLATFORMS=cpu and no simulated-device XLA flag (conftest's 8 devices are for this process only).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["01_grpo_quickstart", "02_logprob_parity", "03_fused_logprobs", "04_algorithms"]
VLLM_NOTEBOOKS = {"01_grpo_quickstart", "02_logprob_parity"}
CELL_TIMEOUT_S = 240  # a hung cell (e.g. a vLLM server that never comes up) fails instead of blocking

sys.path.insert(0, str(NOTEBOOKS))
import build_notebooks  # noqa: E402


def kernel_env() -> dict[str, str]:
    """The test's environment minus the simulated-device flag, CPU-only JAX, this venv first on PATH."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    env["JAX_PLATFORMS"] = "cpu"
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    return env


def test_notebooks_exist_and_are_stripped():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == NAMES
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code, name
        for cell in code:
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs not stripped"
        assert code[0].source == build_notebooks.INSTALL_CELL, f"{name}: must start with the install cell"


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_matches_its_source(name):
    built = build_notebooks.build_notebook(NOTEBOOKS / "src" / f"{name}.py")
    committed = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [
        (c.cell_type, c.source) for c in built.cells
    ], f"{name}.ipynb is out of date: run .venv/bin/python notebooks/build_notebooks.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.vllm) if n in VLLM_NOTEBOOKS else n for n in NAMES]
)
def test_notebook_executes(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",  # jupyter_client runs a "python" kernelspec with sys.executable (the venv)
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
        allow_errors=False,  # any cell error raises CellExecutionError
    )
    env = kernel_env() | {"RLJAX_NOTEBOOK_WORKDIR": str(tmp_path)}
    start = time.perf_counter()
    client.execute(env=env)
    elapsed = time.perf_counter() - start
    print(f"{name}: executed in {elapsed:.1f} s")
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in ran), f"{name}: not every cell ran"
    assert any(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
        for c in ran
        for o in c.outputs
    ), f"{name}: drew no plot"
    assert "install skipped" in "".join(o.get("text", "") for o in ran[0].outputs)
