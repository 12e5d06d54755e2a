"""A trainer process serving its own buckets (`rljax.weight_sync.served`), over real sockets: it binds the
address of its own host among `tcp_host`'s list, every bucket carries that source, a worker pulls the
exact bytes from it, and `unlink()` stops the server and removes the files."""

import os

import numpy as np
import pytest

from rljax.weight_sync import served, transports
from rljax.weight_sync.staging import Bucket, StagedBuckets, stage_buckets


def _stage(tmp_path, first_index=0):
    rng = np.random.default_rng(0)
    items = [(f"t{i}", rng.standard_normal((64, 16)).astype(np.float32)) for i in range(5)]
    buckets = list(stage_buckets(items, bucket_bytes=8192, directory=tmp_path, first_index=first_index))
    assert len(buckets) > 1
    return buckets


def test_local_address_is_the_listed_address_of_this_host():
    assert transports.local_address("127.0.0.1") == "127.0.0.1"
    # 10.255.255.1 is not an address of this machine (binding it fails): the next one is taken
    assert transports.local_address("10.255.255.1, 127.0.0.1") == "127.0.0.1"
    with pytest.raises(ValueError, match="rollout.weight_sync.tcp_host=.*belongs to this host"):
        transports.local_address("10.255.255.1,10.255.255.2")


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_each_bucket_is_pulled_from_its_own_process_server(tmp_path, transport):
    buckets = _stage(tmp_path, first_index=7 << 20)
    pushed = served.serve_buckets(buckets, transport, "10.255.255.1,127.0.0.1", timeout_s=10)
    try:
        sources = {b.source["id"] for b in pushed.buckets}
        assert len(sources) == 1 and all(b.source["transport"] == transport for b in pushed.buckets)
        # what the leader receives through the key-value store: the descriptor carries the source
        remote = [Bucket.from_descriptor(b.descriptor()) for b in pushed.buckets]
        assert [b.source for b in remote] == [b.source for b in pushed.buckets] and not remote[0].owned
        client = transports.connect(remote[0].source)
        try:
            for b in remote:
                buf, n = client.fetch(b.index, b.nbytes, bytearray)
                with open(b.path, "rb") as f:
                    assert bytes(buf[:n]) == f.read()
        finally:
            client.close()
        assert pushed.wait_sent(1, timeout_s=10) and pushed.bytes_sent() == sum(b.nbytes for b in buckets)
        assert not pushed.wait_sent(2, timeout_s=0.2)  # a second rollout node has not pulled them
    finally:
        pushed.unlink()
    assert not any(os.path.exists(b.path) for b in buckets) and pushed.server is None
    assert StagedBuckets(remote, (1,)).wait_sent is None  # a re-push does not wait on other processes


def test_a_process_with_no_shards_serves_nothing():
    pushed = served.serve_buckets([], "tcp", "127.0.0.1", timeout_s=10)
    assert pushed.server is None and pushed.wait_sent(3, 0.1) and pushed.bytes_sent() == 0
    pushed.unlink()
