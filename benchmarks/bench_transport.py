"""Cross-host transport benchmark: rljax's own framing ("tcp") against ZeroMQ with CURVE ("zmq").

    .venv/bin/python benchmarks/bench_transport.py --total-mb 1024 --bucket-mb 64,1 --repeats 5

On loopback, in one process (the trainer's bucket server in its threads, one worker pulling with the
transport's client), for each bucket size: `total-mb` of random bytes staged as bucket files in /dev/shm,
then `--repeats` interleaved rounds (tcp, zmq, tcp, zmq, ...) of one client pulling every bucket into a
preallocated buffer (so page faults of fresh memory do not count; the worker's real target, a file in
/dev/shm, adds the same to both). Prints each transport's median GB/s and zmq / tcp: the baseline is
measured in the same run, under the same load.

`--fanout`: the bytes each trainer host sends per sync with one receiver per node (`fanout`), measured:
`--sources` bucket servers (trainer hosts, each serving its share of the buckets) and `--nodes` staging
roots with `--workers` threads each (the TP workers of a node), every worker pulling every bucket;
prints each server's `bytes_sent` against (model bytes / sources) x nodes, and what it would be if every
worker pulled every byte.
`--json FILE` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from rljax.weight_sync import stage_buckets, transports
from rljax.weight_sync.worker import fanout

TRANSPORTS = ("tcp", "zmq")


def stage(directory: str, total_bytes: int, bucket_bytes: int) -> list:
    """Random float32 tensors of one bucket each, staged as bucket files."""
    rng = np.random.default_rng(0)
    n = max(1, total_bytes // bucket_bytes)
    tensors = ((f"t{i}", rng.random(bucket_bytes // 4, dtype=np.float32)) for i in range(n))
    return list(stage_buckets(tensors, bucket_bytes=bucket_bytes, directory=directory))


def pull_seconds(name: str, buckets: list, out: np.ndarray) -> float:
    """Seconds for one client to pull every bucket from a fresh server of transport `name` (connect
    and, for zmq, the CURVE handshake included)."""
    server = transports.serve(name, "127.0.0.1", 30.0)
    try:
        for b in buckets:
            server.add(b.index, b.path)
        t0 = time.perf_counter()
        client = transports.connect(server.address(30.0))
        try:
            for b in buckets:
                client.fetch(b.index, b.nbytes, lambda n: out[:n])
        finally:
            client.close()
        return time.perf_counter() - t0
    finally:
        server.close()


def throughput(buckets: list, repeats: int) -> dict:
    total = sum(b.nbytes for b in buckets)
    out = np.empty(max(b.nbytes for b in buckets), np.uint8)
    out.fill(0)  # fault the buffer in once
    seconds: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    for name in TRANSPORTS:  # warm-up round, not counted
        pull_seconds(name, buckets[:1], out)
    for _ in range(repeats):
        for name in TRANSPORTS:
            seconds[name].append(pull_seconds(name, buckets, out))
    row = {"bucket_bytes": buckets[0].nbytes, "buckets": len(buckets), "total_bytes": total}
    for name in TRANSPORTS:
        med = statistics.median(seconds[name])
        row[name] = {"seconds": seconds[name], "median_s": med, "gb_per_s": total / 1e9 / med}
    row["zmq_over_tcp"] = row["zmq"]["gb_per_s"] / row["tcp"]["gb_per_s"]
    return row


def fanout_bytes(name: str, buckets: list, sources: int, nodes: int, workers: int) -> dict:
    """Each of `nodes` x `workers` threads pulls every bucket; buckets dealt round-robin to `sources`
    servers. Returns every server's bytes sent and the bound."""
    servers = [transports.serve(name, "127.0.0.1", 30.0) for _ in range(sources)]
    roots = [tempfile.mkdtemp(prefix="rljax-bench-node-", dir="/dev/shm") for _ in range(nodes)]
    try:
        items = []
        for b in buckets:
            server = servers[b.index % sources]
            server.add(b.index, b.path)
            items.append((server.address(30.0), b.index, b.nbytes))
        dirs = [fanout.NodeDirs(root) for root in roots for _ in range(workers)]
        errors: list = []

        def work(d):
            got = fanout.fetch_buckets(items, d, transports.connect)
            errors.extend(v[1] for v in got.values() if v[0] is None)

        threads = [threading.Thread(target=work, args=(d,)) for d in dirs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise errors[0]
        for d in dirs:
            d.release()
        model = sum(b.nbytes for b in buckets)
        share = [sum(b.nbytes for b in buckets if b.index % sources == k) for k in range(sources)]
        return {
            "transport": name,
            "sources": sources,
            "nodes": nodes,
            "workers_per_node": workers,
            "model_bytes": model,
            "bytes_sent_per_source": [s.bytes_sent for s in servers],
            "bound_per_source": [s * nodes for s in share],  # (model bytes / sources) x nodes
            "without_fanout_per_source": [s * nodes * workers for s in share],
            "seconds": seconds,
        }
    finally:
        for s in servers:
            s.close()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--bucket-mb", default="64,1", help="comma-separated bucket sizes (MiB)")
    ap.add_argument("--small-total-mb", type=int, default=128, help="total for buckets under 16 MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fanout", action="store_true")
    ap.add_argument("--sources", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    results: dict = {"throughput": [], "fanout": []}
    with tempfile.TemporaryDirectory(prefix="rljax-bench-transport-", dir="/dev/shm") as d:
        for mb in (int(x) for x in args.bucket_mb.split(",")):
            total = (args.total_mb if mb >= 16 else args.small_total_mb) << 20
            buckets = stage(d, total, mb << 20)
            row = throughput(buckets, args.repeats)
            results["throughput"].append(row)
            print(
                f"bucket {mb} MiB x {row['buckets']}: tcp {row['tcp']['gb_per_s']:.2f} GB/s, "
                f"zmq {row['zmq']['gb_per_s']:.2f} GB/s (median of {args.repeats}), "
                f"zmq/tcp {row['zmq_over_tcp']:.2f}",
                flush=True,
            )
            for b in buckets:
                b.unlink()
        if args.fanout:
            buckets = stage(d, 256 << 20, 16 << 20)
            for name in TRANSPORTS:
                row = fanout_bytes(name, buckets, args.sources, args.nodes, args.workers)
                results["fanout"].append(row)
                print(
                    f"fan-out {name}: {args.sources} sources, {args.nodes} nodes x {args.workers} workers, "
                    f"model {row['model_bytes']} B: sent per source {row['bytes_sent_per_source']}, "
                    f"bound {row['bound_per_source']}, without fan-out {row['without_fanout_per_source']}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
