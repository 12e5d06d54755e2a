"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import sys  # noqa: E402

import pytest  # noqa: E402

# Shared test helpers (servers, clusters, worker scripts) live in tests/support/, importable by name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

# Session-scoped fixtures: vLLM servers shared by the rollout, sync and end-to-end tests; one Slurm cluster.
pytest_plugins = ["vllm_server", "slurm_cluster"]


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
