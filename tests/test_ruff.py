"""ruff lint and format are clean over the repository (configured in pyproject.toml)."""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_check_is_clean():
    proc = ruff("check", ".")
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_ruff_format_is_clean():
    proc = ruff("format", "--check", ".")
    assert proc.returncode == 0, proc.stdout[-3000:]
