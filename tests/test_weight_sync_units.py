"""Host staging, the wire format, the server command line and the policy gate (no vLLM server)."""

import os
import threading
import time
import zlib

import ml_dtypes
import numpy as np
import pytest

from rljax.rollout.server import ServerOptions, server_command, server_env
from rljax.weight_sync import stage_buckets, wire
from rljax.weight_sync.canary import make_canary
from rljax.weight_sync.gate import PolicyGate


def _tensors():
    rng = np.random.default_rng(0)
    shapes = {"a": (64, 32), "b": (7,), "c": (300, 40), "d": (5, 3), "e": (0,)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} | {
        "f": rng.standard_normal((9, 4)).astype(ml_dtypes.bfloat16)
    }


def test_buckets_are_bounded_aligned_and_round_trip(tmp_path):
    tensors = _tensors()
    buckets = list(
        stage_buckets(iter(tensors.items()), bucket_bytes=16 * 1024, directory=tmp_path, checksums=True)
    )
    assert [e.name for b in buckets for e in b.entries] == list(tensors)
    for b in buckets:
        data = open(b.path, "rb").read()
        assert len(data) == b.nbytes
        # a bucket exceeds the bound only when it holds one tensor larger than the bound ("c": 48000 bytes)
        assert b.nbytes <= 16 * 1024 or len(b.entries) == 1
        for e in b.entries:
            assert e.offset % wire.ALIGN == 0
            arr = np.frombuffer(data[e.offset : e.offset + e.nbytes], dtype=tensors[e.name].dtype)
            np.testing.assert_array_equal(arr.reshape(e.shape), tensors[e.name])
            assert e.crc32 == zlib.crc32(tensors[e.name].tobytes())
            assert wire.TensorEntry.from_wire(e.to_wire()) == e
    assert [b.index for b in buckets] == list(range(len(buckets))) and len(buckets) >= 3


def test_staging_rejects_unknown_wrong_shape_and_duplicate_names_and_cleans_up(tmp_path):
    tensors = _tensors()
    spec = {k: (v.shape, str(v.dtype)) for k, v in tensors.items()}
    cases = [
        ([("a", tensors["a"]), ("zz", tensors["b"])], "unknown tensor 'zz'"),
        ([("a", tensors["a"]), ("b", np.zeros(8, np.float32))], r"'b' has shape \(8,\), expected \(7,\)"),
        ([("a", tensors["a"]), ("a", tensors["a"])], "'a' pushed twice"),
    ]
    for items, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            list(stage_buckets(iter(items), bucket_bytes=1 << 20, directory=tmp_path, spec=spec))
        assert list(tmp_path.iterdir()) == []  # the bucket being written is removed


def test_check_entries_rejects_bad_byte_ranges():
    spec = {"w": ((4, 4), "float32")}
    with pytest.raises(ValueError, match="bad byte range"):
        wire.check_entries([wire.TensorEntry("w", "float32", (4, 4), 0, 60)], spec, set())
    with pytest.raises(ValueError, match="bad byte range"):
        wire.check_entries([wire.TensorEntry("w", "float32", (4, 4), 32, 64)], spec, set(), file_size=64)
    with pytest.raises(ValueError, match="unsupported wire dtype"):
        wire.check_entries([wire.TensorEntry("w", "int8", (4, 4), 0, 16)], spec, set())


def test_server_command_and_env():
    opts = ServerOptions(max_model_len=256, extra_args=("--foo",))
    cmd = server_command("/m", "127.0.0.1", 1234, opts)
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "shm"}'
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[-1] == "--foo"
    assert cmd[cmd.index("--block-size") + 1] == "32"  # vLLM's CPU default (128) would lengthen the canary
    assert "--block-size" not in server_command("/m", "127.0.0.1", 1, ServerOptions(block_size=None))
    env = server_env(opts)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "XLA_FLAGS" not in env


def test_gate_sync_waits_for_in_flight_generation():
    gate, events = PolicyGate(3), []

    def generation():
        with gate.shared() as v:
            events.append(("gen", v))
            time.sleep(0.2)
            events.append(("gen_done", v))

    t = threading.Thread(target=generation)
    t.start()
    time.sleep(0.05)
    with gate.exclusive(timeout_s=5):
        events.append(("sync", None))
        gate.version = 4
    t.join()
    with gate.shared() as v:
        assert v == 4
    assert events == [("gen", 3), ("gen_done", 3), ("sync", None)]
    with gate.shared(), pytest.raises(TimeoutError):
        with gate.exclusive(timeout_s=0.05):
            pass


def test_sweep_removes_buckets_of_dead_trainers_only(tmp_path):
    import subprocess
    import sys

    from rljax.weight_sync.staging import sweep_stale_buckets

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)  # exited: its pid is free (reuse within this test is vanishingly unlikely)
    (tmp_path / f"rljax-ws-{dead_pid}-abcd1234-00000").write_bytes(b"x" * 64)
    live = tmp_path / f"rljax-ws-{os.getpid()}-abcd1234-00000"
    live.write_bytes(b"y")
    other = tmp_path / "rljax-ws-notapid-00000"
    other.write_bytes(b"z")
    removed = sweep_stale_buckets(tmp_path)
    assert removed == [str(tmp_path / f"rljax-ws-{dead_pid}-abcd1234-00000")]
    assert live.exists() and other.exists()


def test_canary_prompt_spans_two_full_kv_blocks():
    for block in (16, 32, 128):
        spec = make_canary(1000, block_size=block)
        # vLLM caches full blocks only and recomputes the last prompt token: 2 blocks must stay cached
        assert (len(spec.prompt_ids) - 1) // block == 2
        assert len(spec.completion_ids) == 24
        assert all(0 < t < 1000 for t in spec.prompt_ids + spec.completion_ids)
    assert make_canary(1000, block_size=32) == make_canary(1000, block_size=32)  # deterministic
    assert len(make_canary(1000, prompt_len=10).prompt_ids) == 10
