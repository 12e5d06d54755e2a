"""Status files (atomic, never half-written) and the monitor: stall detection, --once, Prometheus endpoint."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from rljax import monitor
from rljax.metrics import MetricsLogger, StatusWriter, is_stalled, read_statuses, status_path


def test_status_file_is_never_seen_half_written(tmp_path):
    writer = StatusWriter(tmp_path, 0)
    writer.update(step=0, phase="start")
    path = status_path(tmp_path, 0)
    stop = threading.Event()
    seen, errors = [[], []], []

    def hammer(seen):
        while not stop.is_set():
            try:
                with open(path, encoding="utf-8") as f:  # read the file itself, not through read_statuses
                    seen.append(json.loads(f.read())["step"])
            except (json.JSONDecodeError, FileNotFoundError, KeyError) as err:
                errors.append(repr(err))

    readers = [threading.Thread(target=hammer, args=(s,)) for s in seen]
    for t in readers:
        t.start()
    try:
        # A large field makes each write span many bytes: a non-atomic write would show as truncated JSON.
        for step in range(1, 151):
            writer.update(step=step, phase="update", policy_version=step, notes="x" * (20_000 + step))
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert not errors, errors[:5]
    for steps in seen:  # each reader saw only whole files, in write order, and many of them
        assert len(steps) > 100 and steps == sorted(steps) and len(set(steps)) > 5
    assert json.loads(path.read_text())["step"] == 150
    assert [p.name for p in path.parent.iterdir()] == ["process_0.json"]  # no temporary file left behind


def test_status_update_merges_fields_and_stamps_the_heartbeat(tmp_path):
    clock = iter([10.0, 20.0, 30.0, 40.0])
    writer = StatusWriter(tmp_path, 3, time_fn=lambda: next(clock))
    writer.update(step=5, phase="rollout", policy_version=4, total_steps=40)
    status = writer.update(phase="update", eta_s=12.5)
    assert status == {**status, "process_index": 3, "step": 5, "phase": "update", "policy_version": 4,
                      "eta_s": 12.5, "total_steps": 40, "started": 10.0, "heartbeat": 30.0}  # fmt: skip
    assert read_statuses(tmp_path) == [json.loads(status_path(tmp_path, 3).read_text())]
    with pytest.raises(ValueError, match="heartbeat"):
        writer.update(heartbeat=0.0)
    writer.close()
    assert read_statuses(tmp_path)[0]["phase"] == "done"
    assert not is_stalled(read_statuses(tmp_path)[0], now=1e9, stall_after_s=1.0)  # done is never stalled


def _two_processes(tmp_path, stale_age_s):
    now = time.time()
    StatusWriter(tmp_path, 0).update(step=7, phase="update", policy_version=7, eta_s=90.0, total_steps=20)
    StatusWriter(tmp_path, 1, time_fn=lambda: now - stale_age_s).update(
        step=6, phase="rollout", policy_version=6
    )
    return now


def test_monitor_flags_the_process_with_an_old_heartbeat(tmp_path, capsys):
    now = _two_processes(tmp_path, stale_age_s=120.0)
    statuses = read_statuses(tmp_path)
    assert [monitor.process_state(s, now, 60.0) for s in statuses] == ["ok", "STALLED"]
    assert [monitor.process_state(s, now, 300.0) for s in statuses] == ["ok", "ok"]
    assert monitor.main([str(tmp_path), "--once", "--stall-after", "60"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == list(monitor._COLUMNS)
    assert out[1].split()[3:6] == ["7/20", "update", "7"] and out[1].split()[-1] == "ok"
    assert out[2].split()[-1] == "STALLED" and "2m00s ago" in out[2]
    assert out[3].startswith("2 processes, 1 stalled")
    assert monitor.main([str(tmp_path), "--once", "--stall-after", "300"]) == 0


def test_monitor_cli_once_exit_codes(tmp_path):
    cmd = [sys.executable, "-m", "rljax.monitor", str(tmp_path), "--once", "--stall-after", "30"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    empty = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert empty.returncode == 2 and "no status files" in empty.stderr
    _two_processes(tmp_path, stale_age_s=45.0)
    stalled = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert stalled.returncode == 1 and "STALLED" in stalled.stdout, stalled.stderr


def test_prometheus_endpoint_over_real_http(tmp_path):
    _two_processes(tmp_path, stale_age_s=120.0)
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.write(0, {"reward/mean": 0.25})
        logger.write(1, {"reward/mean": 0.75, "kl/mean": float("nan")})
    server = monitor.start_prometheus_server(tmp_path, 0, stall_after_s=60.0)
    try:
        host, port = server.server_address
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = resp.read().decode()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
        assert err.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
    samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if not line.startswith("#"))
    assert samples['rljax_step{process="0"}'] == "7" and samples['rljax_step{process="1"}'] == "6"
    assert samples['rljax_stalled{process="0"}'] == "0" and samples['rljax_stalled{process="1"}'] == "1"
    assert float(samples['rljax_heartbeat_age_seconds{process="1"}']) >= 120.0
    assert (
        samples['rljax_eta_seconds{process="0"}'] == "90" and 'rljax_eta_seconds{process="1"}' not in samples
    )
    assert samples['rljax_metric{name="reward/mean"}'] == "0.75"  # the last step's value
    assert 'rljax_metric{name="kl/mean"}' not in samples  # null (NaN) is left out
    assert "# TYPE rljax_step gauge" in body


def test_live_view_with_prometheus_flag_and_ctrl_c(tmp_path):
    _two_processes(tmp_path, stale_age_s=120.0)
    args = ["--interval", "0.2", "--stall-after", "60", "--prometheus-port", "0"]
    # SIGINT's default disposition, as under a terminal: a suite started in the background with `&` ignores
    # SIGINT and a child would inherit that; exec keeps the default this wrapper sets
    default_sigint = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    cmd = [sys.executable, "-c", default_sigint, "-u", "-m", "rljax.monitor", str(tmp_path), *args]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        banner = proc.stderr.readline()
        assert banner.startswith("Prometheus metrics at http://127.0.0.1:"), banner
        with urllib.request.urlopen(banner.split()[-1], timeout=10) as resp:
            assert 'rljax_stalled{process="1"} 1' in resp.read().decode()
        first = [proc.stdout.readline() for _ in range(5)]  # title, header, 2 rows, summary
        assert first[3].split()[-1] == "STALLED" and first[4].startswith("2 processes, 1 stalled")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # Ctrl-C ends the live view cleanly
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
