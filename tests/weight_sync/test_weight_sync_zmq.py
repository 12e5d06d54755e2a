"""The "zmq" weight-sync transport (pyzmq, CURVE) and the transport registry.

Without a server: bytes round-trip exactly (multi-chunk, small, empty buckets), a worker with the wrong
keys is refused at the CURVE handshake (ZAP) with a clear error, a trainer process that is killed
mid-bucket gives a clear error within the timeout, and a peer that asks for more than its window is
bounded by the HWM. Then a real vLLM server synced over zmq, canary passing.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import zmq
from vllm_server import TOL, assert_serves_reference, perturbed

from rljax import config as config_lib
from rljax.weight_sync import SyncOptions, stage_buckets, transports, zmq_stream
from rljax.weight_sync.stream import StreamError


def _buckets(tmp_path, sizes=(9 * 2**20 + 12, 1000, 0), seed=0):
    rng = np.random.default_rng(seed)
    tensors = [(f"t{i}", rng.random(n // 4, dtype=np.float32)) for i, n in enumerate(sizes)]
    out = []
    for name, array in tensors:  # one bucket each
        (b,) = stage_buckets(iter([(name, array)]), bucket_bytes=1 << 30, directory=tmp_path, prefix=name)
        out.append((b, open(b.path, "rb").read()))
    return out


def _alloc(n):
    return np.empty(n, np.uint8)


def test_registry_names_match_the_config_choices():
    fields = {f.name: f for f in config_lib.WeightSyncConfig.__dataclass_fields__.values()}
    assert fields["transport"].metadata["choices"] == transports.NAMES == ("shm", "tcp", "zmq")
    assert transports.serve("shm", "127.0.0.1", 1.0) is None
    with pytest.raises(ValueError, match="transport must be one of shm, tcp, zmq, got 'udp'"):
        transports.get("udp")
    with pytest.raises(ValueError, match="transport 'shm' streams nothing"):
        transports.connect({"transport": "shm"})
    SyncOptions(transport="zmq")  # accepted


def test_zmq_round_trip_is_byte_exact(tmp_path):
    staged = _buckets(tmp_path)
    with transports.serve("zmq", "127.0.0.1", 5.0) as server:
        for k, (b, _) in enumerate(staged):
            server.add(k, b.path)
        client = transports.connect(server.address(5.0))
        for k, (_, data) in enumerate(staged):
            buf, n = client.fetch(k, len(data), _alloc)
            assert n == len(data) and bytes(memoryview(buf)[:n]) == data
        assert server.bytes_sent == sum(len(d) for _, d in staged)
        assert server.chunks_sent == 3 + 1 + 1  # 9 MiB in 4 MiB chunks, then one each
        assert server.wait_sent(3, timeout_s=1.0) and server.refused == 0
        with pytest.raises(StreamError, match="unknown bucket 7"):
            client.fetch(7, 100, _alloc)
        client.close()
        calls = []
        bad = transports.connect(server.address(5.0))
        with pytest.raises(StreamError, match=r"announced 1000 bytes .* expected 936"):
            bad.fetch(1, 936, lambda n: calls.append(n))
        assert calls == []  # nothing allocated for a size that does not match the tensor list
        bad.close()


def test_zmq_wrong_keys_are_refused(tmp_path):
    (b, data), *_ = _buckets(tmp_path, sizes=(4096,))
    with zmq_stream.ZmqBucketServer(timeout_s=5.0) as server:
        server.add(b.index, b.path)
        pub, sec = zmq.curve_keypair()
        stranger = server.address(5.0) | {"public_key": pub.decode(), "secret_key": sec.decode()}
        client = transports.connect(stranger)
        with pytest.raises(StreamError, match="refused this worker's CURVE handshake"):
            client.fetch(b.index, len(data), _alloc)
        client.close()
        assert server.refused == 1 and server.bytes_sent == 0
        # A worker that does not know the server's key cannot complete the handshake either.
        wrong_server = server.address(0.5) | {"server_key": zmq.curve_keypair()[0].decode()}
        client = transports.connect(wrong_server)
        with pytest.raises((StreamError, TimeoutError)):
            client.fetch(b.index, len(data), _alloc)
        client.close()
        assert server.bytes_sent == 0
        with pytest.raises(ValueError, match="bad zmq address"):
            transports.connect(server.address(5.0) | {"secret_key": "short"})
        good = transports.connect(server.address(5.0))  # the issued keys still work
        assert bytes(good.fetch(b.index, len(data), _alloc)[0]) == data
        good.close()


_TRAINER = textwrap.dedent(
    """
    import json, sys, time
    from rljax.weight_sync import zmq_stream
    server = zmq_stream.ZmqBucketServer(timeout_s=60.0)
    server.add(0, sys.argv[1])
    print(json.dumps(server.address(float(sys.argv[2]))), flush=True)
    time.sleep(600)
    """
)


def test_zmq_trainer_killed_mid_bucket_fails_within_the_timeout(tmp_path):
    # Larger than the bytes a worker keeps asked for (WINDOW chunks): killed at the first chunk, the
    # trainer has sent at most that many, so the fetch is always cut short.
    size = 2 * zmq_stream.WINDOW * zmq_stream.CHUNK_BYTES + (3 << 20)
    (b, data), *_ = _buckets(tmp_path, sizes=(size,))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, b.path, "1.0"], stdout=subprocess.PIPE, env=env)
    try:
        address = json.loads(proc.stdout.readline())
        client = transports.connect(address)
        t = time.monotonic()
        got = []

        def allocate(n):
            got.append(n)
            os.kill(proc.pid, signal.SIGKILL)  # the first chunk arrived: the trainer dies
            return _alloc(n)

        with pytest.raises(TimeoutError, match=r"no data from the trainer for 1\.0 s") as e:
            client.fetch(b.index, len(data), allocate)
        received = int(re.search(rf"\((\d+) of {size}", str(e.value)).group(1))
        assert got == [len(data)] and 0 < received <= zmq_stream.WINDOW * zmq_stream.CHUNK_BYTES
        assert time.monotonic() - t < 30, "a dead trainer must fail within the timeout, not hang"
        client.close()
    finally:
        proc.kill()
        proc.wait()


def test_zmq_queues_are_bounded_by_the_hwm(tmp_path):
    (b, data), *_ = _buckets(tmp_path, sizes=(64 * 2**20,))
    with zmq_stream.ZmqBucketServer(timeout_s=5.0) as server:
        server.add(b.index, b.path)
        address = server.address(5.0)
        # A peer with the issued keys that asks for every chunk at once (beyond its window) and reads none.
        ctx = zmq.Context()
        greedy = ctx.socket(zmq.DEALER)
        greedy.curve_serverkey = address["server_key"].encode()
        greedy.curve_publickey = address["public_key"].encode()
        greedy.curve_secretkey = address["secret_key"].encode()
        greedy.rcvhwm = 1
        greedy.connect(address["endpoint"])
        asks = 4 * len(data) // zmq_stream.CHUNK_BYTES
        for k in range(asks):
            offset = k % (len(data) // zmq_stream.CHUNK_BYTES) * zmq_stream.CHUNK_BYTES
            greedy.send(
                json.dumps({"bucket": b.index, "offset": offset, "size": zmq_stream.CHUNK_BYTES}).encode()
            )
        deadline = time.monotonic() + 30
        while server.dropped + server.chunks_sent < asks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.dropped > 0  # replies beyond the peer's queue were dropped, not buffered
        assert server.dropped + server.chunks_sent == asks
        assert server.chunks_sent < asks
        # a worker that keeps to its window still gets the bucket
        client = transports.connect(address)
        assert bytes(client.fetch(b.index, len(data), _alloc)[0]) == data
        client.close()
        greedy.close(linger=0)
        ctx.term()


@pytest.mark.vllm
def test_zmq_pushes_match_transformers(served_llama):
    base, start = served_llama.ref.state(), served_llama.engine.version
    # prefetched by the workers before the pause; then with checksums
    for k, extra in enumerate([{}, {"checksums": True}], start=1):
        state = perturbed(base, seed=700 + start + k)
        metrics = served_llama.push(state, start + k, transport="zmq", bucket_bytes=100 * 1024, **extra)
        assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= TOL
        assert metrics["weight_sync/bytes"] == sum(v.nbytes for v in state.values())
        assert_serves_reference(served_llama, start + k)
    root = os.environ.get("RLJAX_STAGING_DIR", "/dev/shm")
    assert not [n for n in os.listdir(root) if n.startswith("rljax-rx-")], "received files were not removed"


def test_a_burst_of_strangers_does_not_block_the_zmq_server(tmp_path):
    """Raw connections opened as fast as three threads can (each holding a few bytes of a greeting) while a
    worker fetches: every fetch gets through, and the server still serves when the burst ends."""
    from flood import strangers

    (b, data), *_ = _buckets(tmp_path, sizes=(4096,))
    with zmq_stream.ZmqBucketServer(timeout_s=5.0) as server:
        server.add(b.index, b.path)
        host, _, port = server.address(5.0)["endpoint"].removeprefix("tcp://").rpartition(":")
        with strangers(host, int(port), b"\xff\0\0"):
            for _ in range(20):
                client = transports.connect(server.address(5.0))
                assert bytes(client.fetch(b.index, len(data), _alloc)[0]) == data
                client.close()
        client = transports.connect(server.address(5.0))
        assert bytes(client.fetch(b.index, len(data), _alloc)[0]) == data
        client.close()
