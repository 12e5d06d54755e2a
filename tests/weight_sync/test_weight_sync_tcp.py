"""The "tcp" weight-sync transport: bucket bytes streamed from the trainer to vLLM's worker over a socket.

The framing and its faults without a server, then a real vLLM server (the shared untied Llama one: the
transport is chosen per update, so the session server takes both): log-prob parity and the version tag
after pushes, and a trainer stream that dies or stalls mid-bucket -> a clear error within the timeout,
after which a full push serves the trainer's weights again.
"""

import re
import socket
import threading
import time

import numpy as np
import pytest
from vllm_server import TOL, assert_serves_reference, perturbed

from rljax.rollout import RolloutError
from rljax.weight_sync import SyncOptions, WeightSyncError, stage_buckets, stream, wire


def _last_worker_timing(log_path) -> dict[str, float]:
    line = [ln for ln in open(log_path, errors="replace") if "rljax-shm update:" in ln][-1]
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line.split("rljax-shm update:")[1])}


def _bucket(tmp_path, seed=0):
    rng = np.random.default_rng(seed)
    tensors = {"a": rng.standard_normal((300, 40)).astype(np.float32), "b": np.arange(7, dtype=np.float32)}
    (bucket,) = stage_buckets(iter(tensors.items()), bucket_bytes=1 << 20, directory=tmp_path)
    return bucket, open(bucket.path, "rb").read()


def _alloc(calls=None):
    def allocate(n):
        if calls is not None:
            calls.append(n)
        return np.empty(n, np.uint8)

    return allocate


def _stranger(server, payload: bytes) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=5)
    if payload:
        s.sendall(payload)
    return s


def _dropped(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _wait_until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_stream_round_trip_and_refusals(tmp_path):
    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5) as server:
        server.add(bucket.index, bucket.path)
        client = stream.BucketClient(server.address(5.0))
        buf, n = client.fetch(bucket.index, len(data), _alloc())
        assert n == len(data) and buf.tobytes() == data
        buf, n = client.fetch(bucket.index, len(data), _alloc())  # same connection, again
        assert buf.tobytes() == data
        assert server.wait_sent(2, timeout_s=5.0)
        with pytest.raises(stream.StreamError, match="unknown bucket 7"):
            client.fetch(7, len(data), _alloc())
        client.close()
        # A wrong pre-auth token: the server drops the connection before reading any request.
        bad = stream.BucketClient(server.address(5.0) | {"token": "0" * 64})
        with pytest.raises(OSError):
            bad.fetch(bucket.index, len(data), _alloc())
        bad.close()
        _wait_until(lambda: server.refused >= 1, "the bad token was not refused")


def test_stream_size_is_checked_before_allocation(tmp_path):
    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5) as server:
        server.add(bucket.index, bucket.path)
        client = stream.BucketClient(server.address(5.0))
        calls = []
        with pytest.raises(
            stream.StreamError, match=f"announced {len(data)} bytes .* needs {len(data) - 64}"
        ):
            client.fetch(bucket.index, len(data) - 64, _alloc(calls))
        assert calls == []  # nothing was allocated for the mismatching bucket
        client.close()
    # The worker derives the expected size from the tensor list, which must be staging's own layout.
    good = bucket.entries
    assert wire.bucket_extent(good) == len(data)
    e = good[1]
    for bad, pattern in [
        (wire.TensorEntry(e.name, e.dtype, e.shape, e.offset + 64, e.nbytes), "bad byte range"),
        (wire.TensorEntry(e.name, e.dtype, (10**12,), e.offset, e.nbytes), "bad byte range"),
        (wire.TensorEntry(e.name, "int64", e.shape, e.offset, e.nbytes), "unsupported wire dtype"),
        (wire.TensorEntry(e.name, e.dtype, (-1, -28), e.offset, e.nbytes), "negative dimension"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            wire.bucket_extent([good[0], bad])


def test_strangers_cannot_disturb_a_transfer(tmp_path):
    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5) as server:
        server.add(bucket.index, bucket.path)
        result = {}
        waiter = threading.Thread(target=lambda: result.update(sent=server.wait_sent(1, 60.0)))
        waiter.start()
        threads_before = threading.active_count()
        # Strangers: a wrong token, a request frame without the pre-auth header, and a flood of idle
        # connections beyond the pending cap (none of them gets a thread or counts as a failure).
        wrong = _stranger(server, stream.PREAUTH_MAGIC + b"\0" * stream.TOKEN_BYTES)
        framed = _stranger(server, stream.MAGIC + (1 << 40).to_bytes(8, "big"))
        idle = [_stranger(server, b"") for _ in range(stream.MAX_PENDING + 8)]
        assert threading.active_count() <= threads_before + 1
        for s in (wrong, framed):
            assert _dropped(s)
        assert waiter.is_alive()  # the trainer's wait did not end early
        client = stream.BucketClient(server.address(5.0))  # the worker still gets through
        buf, _ = client.fetch(bucket.index, len(data), _alloc())
        assert buf.tobytes() == data
        waiter.join(30)
        assert result == {"sent": True}  # not ended early, and the transfer counted
        assert server.refused >= 2 + 8
        client.close()
        for s in [wrong, framed, *idle]:
            s.close()


def test_stream_caps_authenticated_connections(tmp_path):
    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5, max_connections=1) as server:
        server.add(bucket.index, bucket.path)
        first = stream.BucketClient(server.address(5.0))
        first.fetch(bucket.index, len(data), _alloc())  # holds the only slot while connected
        second = stream.BucketClient(server.address(5.0))
        with pytest.raises(OSError):
            second.fetch(bucket.index, len(data), _alloc())
        second.close()
        first.close()
        _wait_until(lambda: server._active == 0, "the first connection's slot was not freed")
        third = stream.BucketClient(server.address(5.0))
        assert third.fetch(bucket.index, len(data), _alloc())[0].tobytes() == data
        third.close()


