"""Preflight: catches impossible setups before anything is allocated, one clear line per problem.

Checks: the mesh against the devices and processes, batch divisibility (global batch, group size,
minibatches, micro-batch, per-device share), a per-device memory estimate (parameters, gradients, optimizer
state, reference/critic copies, activations, log-prob chunks) from the model's config.json against device
memory, the rollout server's memory budget, and the reachability of configured rollout servers.

Library: `run_preflight(cfg, num_devices=..., num_processes=..., device_memory_bytes=..., rollout_urls=...)`
returns the failures (empty list: go). Command line, same arguments as `rljax.main` (under srun every task
joins the JAX job first, so the device count is the whole job's):
    python -m rljax.preflight --config=configs/grpo.py:smoke [--config.a.b=v ...] [--workdir=DIR]
It exits 0 and prints `preflight: ok ...`, or prints each failure as `preflight: FAIL <field>: <why>` and
exits 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import urllib.error
import urllib.request

from rljax import config as config_lib
from rljax.config import Config

GIB = 1024**3
LOGPROB_CHUNK = (
    4096  # vocab chunk width of rljax.kernels' fused log-prob impls (kernels/xla.py DEFAULT_CHUNK)
)
ROLLOUT_OVERHEAD = 1.2  # vLLM's weights + activation/graph workspace, relative to the weights alone


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder read from a Hugging Face config.json."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    serve_bytes: int  # bytes per parameter of the checkpoint's torch_dtype (what vLLM loads)

    @property
    def num_params(self) -> int:
        """Parameter count: embeddings, per-layer attention + SwiGLU MLP + norms, final norm, lm_head."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * d * self.intermediate + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        return self.vocab * d * (1 if self.tied else 2) + self.layers * layer + d


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def read_model_shape(model_path: str) -> ModelShape:
    """ModelShape from `<model_path>/config.json` (Qwen2, Qwen3, Llama field names)."""
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    heads = int(c["num_attention_heads"])
    return ModelShape(
        vocab=int(c["vocab_size"]),
        hidden=int(c["hidden_size"]),
        intermediate=int(c["intermediate_size"]),
        layers=int(c["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),  # HF: absent means multi-head attention
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),  # HF: absent means hidden / heads
        tied=bool(c.get("tie_word_embeddings", False)),  # HF PretrainedConfig default
        qkv_bias=c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)),
        qk_norm=c.get("model_type") == "qwen3",
        serve_bytes=_DTYPE_BYTES.get(str(c.get("torch_dtype") or c.get("dtype") or "bfloat16"), 2),
    )


# ------------------------------------------------------------------------------------------ checks
def check_mesh(cfg: Config, num_devices: int, num_processes: int) -> list[str]:
    """Mesh sizes vs the device count, and devices spread evenly over processes."""
    out = []
    if num_processes < 1 or num_devices % num_processes:
        out.append(f"devices: {num_devices} devices cannot be spread evenly over {num_processes} processes")
    try:
        config_lib.mesh_shape(cfg.mesh, num_devices)
    except config_lib.ConfigError as e:
        out.append(str(e))
    return out


def check_batches(cfg: Config, num_devices: int) -> list[str]:
    """Global batch vs group size and minibatches; micro-batch vs minibatch and the data-parallel devices."""
    ro, tr = cfg.rollout, cfg.trainer
    out = []
    if ro.group_size < 1 or ro.batch_size % ro.group_size:
        out.append(
            f"rollout.batch_size: {ro.batch_size} is not divisible by rollout.group_size={ro.group_size}"
        )
    if cfg.algo.family == "grpo" and ro.group_size < 2:
        out.append("rollout.group_size: GRPO needs at least 2 samples per prompt")
    if tr.minibatches < 1 or ro.batch_size % tr.minibatches:
        out.append(
            f"trainer.minibatches: {tr.minibatches} does not divide rollout.batch_size={ro.batch_size}"
        )
        return out
    minibatch = ro.batch_size // tr.minibatches
    micro = tr.micro_batch_size or minibatch
    if minibatch % micro:
        out.append(
            f"trainer.micro_batch_size: {micro} does not divide the minibatch of {minibatch} sequences"
        )
    try:
        sizes = config_lib.mesh_shape(cfg.mesh, num_devices)
    except config_lib.ConfigError:
        return out  # reported by check_mesh
    data_parallel = sizes["data"] * sizes["fsdp"]
    if micro % data_parallel:
        out.append(
            f"trainer.micro_batch_size: the micro-batch of {micro} sequences does not split over "
            f"data*fsdp = {data_parallel} devices ({micro / data_parallel:g} per device)"
        )
    return out


