"""A real multi-process run: 2 JAX processes x 4 CPU devices (jax.distributed on localhost) give the
same loss, gradients and updated params as one device (<= 1e-5 relative)."""

import os
import socket
import subprocess
import sys
import time

import mp_trainer_common as C
import pytest

WORKER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "mp_train_worker.py"
)
TIMEOUT_S = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(in_path: str, out_path: str, log_dir) -> None:
    """Starts both processes; if one fails, stops the other (a survivor would wait for its peer)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs, logs = [], []
    for i in range(2):
        log = open(log_dir / f"worker{i}.log", "w+")  # noqa: SIM115 (closed below)
        cmd = [sys.executable, WORKER, str(i), str(port), in_path, out_path]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read()[-3000:])
        log.close()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"worker exit codes {codes}\n" + "\n----\n".join(texts)


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT_S + 200)
def test_two_processes_of_four_devices_match_one_device(tmp_path):
    ref = C.reference_run()
    in_path, out_path = str(tmp_path / "in.pkl"), str(tmp_path / "out.pkl")
    C.save_pickle({"ckpt": ref.ckpt, "batch": ref.batch}, in_path)
    run_workers(in_path, out_path, tmp_path)
    out = C.load_pickle(out_path)
    assert C.max_rel_diff(out["grads"], ref.grads) <= 1e-5
    assert C.max_rel_diff(out["new_params"], ref.new_params) <= 1e-5
    for key, value in out["metrics"].items():
        assert value == pytest.approx(ref.metrics[key], rel=1e-5, abs=1e-7), key
