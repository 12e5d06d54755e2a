"""Builds the committed notebooks (`notebooks/*.ipynb`) from their sources in `notebooks/src/*.py`.

Run: .venv/bin/python notebooks/build_notebooks.py   (rewrites every .ipynb, outputs stripped)

A source is a Python file in "percent" format: `# %%` starts a code cell, `# %% [markdown]` a markdown
cell (its lines are written as `# text`), and `# %% [install]` inserts the shared Colab install cell.
The .ipynb files carry no outputs and `execution_count` None; tests/test_notebooks.py checks that they
match their sources and executes them.
"""

from __future__ import annotations

import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "src"

INSTALL_CELL = """\
# Colab: clone and install rljax (the clone also gives assets/ and configs/). Skipped when rljax imports.
import importlib.util
import os
import shutil
import subprocess
import sys

RLJAX_GIT_URL = os.environ.get("RLJAX_GIT_URL", "https://github.com/rljax/rljax.git")  # or your fork
RLJAX_DIR = os.environ.get("RLJAX_DIR", "/content/rljax")
if importlib.util.find_spec("rljax") is None:
    if not os.path.isdir(RLJAX_DIR):
        subprocess.run(["git", "clone", "--depth=1", RLJAX_GIT_URL, RLJAX_DIR], check=True)
    target = "gpu" if shutil.which("nvidia-smi") else "cpu"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "install", "-q", f"{RLJAX_DIR}[{target}]"], check=True)
    if target == "cpu":  # PyPI's torchvision/torchaudio/torchcodec break transformers next to torch+cpu
        extras = ["torchvision", "torchaudio", "torchcodec"]
        subprocess.run([*pip, "uninstall", "-q", "-y", *extras], check=False)
    importlib.invalidate_caches()
    print(f"installed rljax[{target}] from {RLJAX_DIR}")
else:
    print("rljax is importable: install skipped")"""


def parse_cells(text: str) -> list:
    """Percent-format source -> nbformat cells (no outputs)."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(
                line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.split("\n")
            )
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif kind == "install":
            cells.append(nbformat.v4.new_code_cell(INSTALL_CELL))
        else:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.split("\n"):
        if line.startswith("# %%"):
            flush()
            tag = line[4:].strip()
            kind = {"[markdown]": "markdown", "[install]": "install", "": "code"}[tag]
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def build_notebook(source: pathlib.Path):
    """The notebook for one source file, outputs stripped, with a python3 kernelspec."""
    nb = nbformat.v4.new_notebook()
    nb.cells = parse_cells(source.read_text())
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{source.stem[:2]}-{i:02d}"  # stable ids: rebuilding gives identical files
    nbformat.validate(nb)
    return nb


def main() -> int:
    for source in sorted(SOURCES.glob("*.py")):
        target = HERE / f"{source.stem}.ipynb"
        nbformat.write(build_notebook(source), target)
        print(f"wrote {target.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
