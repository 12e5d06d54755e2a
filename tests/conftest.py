"""Test setup: 8 simulated CPU devices, quick XLA compiles and one compilation cache shared by every JAX
process of the run (tests/support/jax_env.py), set before JAX is imported anywhere."""

import atexit
import os
import shutil
import sys
import tempfile

# Shared test helpers (servers, clusters, worker scripts) live in tests/support/, importable by name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import jax_env  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ours = {f.split("=")[0] for f in jax_env.xla_flags(8).split()}
_kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in _ours]
os.environ["XLA_FLAGS"] = " ".join([*_kept, jax_env.xla_flags(8)])
os.environ.update(jax_env.CACHE_ENV)
# Bytecode is written and reused: with PYTHONDONTWRITEBYTECODE set (as on these machines) each of the run's
# ~100 Python processes that import rljax (workers, `rljax.main` runs, notebook kernels, multi-process
# workers) would compile its 20k lines from source again (~0.8 CPU-s each: `import rljax.main,
# rljax.loop.train` 3.1 vs 2.4 CPU-s).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Every vLLM engine the suite starts (servers, offline `LLM`s, in the test process or any child, Slurm jobs
# included: they inherit this environment) runs its model worker inside the engine-core process, vLLM's own
# switch for that. On the CPU build a server is then two interpreters, not three: ~10 CPU-s and ~10 s less
# per start (~24 starts a run) and ~0.6 GB less. Tests that need vLLM's default process layout set "1".
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # one for this run, removed at its end
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rljax-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)

import pytest  # noqa: E402

# Shared vLLM servers and one Slurm cluster, each kept while the tests that use it run (in a row: parallel.py
# groups and orders the tests for pytest-xdist).
pytest_plugins = ["shared", "parallel", "vllm_server", "slurm_cluster"]


def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marker gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