def estimate_train_memory(cfg: Config, shape: ModelShape, num_devices: int) -> dict[str, float]:
    """Bytes per device of the trainer, by part: params, grads, optimizer, reference, critic, activations,
    logprob_chunks. Parameters shard over fsdp*tensor; activations of one micro-batch per device.

    References: activations per layer ~ s*b*h*(34 + 5*a*s/h) bytes in 16-bit, 2*s*b*h with full remat
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4).
    """
    sizes = config_lib.mesh_shape(cfg.mesh, num_devices)
    model_shards = sizes["fsdp"] * sizes["tensor"]
    param_bytes = _DTYPE_BYTES[cfg.model.param_dtype]
    params = shape.num_params * param_bytes / model_shards
    optimizer = 2 * params if cfg.optim.name == "adamw" else 0.0  # adam's mu and nu, in the param dtype
    minibatch = cfg.rollout.batch_size // cfg.trainer.minibatches
    micro = cfg.trainer.micro_batch_size or minibatch
    seqs = max(1, micro // (sizes["data"] * sizes["fsdp"]))
    seq_len = cfg.rollout.vllm.max_model_len  # the longest length bucket
    scale = _DTYPE_BYTES[cfg.model.compute_dtype] / 2  # the reference formula counts 16-bit activations
    tokens, d = seqs * seq_len, shape.hidden
    if cfg.model.remat != "none":
        per_layer = 2 * tokens * d * scale
    else:
        per_layer = tokens * d * (34 + 5 * shape.heads * seq_len / d) * scale / sizes["tensor"]
    chunk = min(shape.vocab, LOGPROB_CHUNK)
    parts = {
        "params": params,
        "grads": params,
        "optimizer": optimizer,
        "reference": params if cfg.algo.beta > 0 else 0.0,
        "critic": 4 * params if cfg.algo.family == "ppo" else 0.0,  # its params, grads, adam moments
        "activations": shape.layers * per_layer,
        "logprob_chunks": 3 * tokens * chunk * 4,  # f32 logits, softmax and its gradient for one chunk
    }
    return parts


def check_memory(cfg: Config, shape: ModelShape, num_devices: int, device_memory_bytes: int) -> list[str]:
    """The trainer's estimate against device memory (and, with vLLM beside it, the share vLLM reserves)."""
    parts = estimate_train_memory(cfg, shape, num_devices)
    total = sum(parts.values())
    colocated = not cfg.rollout.vllm.urls
    reserved = cfg.rollout.vllm.gpu_memory_utilization * device_memory_bytes if colocated else 0.0
    if total + reserved <= device_memory_bytes:
        return []
    detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)
    vllm = f" + vLLM's {reserved / GIB:.2f} GiB (rollout.vllm.gpu_memory_utilization)" if reserved else ""
    return [
        f"memory: the trainer needs ~{total / GIB:.2f} GiB per device ({detail}){vllm}, but a device has "
        f"{device_memory_bytes / GIB:.2f} GiB; shard more (mesh.fsdp/tensor), lower "
        "trainer.micro_batch_size, or set model.remat=full"
    ]


