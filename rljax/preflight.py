"""Preflight: catches impossible setups before anything is allocated, one clear line per problem.

Checks: the mesh against the devices and processes, batch divisibility (global batch, group size,
minibatches, micro-batch, per-device share), the trainer's per-device memory against the budget
(`mesh.device_memory_gib`, else the device's own), the rollout server's memory budget, and the
reachability of configured rollout servers. Memory is read from the compiler: the train step and the
log-prob passes are compiled for the configured shapes (`rljax.memory`, nothing allocated); the hand
formula `estimate_train_memory` is only the fallback where that is impossible, and says why.

Library: `run_preflight(cfg, num_devices=..., num_processes=..., device_memory_bytes=..., rollout_urls=...)`
returns the failures (empty list: go). Command line, same arguments as `rljax.main` (under srun every task
joins the JAX job first, so the device count is the whole job's):
    python -m rljax.preflight --config=configs/grpo.py:smoke [--config.a.b=v ...] [--workdir=DIR]
It prints the per-device memory report, then exits 0 with `preflight: ok ...`, or prints each failure as
`preflight: FAIL <field>: <why>` and exits 2.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

from rljax import config as config_lib
from rljax import runtime
from rljax.config import Config
from rljax.memory_formula import (  # the hand formula (the fallback); its names stay reachable from here
    ModelShape,
    estimate_train_memory,
    estimated_peak,
    keeps_activations,
    read_model_shape,
)

GIB = 1024**3
ROLLOUT_OVERHEAD = 1.2  # vLLM's weights + activation/graph workspace, relative to the weights alone


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
    need = config_lib.algo_family(cfg).min_group_size  # rljax.algos.FAMILIES
    if ro.group_size < need:
        out.append(
            f"rollout.group_size: algo.family={cfg.algo.family!r} needs at least {need} samples per prompt"
        )
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
    if not tr.tokens_per_micro_batch and micro % data_parallel:  # packed rows are rounded up to it
        out.append(
            f"trainer.micro_batch_size: the micro-batch of {micro} sequences does not split over "
            f"data*fsdp = {data_parallel} devices ({micro / data_parallel:g} per device)"
        )
    return out


def memory_budget(cfg: Config, device_memory_bytes: int) -> tuple[float, str]:
    """(bytes one device may hold, its source): `mesh.device_memory_gib` if set, else the device's own."""
    if cfg.mesh.device_memory_gib > 0:
        return cfg.mesh.device_memory_gib * GIB, "mesh.device_memory_gib"
    return float(device_memory_bytes), "the device's own"


def compiled_memory(cfg: Config, num_devices: int) -> tuple[dict | None, str]:
    """(per-function CompiledMemory report, "") for the configured shapes, compiled on this process's
    devices (rljax.memory); or (None, why compiling is impossible here). Other errors propagate (a step
    that cannot be traced or sharded here fails the run as well)."""
    import jax  # after runtime.initialize_jax has set the device count

    from rljax import memory, models
    from rljax.sharding import make_mesh

    if jax.device_count() != num_devices:
        return None, f"this process sees {jax.device_count()} devices, the check is for {num_devices}"
    try:
        model_config = models.read_model_config(cfg.model.path)
    except ValueError as e:  # an architecture the trainer cannot build: the formula still applies
        return None, f"model.path config.json: {e}"
    mesh = make_mesh(**config_lib.mesh_shape(cfg.mesh, num_devices))
    try:
        return memory.compiled_train_memory(cfg, model_config, mesh, memory.shapes_from_config(cfg)), ""
    except RuntimeError as e:  # XLA's own errors (JaxRuntimeError) and backends without memory analysis
        return None, f"compiling failed: {str(e).splitlines()[0][:300]}"


def _compiled_need(cfg: Config, report: dict) -> tuple[float, str]:
    """(bytes at the peak, the detail) of a compiled report."""
    from rljax.memory import format_report, peak_function

    peak = peak_function(report)
    rows, seq = cfg.rollout.batch_size, cfg.rollout.vllm.max_model_len
    detail = f"at its peak ({peak}); compiled for {rows} rows x {seq} tokens: " + format_report(report)
    return report[peak].total_bytes, detail


