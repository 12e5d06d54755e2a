"""The multi-process half of `bench_weight_sync.py` (`--processes P > 1`): sharded staging across JAX
processes on one host. `run_sharded` starts the servers and P copies of the bench as trainer processes
(`run_worker`), then measures vLLM's own reload for the ratio and prints the report."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_ENV = "RLJAX_BENCH_WS"  # JSON for the worker processes: urls, token file, checkpoint, output file


def run_sharded(args, variants, build_checkpoint, Probe, reload_seconds) -> None:
    from rljax.rollout import RolloutEngine, ServerOptions

    work = Path(args.workdir)
    ckpt = build_checkpoint(work / "ckpt", args.gb)
    opts = ServerOptions(gpu_memory_utilization=0.1, max_model_len=512, dtype=args.dtype)
    engine = RolloutEngine.launch(ckpt, work / "server", replicas=args.servers, server_options=opts)
    try:
        token_file = work / "token"
        token_file.write_text(engine.token or "")
        token_file.chmod(0o600)
        out = work / "sharded.json"
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}")
        env[_ENV] = json.dumps(
            {"urls": engine.urls, "token_file": str(token_file), "ckpt": str(ckpt), "out": str(out)}
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = list(sys.argv[1:])
        procs = [
            subprocess.Popen([sys.executable, sys.argv[0], *argv, "--worker", f"{i},{port}"], env=env)
            for i in range(args.processes)
        ]
        codes = [p.wait() for p in procs]
        if codes != [0] * len(procs):
            raise SystemExit(f"bench: trainer processes exited with {codes}")
        result = json.loads(out.read_text())
        reload = []
        for _ in range(args.repeats):
            with Probe(engine.urls[0], engine.client.model, engine.syncer.headers) as probe:
                reload_seconds(engine.urls[0], str(ckpt), engine.syncer.headers)
            reload.append(probe.longest())
    finally:
        engine.close()
    _report(args, result, float(np.median(reload)))


def _report(args, result: dict, reload_s: float) -> None:
    model, per = result["model_bytes"], result["staged_bytes_per_process"]
    print(json.dumps(result | {"vllm_reload_pause_s": reload_s}, indent=1))
    print(
        f"{args.processes} processes x {args.devices_per_process} devices, {args.servers} server(s),"
        f" {args.dtype}: model {model / 1e9:.3f} GB; staged bytes per process {per}"
        f" ({', '.join(f'{b / model:.1%}' for b in per)}; sum {sum(per) / model:.1%})"
    )
    for v, rows in result["rounds"].items():
        med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "sent_bytes_per_process"}
        tcp = ""
        if rows[0].get("sent_bytes_per_process"):  # each process served its own buckets
            sent = np.median([r["sent_bytes_per_process"] for r in rows], axis=0)
            tcp = (
                f"; sent per push by each trainer process's own bucket server (GB)"
                f" {[round(float(b) / 1e9, 4) for b in sent]} = {[f'{b / sum(sent):.1%}' for b in sent]}"
            )
        print(
            f"{v:<5}: pause {med['probe_longest_s']:.2f} s ="
            f" {med['probe_longest_s'] / reload_s:.2f}x vLLM reload"
            f" ({reload_s:.2f} s); /pause->/resume {med['pause_s']:.2f} s; leader's shard staging"
            f" {med['shard_stage_s']:.2f} s; whole push {med['push_s']:.2f} s; canary max diff"
            f" {med['canary_max_abs_diff']:.2g}{tcp}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model_bytes": model, "staged_bytes_per_process": per, "rounds": result["rounds"]})
        )


def run_worker(args, variants_table) -> None:
    """One trainer process: load the checkpoint into fsdp over every device of the job, push rounds."""
    import jax

    pid, port = (int(x) for x in args.worker.split(","))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=args.processes, process_id=pid)
    import bench_weight_sync as B
    from jax.experimental import multihost_utils

    from rljax import models
    from rljax.config import CANARY_TOLERANCES, Config
    from rljax.loop.engine import Follower, JaxWeights, ShardedJaxWeights, make_canary_logprobs, push_params
    from rljax.loop.sharded_sync import share_question
    from rljax.rollout import RolloutEngine
    from rljax.rollout.auth import read_token_file
    from rljax.sharding import make_mesh
    from rljax.weight_sync import SyncOptions, served, transports
    from rljax.weight_sync.staging import DEFAULT_STAGING_DIR, ShardStager

    env = json.loads(os.environ[_ENV])
    mesh = make_mesh(1, -1, 1)
    config, params = models.load_hf_checkpoint(env["ckpt"], mesh=mesh)
    canary = make_canary_logprobs(Config(), config, mesh, data_parallel=jax.device_count())
    spec = models.hf_tensor_specs(config, args.dtype)
    stager = ShardStager(DEFAULT_STAGING_DIR, bucket_bytes=args.bucket_mb << 20, checksums=False, spec=spec)
    base = SyncOptions(bucket_bytes=args.bucket_mb << 20, canary_tolerance=CANARY_TOLERANCES[args.dtype])
    made = []  # this process's bucket servers, one per streamed push

    def serve(buckets, transport):
        made.append(served.serve_buckets(buckets, transport, "127.0.0.1", base.tcp_timeout_s))
        return made[-1]

    engine = None
    if pid == 0:
        token = read_token_file(env["token_file"]) or None
        engine = RolloutEngine.connect(env["urls"], env["ckpt"], sync_options=base, token=token)
    loop = engine if engine is not None else Follower()
    question = share_question(engine.canary if engine is not None else None)
    weights = ShardedJaxWeights(JaxWeights(config, canary, question, args.dtype), stager)
    push_params(loop, weights, params, 1)  # warm-up (compiles the canary)
    per = multihost_utils.process_allgather(np.asarray([stager.staged_bytes], np.int64))
    rounds: dict[str, list[dict]] = {v: [] for v in args.variants.split(",") if v}
    version = 1
    for _ in range(args.repeats):
        for v in rounds:
            version += 1
            options = dataclasses.replace(base, **variants_table[v])
            streamed = transports.streams(options.transport)  # every process serves its own buckets
            pushing = dataclasses.replace(
                weights, serve=functools.partial(serve, transport=options.transport)
            )
            pushing = pushing if streamed else weights
            if engine is not None:
                engine.syncer.options = options
            multihost_utils.sync_global_devices(f"round {version}")
            probe = B.Probe(env["urls"][0], engine.client.model, engine.syncer.headers) if engine else None
            if probe:
                probe.__enter__()
            t = time.perf_counter()
            m = push_params(loop, pushing, params, version)
            push_s = time.perf_counter() - t
            sent = np.asarray([made[-1].bytes_sent() if streamed and made else 0], np.int64)
            sent = [int(x) for x in np.asarray(multihost_utils.process_allgather(sent)).reshape(-1)]
            if probe:
                probe.__exit__(None, None, None)
                rounds[v].append(
                    {
                        "probe_longest_s": probe.longest(),
                        "pause_s": m["weight_sync/pause_seconds"],
                        "shard_stage_s": m["weight_sync/shard_stage_seconds"],
                        "push_s": push_s,
                        "canary_max_abs_diff": m["weight_sync/canary_logprob_max_abs_diff"],
                        "sent_bytes_per_process": sent if streamed else [],
                    }
                )
    if pid == 0:
        model_bytes = sum(int(np.prod(s)) * np.dtype(jax.numpy.dtype(d)).itemsize for s, d in spec.values())
        staged = [int(x) for x in np.asarray(per).reshape(-1)]
        Path(env["out"]).write_text(
            json.dumps({"model_bytes": model_bytes, "staged_bytes_per_process": staged, "rounds": rounds})
        )
    loop.close()
    weights.close()
    multihost_utils.sync_global_devices("bench done")
