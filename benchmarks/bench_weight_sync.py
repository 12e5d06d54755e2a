"""Weight-sync benchmark: a synthetic ~1 GB float32 state pushed into a running vLLM server (CPU build).

    .venv/bin/python benchmarks/bench_weight_sync.py --gb 1.0 --bucket-mb 64 --workdir /tmp/bench_ws

Builds an untied Qwen2 checkpoint with 2 layers and a big vocab/hidden (so embedding and lm_head dominate,
as in a real 0.5B model), loads it as the trainer's JAX params, starts a server, and prints, measured
in the same run:

- staging (device->host via `rljax.models.iter_hf_tensors`, incl. HF layout transposes, + writing the
  /dev/shm bucket files) against one host memcpy of the same bytes into fresh memory (target <= 3x);
- the pause that generation sees (the longest request of a back-to-back probe stream, and /pause ->
  /resume), with the engine's own part from the worker log (bucket mapping/checks, load_weights
  including per-layer processing such as the CPU GEMM repacking, finalize);
- the whole sync against vLLM reloading the same weights in place from the safetensors directory
  (`/pause`, `/collective_rpc reload_weights(weights_path=...)`, `/resume`; target: our pause shorter).

Variants (`--variants`), run in interleaved rounds (`--repeats`) with a reload in each, medians reported:
`shm` (the default path), `tcp` (bucket bytes streamed over a loopback socket), `shm_layerwise` (every
layer through vLLM's layerwise reload: what the pause was before the direct in-place load).
`--dtype bfloat16` serves in bf16 from the float32 masters (cast on device before staging: half the bytes);
staged bytes per process are printed, and with `--json FILE` written with `model_bytes` (serving dtype).

Sharded staging across processes (`--processes P --devices-per-process D --servers S`, P > 1): the bench
starts S servers, then runs itself as P JAX processes (jax.distributed on localhost, D CPU devices each,
the params loaded into `mesh.fsdp = P * D`); every sync is the loop's own `RolloutEngine.push_weights`
(over `ShardedJaxWeights`):
each process stages only the shards it owns, process 0 pushes every bucket (shm, or tcp from this one
trainer host). Prints per-process staged bytes, bytes this trainer host sends over tcp per push, and the
pause / sync times against vLLM's own reload (medians). E.g.

    .venv/bin/python benchmarks/bench_weight_sync.py --gb 0.2 --processes 2 --devices-per-process 4 \
        --dtype bfloat16 --servers 1 --repeats 2 --variants shm,tcp --json /tmp/ws.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import requests


def build_checkpoint(path: Path, gb: float) -> Path:
    """An untied 2-layer Qwen2 (hidden 1024, head_dim 64) whose vocab makes the fp32 state ~`gb` GB."""
    from safetensors.numpy import save_file

    from rljax.models.tiny import build_tiny_checkpoint, tiny_hf_config

    hidden, inter, layers = 1024, 4096, 2
    per_layer = (
        4 * hidden * hidden - 2 * hidden * hidden // 2 + 3 * hidden * inter
    )  # q,o + k,v (GQA 2x) + mlp
    vocab = max(1024, int((gb * 1e9 / 4 - layers * per_layer) / (2 * hidden)))
    build_tiny_checkpoint(path, "qwen2")  # tokenizer and generation config; weights replaced below
    cfg = tiny_hf_config(
        "qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=16,
        num_kv_heads=8,
        intermediate_size=inter,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    cfg.save_pretrained(str(path))
    import torch
    import transformers

    with torch.device("meta"):
        names = {
            k: tuple(v.shape)
            for k, v in transformers.AutoModelForCausalLM.from_config(cfg).state_dict().items()
        }
    rng = np.random.default_rng(0)
    tensors = {
        k: (0.02 * rng.standard_normal(s, dtype=np.float32))
        if not k.endswith("norm.weight")
        else np.ones(s, np.float32)
        for k, s in names.items()
    }
    for f in path.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def memcpy_seconds(nbytes: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    t = time.perf_counter()
    dst = np.empty_like(src)  # fresh pages, like fresh bucket files
    np.copyto(dst, src)
    return time.perf_counter() - t


class Probe:
    """Back-to-back 1-token requests (straight to the server, not through rljax's gate)."""

    def __init__(self, url: str, model: str, headers: dict):
        self.url, self.model, self.spans, self._stop = url, model, [], threading.Event()
        self.headers = headers  # the server's bearer token
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        body = {"model": self.model, "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0.0}
        while not self._stop.is_set():
            t = time.perf_counter()
            r = requests.post(self.url + "/v1/completions", json=body, headers=self.headers, timeout=120)
            r.raise_for_status()
            self.spans.append((t, time.perf_counter()))

    def __enter__(self):
        self._thread.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)
        self._stop.set()
        self._thread.join()

    def longest(self) -> float:
        return max(b - a for a, b in self.spans)

    def typical(self) -> float:
        return float(np.median([b - a for a, b in self.spans]))


def last_engine_timing(log_path: Path) -> dict:
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if "rljax-shm update:" in ln]
    # the worker's timing line: buckets, bytes, start_s, map_s, recv_s, load_s, finalize_s, direct
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", lines[-1].split("rljax-shm update:")[1])}