def check_memory(
    cfg: Config,
    shape: ModelShape,
    num_devices: int,
    device_memory_bytes: int,
    *,
    compiled: bool = True,
    log=lambda line: None,
) -> list[str]:
    """The trainer's per-device memory against the budget (and, with vLLM beside it, the share vLLM
    reserves). Compiled numbers (`compiled_memory`) when `compiled` and possible, else the hand formula
    (`estimate_train_memory`); `log(line)` gets the numbers, or why it fell back to the formula."""
    budget, source = memory_budget(cfg, device_memory_bytes)
    colocated = not cfg.rollout.vllm.urls
    reserved = cfg.rollout.vllm.gpu_memory_utilization * budget if colocated else 0.0
    try:
        report, why = compiled_memory(cfg, num_devices) if compiled else (None, "compilation not requested")
    except ValueError as e:  # e.g. a mesh axis that does not divide a dimension: the run would fail too
        return [f"memory: the train step cannot be built for this setup: {e}"]
    if report is None:
        log(f"memory: hand-formula estimate, not compiled ({why})")
        parts = estimate_train_memory(cfg, shape, num_devices)
        total = estimated_peak(parts)
        detail = "hand formula: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)
    else:
        total, detail = _compiled_need(cfg, report)
        log(f"memory per device, GiB, {detail}; budget {budget / GIB:.2f} GiB ({source})")
    if total + reserved <= budget:
        return []
    vllm = f" + vLLM's {reserved / GIB:.2f} GiB (rollout.vllm.gpu_memory_utilization)" if reserved else ""
    remat = ", or set model.remat=full" if keeps_activations(cfg.model.remat) else ""
    return [
        f"memory: the trainer needs {total / GIB:.2f} GiB per device ({detail}){vllm}, but a device has "
        f"{budget / GIB:.2f} GiB ({source}); shard more (mesh.fsdp/tensor) or lower "
        f"trainer.micro_batch_size{remat}"
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
        f"~{(weights + kv) / GIB:.2f} GiB (weights {weights / GIB:.2f} with workspace, KV cache of one "
        f"{vcfg.max_model_len}-token sequence {kv / GIB:.3f})"
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
    compiled: bool = True,
    log=lambda line: None,
) -> list[str]:
    """All checks; returns one line per failure (empty: the setup is possible).

    `rollout_urls` defaults to `cfg.rollout.vllm.urls`. Memory checks need `<model.path>/config.json`;
    with `compiled` (and `num_devices` devices in this process) they compile the train step and log-prob
    passes for the configured shapes (`check_memory`); `log(line)` receives the memory report.
    """
    failures = check_mesh(cfg, num_devices, num_processes) + check_batches(cfg, num_devices)
    config_json = os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(config_json):
        failures.append(
            f"model.path: {cfg.model.path!r} has no config.json (a local Hugging Face checkpoint)"
        )
    elif not failures:  # the estimate needs a valid mesh and batch split
        shape = read_model_shape(cfg.model.path)
        failures += check_memory(cfg, shape, num_devices, device_memory_bytes, compiled=compiled, log=log)
        failures += check_rollout_budget(cfg, shape, memory_budget(cfg, device_memory_bytes)[0])
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
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = runtime.config_from_args(args)
    except config_lib.ConfigError as e:
        print(f"preflight: FAIL config: {e}", flush=True)
        return 2
    from rljax.models.fetch import with_model_fetched

    cfg = with_model_fetched(cfg)  # a fetchable model name: its converted directory (fetched once)
    runtime.initialize_jax()
    import jax

    failures = collective_check() if jax.process_count() > 1 else []
    failures += run_preflight(
        cfg,
        num_devices=jax.device_count(),
        num_processes=jax.process_count(),
        device_memory_bytes=device_memory_bytes(),
        log=lambda line: print(f"preflight: {line}", flush=True),
    )
    for line in failures:
        print(f"preflight: FAIL {line}", flush=True)
    if not failures:
        print(f"preflight: ok ({jax.process_count()} processes, {jax.device_count()} devices)", flush=True)
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
