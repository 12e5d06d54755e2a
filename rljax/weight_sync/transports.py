"""The weight-sync transports by name (`rollout.weight_sync.transport`), resolved once per sync.

Each entry gives the trainer side (`serve(host, timeout_s)`: a bucket server whose `address(timeout_s)`
is the `source` dict each streamed bucket's `update_info` carries; None: the workers map the trainer's
bucket files, same host) and the worker side (`connect(source)`: a client with
`fetch(index, expected, allocate)` and `close()`). A source names its transport (`source["transport"]`),
so a worker pulls each bucket from the address in its own descriptor, whichever trainer process staged it.

- `shm`: no stream; the worker maps `<staging root>/rljax-ws-*/<bucket>` (`staging.open_bucket`).
- `tcp`: rljax's own framing with a token pre-auth (`stream`).
- `zmq`: ZeroMQ ROUTER/DEALER with CURVE keys per sync, HWM bounds and chunked zero-copy sends
  (`zmq_stream`; pyzmq is imported only when this transport is used).

Streamed buckets land once per node (`fanout`). `benchmarks/bench_transport.py` compares tcp and zmq.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Transport:
    serve: Callable | None  # (host, timeout_s) -> bucket server; None: files mapped on the trainer's host
    connect: Callable | None  # (source dict) -> bucket client
    summary: str


def _tcp_server(host: str, timeout_s: float):
    from rljax.weight_sync import stream

    return stream.BucketServer(host, timeout_s=timeout_s)


def _tcp_client(source: dict):
    from rljax.weight_sync import stream

    return stream.BucketClient(source)


def _zmq_server(host: str, timeout_s: float):
    from rljax.weight_sync import zmq_stream

    return zmq_stream.ZmqBucketServer(host, timeout_s=timeout_s)


def _zmq_client(source: dict):
    from rljax.weight_sync import zmq_stream

    return zmq_stream.ZmqBucketClient(source)


TRANSPORTS: dict[str, Transport] = {
    "shm": Transport(None, None, "bucket files in /dev/shm, mapped by servers on the trainer's host"),
    "tcp": Transport(_tcp_server, _tcp_client, "rljax's own framing over TCP, token pre-auth"),
    "zmq": Transport(_zmq_server, _zmq_client, "ZeroMQ with CURVE keys per sync, HWM-bounded, chunked"),
}
NAMES = tuple(TRANSPORTS)


def get(name: str) -> Transport:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"weight sync: transport must be one of {', '.join(NAMES)}, got {name!r}") from None


def streams(name: str) -> bool:
    """True when transport `name` streams buckets from a bucket server (False: mapped files)."""
    return get(name).serve is not None


def serve(name: str, host: str, timeout_s: float):
    """The trainer's bucket server for transport `name` (None for `shm`), bound to this host's address
    among `host` (`local_address`)."""
    transport = get(name)
    return None if transport.serve is None else transport.serve(local_address(host), timeout_s)


def local_address(hosts: str) -> str:
    """The first of the comma-separated `hosts` that this host can bind: `rollout.weight_sync.tcp_host`
    lists one address per trainer host (e.g. every trainer node's private address), and each trainer
    process serves its own buckets on its own. ValueError naming them when none is local."""
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    for name in names:
        try:
            with socket.create_server((name, 0)):
                return name
        except OSError:
            continue
    raise ValueError(
        f"weight sync: no address in rollout.weight_sync.tcp_host={hosts!r} belongs to this host "
        f"({socket.gethostname()}); list one address per trainer host"
    )


def connect(source: dict):
    """A client for the bucket source `source` (an `address()` of some trainer's bucket server)."""
    if not isinstance(source, dict):
        raise ValueError("weight sync: a bucket source must be an object")
    transport = get(str(source.get("transport")))
    if transport.connect is None:
        raise ValueError(f"weight sync: transport {source.get('transport')!r} streams nothing")
    return transport.connect(source)


def source_of(source: dict | None, tcp: dict | None = None) -> dict | None:
    """A bucket's source from its `update_info` fields (None: a file to map). `tcp` is the older form of a
    tcp source (`{"host", "port", "token", "timeout_s"}`), given an id from its token."""
    if source is not None or tcp is None:
        return source
    token = str(tcp.get("token", "")).encode()
    return {"transport": "tcp", "id": hashlib.sha256(token).hexdigest()[:16]} | tcp
