#!/usr/bin/env bash
# Downloads, on a machine with a package registry, the wheels that scripts/gpu_check.sh needs and the GPU
# image lacks (Python 3.12, manylinux x86_64) into .whl/ at the repo root (ignored by git); the device tool
# carries that folder (`carry: [".whl"]`) and gpu_check.sh installs it with --no-deps into /tmp/site.
#   usage: scripts/gpu_wheels.sh            (PYTHON=... to choose the pip's Python; default python3)
# The image ships jax 0.11.2 + jax-cuda13-plugin, triton 3.6.0, torch, absl-py, PyYAML, chex, optax, pytest,
# pytest-timeout, aiohttp, requests (/work/.library/device/KINDS.md); what rljax's check imports beyond that:
#   jax-triton 0.3.1 (needs jax>=0.8.2, triton>=3.6, absl-py), ml-collections 1.1.0 (needs absl-py, PyYAML).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WHEELS=("jax-triton==0.3.1" "ml-collections==1.1.0")
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
mkdir -p "$REPO/.whl"
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$REPO/.whl")
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
"$PY" -m pip download "${args[@]}" "${WHEELS[@]}"
ls -l "$REPO/.whl"
du -sh "$REPO/.whl"