def check_rollout_budget(cfg: Config, shape: ModelShape, device_memory_bytes: int) -> list[str]:
    """vLLM's reserved memory (gpu_memory_utilization * device memory) must hold the weights plus the KV
    cache of at least one max_model_len sequence."""
    vcfg = cfg.rollout.vllm
    budget = vcfg.gpu_memory_utilization * device_memory_bytes
    weights = shape.num_params * shape.serve_bytes * ROLLOUT_OVERHEAD
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.serve_bytes * vcfg.max_model_len
    if not 0.0 < vcfg.gpu_memory_utilization <= 1.0:
        return [f"rollout.vllm.gpu_memory_utilization: must be in (0, 1], got {vcfg.gpu_memory_utilization}"]
    if weights + kv <= budget:
        return []
    return [
        f"rollout.vllm.gpu_memory_utilization: {vcfg.gpu_memory_utilization} of "
        f"{device_memory_bytes / GIB:.2f} GiB is {budget / GIB:.2f} GiB, but vLLM needs "
        f"~{(weights + kv) / GIB:.2f} GiB (weights "
        f"{weights / GIB:.2f} with workspace, KV cache of one {vcfg.max_model_len}-token sequence "
        f"{kv / GIB:.3f})"
    ]


def check_urls(urls, timeout_s: float = 2.0) -> list[str]:
    """Each rollout server must answer `GET <url>/health` with 2xx within `timeout_s`."""
    out = []
    for url in urls:
        health = url.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout_s) as resp:
                status = resp.status
        except urllib.error.HTTPError as e:
            status = e.code
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            out.append(f"rollout.vllm.urls: {url} is not reachable ({reason})")
            continue
        if not 200 <= status < 300:
            out.append(f"rollout.vllm.urls: {url} answered HTTP {status} on /health (not ready)")
    return out


def run_preflight(
    cfg: Config,
    *,
    num_devices: int,
    num_processes: int,
    device_memory_bytes: int,
    rollout_urls=None,
    url_timeout_s: float = 2.0,
) -> list[str]:
    """All checks; returns one line per failure (empty: the setup is possible).

    `rollout_urls` defaults to `cfg.rollout.vllm.urls`. Memory checks need `<model.path>/config.json`.
    """
    failures = check_mesh(cfg, num_devices, num_processes) + check_batches(cfg, num_devices)
    config_json = os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(config_json):
        failures.append(
            f"model.path: {cfg.model.path!r} has no config.json (a local Hugging Face checkpoint)"
        )
    elif not failures:  # the estimate needs a valid mesh and batch split
        shape = read_model_shape(cfg.model.path)
        failures += check_memory(cfg, shape, num_devices, device_memory_bytes)
        failures += check_rollout_budget(cfg, shape, device_memory_bytes)
    urls = cfg.rollout.vllm.urls if rollout_urls is None else rollout_urls
    return failures + check_urls(urls, url_timeout_s)


# ------------------------------------------------------------------------------------------ machine
def device_memory_bytes() -> int:
    """Memory of one local device: the accelerator's limit, or on CPU host RAM split over local devices."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // jax.local_device_count()


def collective_check() -> list[str]:
    """Sums each device's (process_index + 1) over all processes; a wrong total means a broken JAX job."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("d",))
    local = np.full((jax.local_device_count(),), jax.process_index() + 1, np.float32)
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")), local)
    total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(arr))
    counts = [jax.local_device_count()] * jax.process_count()  # evenly spread (checked by check_mesh)
    expected = float(sum((p + 1) * n for p, n in enumerate(counts)))
    if total != expected:
        return [
            f"jax.distributed: collective sum over {jax.device_count()} devices is {total}, "
            f"expected {expected}"
        ]
    return []


def main(argv: list[str] | None = None) -> int:
    """CLI: joins the JAX job, runs every check on this machine, prints the result. Returns the exit code."""
    from rljax import runtime
    from rljax.launch import config_from_args

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from_args(args)
    except config_lib.ConfigError as e:
        print(f"preflight: FAIL config: {e}", flush=True)
        return 2
    runtime.initialize_jax()
    import jax

    failures = collective_check() if jax.process_count() > 1 else []
    failures += run_preflight(
        cfg,
        num_devices=jax.device_count(),
        num_processes=jax.process_count(),
        device_memory_bytes=device_memory_bytes(),
    )
    for line in failures:
        print(f"preflight: FAIL {line}", flush=True)
    if not failures:
        print(f"preflight: ok ({jax.process_count()} processes, {jax.device_count()} devices)", flush=True)
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
