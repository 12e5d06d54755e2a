"""XLA settings for every JAX process the suite starts, the test process and its children alike.

The suite's programs are tiny and each runs a few times, so compiling them dominates its CPU time:
XLA's CPU backend compiles without LLVM's optimisation passes (a third of the compile time; the HLO, its
fusions, sharding and buffer assignment are the same) and emits its fusions with the classic elemental IR
emitter instead of the MLIR fusion emitters (the same fused HLO; compiling tests/trainer/test_onpolicy.py's
76 programs took 30.0 s with them, 11.8 s without), and every process shares one persistent compilation
cache for the run, so a step compiled by one test is loaded, not compiled, by the next test or subprocess
that builds the same program. `JAX_COMPILATION_CACHE_DIR` set beforehand keeps the cache across runs.
"""

import os

FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)
CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process: quick compiles, and `devices` simulated CPU devices (None: one)."""
    flags = list(FAST_COMPILE_FLAGS)
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={int(devices)}")
    return " ".join(flags)


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a JAX subprocess with `devices` simulated devices (None: one, as on
    a laptop), plus `extra`."""
    return {**os.environ, "XLA_FLAGS": xla_flags(devices), **extra}
