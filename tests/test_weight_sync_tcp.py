"""The "tcp" weight-sync transport: bucket bytes streamed from the trainer to vLLM's worker over a socket.

The framing and its faults without a server, then a real vLLM server (the shared untied Llama one: the
transport is chosen per update, so the session server takes both): log-prob parity and the version tag
after pushes, and a trainer stream that dies or stalls mid-bucket -> a clear error within the timeout,
after which a full push serves the trainer's weights again.
"""

import re
import socket
import time

import numpy as np
import pytest
from test_weight_sync import TOL, _assert_serves_reference
from vllm_server import perturbed

from rljax.rollout import RolloutError
from rljax.weight_sync import SyncOptions, WeightSyncError, stage_buckets, stream


def _last_worker_timing(log_path) -> dict[str, float]:
    line = [ln for ln in open(log_path, errors="replace") if "rljax-shm update:" in ln][-1]
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line.split("rljax-shm update:")[1])}


def _bucket(tmp_path, seed=0):
    rng = np.random.default_rng(seed)
    tensors = {"a": rng.standard_normal((300, 40)).astype(np.float32), "b": np.arange(7, dtype=np.float32)}
    (bucket,) = stage_buckets(iter(tensors.items()), bucket_bytes=1 << 20, directory=tmp_path)
    return bucket, open(bucket.path, "rb").read()


def test_stream_round_trip_and_refusals(tmp_path):
    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5) as server:
        server.add(bucket.index, bucket.path)
        client = stream.BucketClient(server.address(5.0))
        buf, n = client.fetch(bucket.index, lambda k: np.empty(k, np.uint8))
        assert n == len(data) and buf.tobytes() == data
        buf, n = client.fetch(bucket.index, lambda k: np.empty(k, np.uint8))  # same connection, again
        assert buf.tobytes() == data
        assert server.wait_sent(2, timeout_s=5.0)
        with pytest.raises(stream.StreamError, match="unknown bucket 7"):
            client.fetch(7, lambda k: np.empty(k, np.uint8))
        client.close()
        bad = stream.BucketClient(server.address(5.0) | {"token": "0" * 32})
        with pytest.raises(stream.StreamError, match="bad token"):
            bad.fetch(bucket.index, lambda k: np.empty(k, np.uint8))
        bad.close()


def test_stream_dead_or_stalled_peer_gives_clear_errors(tmp_path):
    bucket, data = _bucket(tmp_path)
    with stream.BucketServer(timeout_s=5) as server:
        server.add(bucket.index, bucket.path)
        server.fault = ("close", 1000)
        client = stream.BucketClient(server.address(5.0))
        with pytest.raises(stream.StreamError, match=f"closed by the peer after 1000 of {len(data)} bytes"):
            client.fetch(bucket.index, lambda k: np.empty(k, np.uint8))
        client.close()
        server.fault = ("stall", 1000)
        client = stream.BucketClient(server.address(0.5))
        pattern = r"no data from the trainer for 0\.5 s while receiving bucket 0 "
        with pytest.raises(TimeoutError, match=pattern):
            client.fetch(bucket.index, lambda k: np.empty(k, np.uint8))
        client.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(stream.StreamError, match=f"cannot connect to the trainer at 127.0.0.1:{port}"):
        stream.BucketClient({"host": "127.0.0.1", "port": port, "token": "x", "timeout_s": 2.0})


def test_sync_options_validate_transport():
    with pytest.raises(ValueError, match="transport must be one of shm, tcp, got 'udp'"):
        SyncOptions(transport="udp")
    with pytest.raises(ValueError, match="tcp_timeout_s must be > 0"):
        SyncOptions(transport="tcp", tcp_timeout_s=0)


@pytest.mark.vllm
def test_tcp_pushes_match_transformers(served_llama):
    base, start = served_llama.ref.state(), served_llama.engine.version
    # pre-staged (all buckets in one /update_weights call), then pipelined (one call per bucket)
    for k, extra in enumerate([{}, {"prestage": False, "checksums": True}], start=1):
        state = perturbed(base, seed=500 + start + k)
        metrics = served_llama.push(state, start + k, transport="tcp", bucket_bytes=100 * 1024, **extra)
        assert metrics["weight_sync/canary_logprob_max_abs_diff"] <= TOL
        assert metrics["weight_sync/bytes"] == sum(v.nbytes for v in state.values())
        _assert_serves_reference(served_llama, start + k)
        timing = _last_worker_timing(served_llama.server.log_path)
        if extra:  # pipelined: received while paused
            assert timing["recv_s"] > 0 and timing["prefetch_s"] == 0
        else:  # pre-staged: every byte arrived before the pause
            assert timing["prefetch_s"] > 0 and timing["recv_s"] == 0


@pytest.mark.vllm
@pytest.mark.parametrize(
    "fault, pattern", [("close", "closed by the peer after 4096 of"), ("stall", "no data from the trainer")]
)
def test_tcp_trainer_stream_dies_mid_bucket_fails_fast_then_repush(served_llama, fault, pattern):
    engine, version = served_llama.engine, served_llama.engine.version
    state = perturbed(served_llama.ref.state(), seed=600)
    engine.syncer.tcp_fault = (fault, 4096)
    t = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=pattern) as err:
            served_llama.push(state, version + 1, transport="tcp", tcp_timeout_s=2.0)
    finally:
        engine.syncer.tcp_fault = None
    assert time.monotonic() - t < 30, "a dead stream must fail within the timeouts, not hang"
    assert "update_weights" in str(err.value) and "bucket 0" in str(err.value)
    assert engine.gate.broken  # mixed weights possible: generation refuses until a full push
    with pytest.raises(RolloutError, match="not servable"):
        engine.generate([[1, 2, 3]], n=1, temperature=0.0, max_tokens=2)
    served_llama.push(state, version + 1, transport="tcp")
    _assert_serves_reference(served_llama, version + 1)