def vllm_reload_seconds(url: str, weights_dir: str, headers: dict) -> float:
    t = time.perf_counter()
    requests.post(url + "/pause", params={"mode": "wait"}, headers=headers, timeout=60).raise_for_status()
    body = {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}, "timeout": 600}
    r = requests.post(url + "/collective_rpc", json=body, headers=headers, timeout=600)
    r.raise_for_status()
    requests.post(url + "/resume", headers=headers, timeout=60).raise_for_status()
    return time.perf_counter() - t


VARIANTS = {  # name -> SyncOptions overrides
    "shm": {},
    "tcp": {"transport": "tcp"},
    "shm_layerwise": {"direct_load": False},  # every layer through vLLM's layerwise reload
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every variant + reload")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    ap.add_argument("--workdir", default="/tmp/rljax_bench_weight_sync")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="serving dtype")
    ap.add_argument("--json", default="", help="also write model_bytes and staged_bytes_per_process here")
    ap.add_argument("--processes", type=int, default=1, help="trainer processes (jax.distributed)")
    ap.add_argument("--devices-per-process", type=int, default=1, help="CPU devices per trainer process")
    ap.add_argument("--servers", type=int, default=1, help="vLLM servers (replicas) pushed to")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "ID,PORT": one trainer process
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}; valid: {', '.join(VARIANTS)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.worker:
        from bench_ws_sharded import run_worker

        return run_worker(args, VARIANTS)
    if args.processes > 1:
        from bench_ws_sharded import run_sharded

        return run_sharded(args, variants, build_checkpoint, Probe, vllm_reload_seconds)
    import dataclasses

    import jax
    import jax.numpy as jnp

    from rljax import models
    from rljax.config import CANARY_TOLERANCES
    from rljax.distributed import cast_params
    from rljax.rollout import HostWeights, RolloutEngine, ServerOptions
    from rljax.weight_sync import SyncOptions, stage_buckets

    work = Path(args.workdir)
    ckpt = build_checkpoint(work / "ckpt", args.gb)
    config, params = models.load_hf_checkpoint(ckpt)  # float32 masters

    def served():  # cast on device to the serving dtype, then one tensor at a time to the host
        return models.iter_hf_tensors(config, cast_params(params, args.dtype), args.dtype)

    nbytes = sum(a.nbytes for _, a in served())
    staged_per_process = [nbytes]  # one trainer process stages every tensor
    print(
        f"state: {nbytes / 1e9:.3f} GB {args.dtype} (float32 masters), vocab {config.vocab_size},"
        f" bucket {args.bucket_mb} MiB; staged bytes per process: {staged_per_process}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model_bytes": nbytes, "staged_bytes_per_process": staged_per_process})
        )

    copy_s = memcpy_seconds(nbytes)
    t = time.perf_counter()
    buckets = list(stage_buckets(served(), bucket_bytes=args.bucket_mb << 20))
    stage_s = time.perf_counter() - t
    for b in buckets:
        b.unlink()

    logits_fn = jax.jit(lambda ids: jax.nn.log_softmax(models.forward(config, params, ids)[0], -1))

    def trainer_logprobs(prompt, completion):
        lp = np.asarray(logits_fn(jnp.asarray([list(prompt) + list(completion)], jnp.int32)))
        return lp[np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1), completion]

    opts = ServerOptions(gpu_memory_utilization=0.1, max_model_len=512, dtype=args.dtype)
    base = SyncOptions(bucket_bytes=args.bucket_mb << 20, canary_tolerance=CANARY_TOLERANCES[args.dtype])
    engine = RolloutEngine.launch(ckpt, work / "server", server_options=opts, sync_options=base)
    weights = HostWeights(trainer_logprobs)
    rows: dict[str, list[dict]] = {v: [] for v in variants + ["vllm_reload"]}
    try:
        url, model = engine.urls[0], engine.client.model
        engine.push_weights(weights.snapshot(served()), 1)  # warm-up
        version = 1
        for _ in range(args.repeats):  # interleaved, so the shared machine's load hits every variant alike
            for v in variants:
                engine.syncer.options = dataclasses.replace(base, **VARIANTS[v])
                version += 1
                with Probe(url, model, engine.syncer.headers) as probe:
                    m = engine.push_weights(weights.snapshot(served()), version)
                timing = last_engine_timing(engine.servers[0].log_path)
                rows[v].append(
                    {
                        "probe_longest_s": probe.longest(),
                        "probe_typical_s": probe.typical(),
                        "pause_s": m["weight_sync/pause_seconds"],
                        "stage_in_sync_s": m["weight_sync/stage_seconds"],
                        "sync_s": m["weight_sync/seconds"],
                        "canary_s": m["weight_sync/seconds"]
                        - m["weight_sync/stage_seconds"]
                        - m["weight_sync/pause_seconds"],
                        "canary_max_abs_diff": m["weight_sync/canary_logprob_max_abs_diff"],
                    }
                    | {f"engine_{k}": val for k, val in timing.items()}
                )
            with Probe(url, model, engine.syncer.headers) as probe:
                reload_s = vllm_reload_seconds(url, str(ckpt), engine.syncer.headers)
            rows["vllm_reload"].append({"probe_longest_s": probe.longest(), "pause_s": reload_s})
    finally:
        engine.close()
    print_report({"bytes": nbytes, "memcpy_s": copy_s, "stage_s": stage_s}, rows)