def test_stream_dead_or_stalled_peer_gives_clear_errors(tmp_path, monkeypatch):
    import stream_faults

    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5) as server:
        server.add(bucket.index, bucket.path)
        stream_faults.install(monkeypatch, "close", 1000)
        client = stream.BucketClient(server.address(5.0))
        with pytest.raises(stream.StreamError, match=f"closed by the peer after 1000 of {len(data)} bytes"):
            client.fetch(bucket.index, len(data), _alloc())
        client.close()
        stream_faults.install(monkeypatch, "stall", 1000)
        client = stream.BucketClient(server.address(0.5))
        pattern = r"no data from the trainer for 0\.5 s while receiving bucket 0 "
        with pytest.raises(TimeoutError, match=pattern):
            client.fetch(bucket.index, len(data), _alloc())
        client.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(stream.StreamError, match=f"cannot connect to the trainer at 127.0.0.1:{port}"):
        stream.BucketClient({"host": "127.0.0.1", "port": port, "token": "ab" * 32, "timeout_s": 2.0})
    with pytest.raises(ValueError, match="bad tcp address"):
        stream.BucketClient({"host": "127.0.0.1", "port": port, "token": "x", "timeout_s": 2.0})


def test_sync_options_validate_transport():
    with pytest.raises(ValueError, match="transport must be one of shm, tcp, zmq, got 'udp'"):
        SyncOptions(transport="udp")
    with pytest.raises(ValueError, match="tcp_timeout_s must be > 0"):
        SyncOptions(transport="tcp", tcp_timeout_s=0)


@pytest.mark.vllm
def test_tcp_pushes_match_transformers(served_llama):
    base, start = served_llama.ref.state(), served_llama.engine.version
    # all buckets in one /update_weights call, prefetched by the workers before the pause; then with checksums
    for k, extra in enumerate([{}, {"checksums": True}], start=1):
        state = perturbed(base, seed=500 + start + k)
        metrics = served_llama.push(state, start + k, transport="tcp", bucket_bytes=100 * 1024, **extra)
        assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= TOL
        assert metrics["weight_sync/bytes"] == sum(v.nbytes for v in state.values())
        assert_serves_reference(served_llama, start + k)
        timing = _last_worker_timing(served_llama.server.log_path)
        assert timing["prefetch_s"] > 0 and timing["recv_s"] == 0  # every byte arrived before the pause


@pytest.mark.vllm
@pytest.mark.parametrize(
    "fault, pattern", [("close", "closed by the peer after 4096 of"), ("stall", "no data from the trainer")]
)
def test_tcp_trainer_stream_dies_mid_bucket_fails_fast_then_repush(served_llama, fault, pattern, monkeypatch):
    import stream_faults

    engine, version = served_llama.engine, served_llama.engine.version
    state = perturbed(served_llama.ref.state(), seed=600)
    t = time.monotonic()
    with monkeypatch.context() as patch:
        stream_faults.install(patch, fault, 4096)
        with pytest.raises(WeightSyncError, match=pattern) as err:
            served_llama.push(state, version + 1, transport="tcp", tcp_timeout_s=2.0)
    assert time.monotonic() - t < 30, "a dead stream must fail within the timeouts, not hang"
    assert "update_weights" in str(err.value) and "bucket 0" in str(err.value)
    assert engine.gate.broken  # mixed weights possible: generation refuses until a full push
    with pytest.raises(RolloutError, match="not servable"):
        engine.generate([[1, 2, 3]], n=1, temperature=0.0, max_tokens=2)
    served_llama.push(state, version + 1, transport="tcp")
    assert_serves_reference(served_llama, version + 1)


def test_a_burst_of_strangers_neither_blocks_nor_kills_the_listener(tmp_path):
    """Strangers connecting as fast as they can (each holding its connection with a partial header) while
    a worker fetches: every fetch gets through, and the listener still serves when the burst ends."""
    from flood import strangers

    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5) as server:
        server.add(bucket.index, bucket.path)
        with strangers(server.host, server.port, stream.PREAUTH_MAGIC[:2]):
            for _ in range(20):
                client = stream.BucketClient(server.address(5.0))
                assert client.fetch(bucket.index, len(data), _alloc())[0].tobytes() == data
                client.close()
        assert server._accept.is_alive()  # the selector thread survived the burst
        client = stream.BucketClient(server.address(5.0))
        assert client.fetch(bucket.index, len(data), _alloc())[0].tobytes() == data
        client.close()
        assert server.refused > stream.MAX_PENDING
