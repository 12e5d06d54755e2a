"""One receiver per node for streamed buckets (`weight_sync.worker.fanout`), over real tcp and zmq servers.

Workers are threads here, each with its own `NodeDirs` (its own descriptors: flock locks belong to open
file descriptions, so they exclude each other exactly as across the processes of a node). The trainer's
servers count the bytes they send.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from rljax.weight_sync import stage_buckets, transports
from rljax.weight_sync.worker import fanout


def _staged(tmp_path, count=5, floats=300_001, seed=0):
    rng = np.random.default_rng(seed)
    tensors = ((f"t{i}", rng.random(floats, dtype=np.float32)) for i in range(count))
    buckets = list(stage_buckets(tensors, bucket_bytes=floats * 4, directory=tmp_path))
    return buckets, {b.index: open(b.path, "rb").read() for b in buckets}


def _pull_all(items, workers):
    """Every `NodeDirs` in `workers` pulls every item at once; their results."""
    out = [None] * len(workers)

    def run(k):
        out[k] = fanout.fetch_buckets(items, workers[k], transports.connect)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("name", ["tcp", "zmq"])
def test_two_workers_on_a_node_pull_each_bucket_once(tmp_path, name):
    root = tmp_path / "node"
    buckets, data = _staged(tmp_path)
    with transports.serve(name, "127.0.0.1", 10.0) as server:
        for b in buckets:
            server.add(b.index, b.path)
        source = server.address(10.0)
        items = [(source, b.index, b.nbytes) for b in buckets]
        workers = [fanout.NodeDirs(str(root)) for _ in range(2)]
        results = _pull_all(items, workers)
        assert server.bytes_sent == sum(b.nbytes for b in buckets)  # each bucket crossed the wire once
        assert sum(w.downloaded() for w in workers) == len(buckets)
        for got in results:
            for b in buckets:
                buf, n = got[(source["id"], b.index)]
                assert n == b.nbytes and bytes(buf[:n]) == data[b.index]
                buf.close()
        assert sorted(os.listdir(root)) == [fanout.RX_PREFIX + source["id"]]
        for w in workers:
            w.release()
        assert os.listdir(root) == []  # the last worker removed the node's copy


@pytest.mark.parametrize("name", ["tcp", "zmq"])
def test_sources_pulled_in_parallel_bytes_per_trainer_host_bounded(tmp_path, name):
    """2 trainer hosts (each serving its own buckets), 2 nodes x 2 workers: each host sends
    (model bytes / hosts) x nodes, not x workers."""
    buckets, data = _staged(tmp_path, count=6)
    servers = [transports.serve(name, "127.0.0.1", 10.0) for _ in range(2)]
    try:
        items = []
        for b in buckets:
            server = servers[b.index % 2]
            server.add(b.index, b.path)
            items.append((server.address(10.0), b.index, b.nbytes))
        workers = [fanout.NodeDirs(str(tmp_path / f"node{n}")) for n in range(2) for _ in range(2)]
        results = _pull_all(items, workers)
        for k, server in enumerate(servers):
            share = sum(b.nbytes for b in buckets if b.index % 2 == k)
            assert server.bytes_sent == share * 2  # once per node
        for got in results:
            for source, index, _ in items:
                buf, n = got[(source["id"], index)]
                assert bytes(buf[:n]) == data[index]
                buf.close()
        for w in workers:
            w.release()
    finally:
        for s in servers:
            s.close()


def test_a_failing_receiver_hands_the_bucket_to_a_waiter(tmp_path):
    a, b = fanout.NodeDirs(str(tmp_path)), fanout.NodeDirs(str(tmp_path))
    claimed, fail = threading.Event(), threading.Event()
    payload = bytes(range(256)) * 40

    def broken(allocate):
        claimed.set()
        fail.wait(30)
        raise ConnectionError("the trainer went away")

    def good(allocate):
        buf = allocate(len(payload))
        buf[:] = payload
        return buf, len(payload)

    errors = []
    ta = threading.Thread(target=lambda: _catch(errors, a.get("ab" * 8).get, 0, len(payload), broken))
    ta.start()
    assert claimed.wait(30)
    got = []
    tb = threading.Thread(target=lambda: got.append(b.get("ab" * 8).get(0, len(payload), good)))
    tb.start()
    fail.set()
    ta.join(30)
    tb.join(30)
    assert [str(e) for e in errors] == ["the trainer went away"]
    (buf, n), *_ = got
    assert bytes(buf[:n]) == payload and b.downloaded() == 1 and a.downloaded() == 0


_CLAIMER = textwrap.dedent(
    """
    import sys, time
    from rljax.weight_sync.worker import fanout
    d = fanout.NodeDirs(sys.argv[1]).get("cd" * 8)
    fanout._claim(d.path, d.path + "/0.part")
    print("claimed", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_receiver_does_not_block_the_node(tmp_path):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _CLAIMER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"claimed"
        waiter = fanout.NodeDirs(str(tmp_path))
        got = []
        t = threading.Thread(
            target=lambda: got.append(waiter.get("cd" * 8).get(0, 4, lambda alloc: _fill(alloc(4))))
        )
        t.start()
        t.join(0.5)
        assert t.is_alive()  # waits while the receiver lives
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t.join(30)
        (buf, n), *_ = got
        assert bytes(buf[:n]) == b"\1\2\3\4"
        waiter.release()
        assert os.listdir(tmp_path) == []
    finally:
        proc.kill()
        proc.wait()


def test_source_ids_are_checked_and_stale_dirs_swept(tmp_path):
    with pytest.raises(ValueError, match="bad source id"):
        fanout.NodeDirs(str(tmp_path)).get("../../etc")
    left = fanout.NodeDirs(str(tmp_path))
    left.get("ef" * 8)
    left._dirs["ef" * 8]._lock_fd, fd = None, left._dirs["ef" * 8]._lock_fd
    os.close(fd)  # as a killed worker's: the lock is free, the directory stays
    assert os.listdir(tmp_path) == [fanout.RX_PREFIX + "ef" * 8]
    fanout.NodeDirs(str(tmp_path))  # the next session sweeps it
    assert os.listdir(tmp_path) == []


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        errors.append(e)


def _fill(buf):
    buf[:] = b"\1\2\3\4"
    return buf, 4
