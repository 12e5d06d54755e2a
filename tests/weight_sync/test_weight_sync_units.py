"""Host staging, the wire format, the server command line and the policy gate (no vLLM server)."""

import os
import stat
import subprocess
import sys
import threading
import time
import zlib

import ml_dtypes
import numpy as np
import pytest

from rljax import lockdir
from rljax.rollout import auth
from rljax.rollout.server import ServerOptions, server_command, server_env
from rljax.weight_sync import stage_buckets, staging, wire
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
    assert cmd[cmd.index("--middleware") + 1] == auth.MIDDLEWARE  # every route but /health needs the token
    env = server_env(opts)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "XLA_FLAGS" not in env


def test_server_does_not_import_from_its_working_directory():
    """Started from a checkout, the server must not find the checkout's top-level `kernels/` (it shadows
    Hugging Face's `kernels`, which transformers imports inside vLLM, and pulls in JAX) or any other module
    lying in the trainer's working directory."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = server_command("/m", "127.0.0.1", 1, ServerOptions())
    interpreter = cmd[: cmd.index("-m")]  # the interpreter and its flags, without the module to run
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else 'none')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a run from a copy may set it
    run = dict(cwd=repo, env=env, capture_output=True, text=True, check=True)
    out = subprocess.run([*interpreter, "-c", probe], **run)
    assert not out.stdout.strip().startswith(os.path.join(repo, "kernels")), out.stdout
    plain = subprocess.run([sys.executable, "-c", probe], **run)
    assert plain.stdout.strip().startswith(os.path.join(repo, "kernels"))  # what -P keeps out


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


def _hold_lock(path):
    """A live process (not this one) holding the flock on `path`; stop it with .kill()."""
    code = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
    code += "print('held', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"held\n"
    return proc


def _stale_dir(root, name, bucket=b"x" * 64):
    d = root / name
    d.mkdir(mode=0o700)
    (d / lockdir.LOCK_NAME).write_bytes(b"")
    (d / "bucket-0-00000").write_bytes(bucket)
    return d


def test_sweep_removes_run_dirs_by_lock_not_pid(tmp_path):
    mine = staging.RunDir(tmp_path)  # this trainer: held
    try:
        dead = _stale_dir(tmp_path, "rljax-ws-999999-dead")  # nobody holds its lock
        # A live owner whose recorded PID means nothing here (another PID namespace, or a reused PID).
        other = _stale_dir(tmp_path, f"rljax-ws-{os.getpid() + 1}-other")
        holder = _hold_lock(other / lockdir.LOCK_NAME)
        unrelated = tmp_path / "rljax-ws-notadir"
        unrelated.write_bytes(b"z")
        try:
            assert staging.sweep_stale_run_dirs(tmp_path) == [str(dead)]
            assert os.path.isdir(mine.path) and other.exists() and unrelated.exists()
        finally:
            holder.kill()
            holder.wait()
        assert staging.sweep_stale_run_dirs(tmp_path) == [str(other)]  # its owner is gone now
    finally:
        mine.close()
    assert not os.path.exists(mine.path)


def test_run_dir_and_buckets_are_private(tmp_path):
    run = staging.RunDir(tmp_path)
    try:
        assert stat.S_IMODE(os.stat(run.path).st_mode) == 0o700
        (bucket,) = stage_buckets(iter(_tensors().items()), bucket_bytes=1 << 20, directory=run.path)
        assert stat.S_IMODE(os.stat(bucket.path).st_mode) == 0o600
        fd = staging.open_bucket(bucket.path, tmp_path)  # what a vLLM worker may open
        os.close(fd)
    finally:
        run.close()


def test_sigkilled_trainer_run_dir_is_removed_by_its_reaper(tmp_path):
    code = (
        "import sys, numpy as np; from rljax.weight_sync import staging; r = staging.RunDir(sys.argv[1]); "
        "b = list(staging.stage_buckets(iter([('w', np.ones(64, np.float32))]), bucket_bytes=1024, "
        "directory=r.path)); print(b[0].path, flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    path = proc.stdout.readline().decode().strip()
    assert os.path.exists(path)
    proc.kill()  # SIGKILL: no cleanup code of the trainer runs
    proc.wait()
    deadline = time.monotonic() + 60
    while os.path.exists(os.path.dirname(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(os.path.dirname(path)), "the reaper did not remove the run directory"


def test_open_bucket_confines_worker_paths_to_private_run_dirs(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    run = staging.RunDir(root)
    try:
        (bucket,) = stage_buckets(iter(_tensors().items()), bucket_bytes=1 << 20, directory=run.path)
        secret = tmp_path / "secret"
        secret.write_bytes(b"s" * 64)
        os.symlink(secret, os.path.join(run.path, "bucket-link"))
        os.symlink(run.path, root / "rljax-ws-link")
        loose = root / "rljax-ws-loose"
        loose.mkdir(mode=0o755)
        loose.chmod(0o755)
        (loose / "bucket").write_bytes(b"l")
        os.mkfifo(os.path.join(run.path, "bucket-fifo"))
        name = os.path.basename(bucket.path)
        bad = {
            str(secret): "not a bucket file",
            f"{run.path}/../{os.path.basename(run.path)}/{name}": "not a bucket file",
            str(tmp_path / "rljax-ws-x" / name): "not a bucket file",  # another root
            os.path.join(run.path, lockdir.LOCK_NAME): "not a bucket file",
            os.path.join(run.path, "bucket-link"): "Too many levels of symbolic links",
            str(root / "rljax-ws-link" / name): "Not a directory|Too many levels",
            str(loose / "bucket"): "not private",
            os.path.join(run.path, "bucket-fifo"): "not a regular file",
        }
        for path, pattern in bad.items():
            with pytest.raises((ValueError, OSError), match=pattern):
                os.close(staging.open_bucket(path, root))
        os.close(staging.open_bucket(bucket.path, root))
    finally:
        run.close()


def test_canary_prompt_spans_two_full_kv_blocks():
    for block in (16, 32, 128):
        spec = make_canary(1000, block_size=block)
        # vLLM caches full blocks only and recomputes the last prompt token: 2 blocks must stay cached
        assert (len(spec.prompt_ids) - 1) // block == 2
        assert len(spec.completion_ids) == 24
        assert all(0 < t < 1000 for t in spec.prompt_ids + spec.completion_ids)
    assert make_canary(1000, block_size=32) == make_canary(1000, block_size=32)  # deterministic
    assert len(make_canary(1000, prompt_len=10).prompt_ids) == 10
