"""One trainer process's own bucket server (sharded staging over tcp/zmq): nothing reaches a leader's host.

In a multi-process job every process stages only the shards it owns (`loop.sharded_sync.stage_sharded`).
With a streaming transport each process also serves those buckets itself: `serve_buckets` starts a
fresh bucket server for the push (its own token and receive-directory id) on this host's address among
`rollout.weight_sync.tcp_host` (`transports.local_address`), and stamps its `source` on each bucket, so
the leader's one update lists every process's buckets with the address each worker pulls it from
(`fanout`: one receiver per rollout node, one thread per source). The bytes go from the host that holds
them straight to each rollout node, once per node: a trainer host sends (its share of the model) x
(rollout nodes) per sync, and no host gathers the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljax.weight_sync import transports
from rljax.weight_sync.staging import Bucket


@dataclasses.dataclass
class ServedBuckets:
    """A push's buckets on this process, each with its `source`, and the server that sends them (None when
    this process staged none). `unlink()` stops the server and removes the files (as `Bucket.unlink`)."""

    buckets: list[Bucket]
    server: Any = None
    sent: int = 0  # bytes its server sent, as of `unlink()`

    def wait_sent(self, copies: int, timeout_s: float) -> bool:
        """Blocks until each bucket was sent `copies` times (once per rollout host), a transfer failed, or
        `timeout_s` passed; True only in the first case."""
        if self.server is None:
            return True
        return self.server.wait_sent(len(self.buckets) * copies, timeout_s)

    def bytes_sent(self) -> int:
        """Payload bytes this process's server sent for the push (all rollout nodes together)."""
        return self.sent if self.server is None else int(self.server.bytes_sent)

    def unlink(self) -> None:
        if self.server is not None:
            self.sent = self.bytes_sent()
            self.server.close()
            self.server = None
        for b in self.buckets:
            b.unlink()


def serve_buckets(buckets: list[Bucket], transport: str, hosts: str, timeout_s: float) -> ServedBuckets:
    """`buckets` (this process's, staged) served by a new bucket server of `transport` bound to this host's
    address among the comma-separated `hosts`; the returned buckets carry its `source`."""
    if not buckets:
        return ServedBuckets([])
    server = transports.serve(transport, hosts, timeout_s)
    if server is None:
        raise ValueError(f"weight sync: transport {transport!r} streams nothing; it cannot serve buckets")
    source = server.address(timeout_s)
    for b in buckets:
        server.add(b.index, b.path)
    return ServedBuckets([dataclasses.replace(b, source=source) for b in buckets], server)