def _median(rows: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in rows if key in r]))


def print_report(head: dict, rows: dict[str, list[dict]]) -> None:
    """Every round as JSON, then medians: staging vs memcpy, each variant's pause vs vLLM's reload."""
    print(json.dumps({**head, "rounds": rows}, indent=1))
    print(f"staging / memcpy : {head['stage_s'] / head['memcpy_s']:.2f}x (target <= 3x)")
    reload = _median(rows["vllm_reload"], "probe_longest_s")
    print(
        f"vLLM reload      : pause seen by generation {reload:.2f} s (median of {len(rows['vllm_reload'])})"
    )
    for v, rs in rows.items():
        if v == "vllm_reload":
            continue
        pause = _median(rs, "probe_longest_s")
        parts = " + ".join(
            f"{k[len('engine_') : -2]} {_median(rs, k):.2f}"
            for k in ("engine_map_s", "engine_recv_s", "engine_load_s", "engine_finalize_s")
        )
        print(
            f"{v:<17}: pause {pause:.2f} s = {pause / reload:.2f}x reload (target < 1); engine {parts};"
            f" /pause->/resume {_median(rs, 'pause_s'):.2f} s;"
            f" outside the pause (tcp prefetch, canary) {_median(rs, 'canary_s'):.2f} s;"
            f" whole sync {_median(rs, 'sync_s'):.2f} s"
        )


if __name__ == "__main__":
    main()
