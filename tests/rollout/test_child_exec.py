"""rljax/rollout/child_exec.py: how VLLMServer starts its child (no preexec_fn, so no fork warning from JAX).

A trainer process with JAX's threads running spawns a "server" through `VLLMServer.spawn` (the command
swapped for a Python script that reports its signal disposition, affinity and TMPDIR, then sleeps); the
trainer prints no fork warning; SIGKILLing the trainer makes the server get SIGTERM (it writes a marker
file) and the server's private TMPDIR go. In process: `stop()` removes that TMPDIR, and a spawn sweeps the
ones whose owner is gone.
"""

import os
import pathlib
import signal
import stat
import subprocess
import sys
import textwrap
import time

from rljax import lockdir
from rljax.rollout import server as server_lib

REPO = pathlib.Path(__file__).resolve().parents[2]

SERVER = """
import os, signal, sys, time
out = sys.argv[1]
usr1 = "ignored" if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else "default"
with open(out + ".start", "w") as f:
    f.write(f"{usr1} {len(os.sched_getaffinity(0))} {os.getpid()} {os.environ['TMPDIR']}")
def term(*_):
    open(out + ".term", "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, term)
time.sleep(120)
"""

TRAINER = """
import sys
import jax, jax.numpy as jnp
from rljax.rollout import server as server_lib
jnp.ones(4).sum().block_until_ready()  # JAX's thread pools are up, as in a trainer
server_lib.server_command = lambda *a: [sys.executable, "-c", sys.argv[2], sys.argv[1]]
s = server_lib.VLLMServer(sys.argv[3], sys.argv[1] + ".work")
s.spawn()
print("spawned", s._proc.pid, flush=True)
import time; time.sleep(120)
"""


def wait_for(path: pathlib.Path, what: str) -> str:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    time.sleep(0.05)
    return path.read_text()


def test_server_child_dies_with_its_trainer_and_no_fork_warning(tmp_path):
    out = tmp_path / "server"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(out), textwrap.dedent(SERVER), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        usr1, cores, pid, tmp = wait_for(out.with_suffix(".start"), "the server never started").split()
        assert usr1 == "ignored"  # the trainer's preemption signal is not the server's
        assert int(cores) == len(os.sched_getaffinity(0))
        name = f"{server_lib.TMP_PREFIX}{trainer.pid}-"
        assert os.path.dirname(tmp) == server_lib._tmp_root() and os.path.basename(tmp).startswith(name)
        assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o700
        trainer.send_signal(signal.SIGKILL)
        _, stderr = trainer.communicate(timeout=30)
        wait_for(out.with_suffix(".term"), "the server did not get SIGTERM when its trainer died")
        deadline = time.monotonic() + 30
        while os.path.exists(tmp):  # the reaper's work: the trainer had no chance to clean up
            assert time.monotonic() < deadline, f"{tmp} left after the trainer's SIGKILL"
            time.sleep(0.05)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    assert "fork" not in stderr, stderr


def test_stop_removes_the_servers_tmpdir_and_spawn_sweeps_orphaned_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(
        server_lib, "server_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    # a trainer killed along with its reaper left its server's TMPDIR behind (its lock is free)
    orphan, fd = lockdir.make_locked_dir(server_lib._tmp_root(), server_lib.TMP_PREFIX, 0o700)
    os.close(fd)
    # and a live trainer's server's TMPDIR (locked), which no sweep may touch
    held, held_fd = lockdir.make_locked_dir(server_lib._tmp_root(), server_lib.TMP_PREFIX, 0o700)
    s = server_lib.VLLMServer(tmp_path, tmp_path / "work")
    try:
        s.spawn()
        first = s.tmpdir
        assert os.path.isdir(first) and not os.path.exists(orphan) and os.path.isdir(held)
        os.killpg(s.pid, signal.SIGKILL)  # the child dies by itself; the next spawn replaces its dir
        s._proc.wait()
        s.spawn()
        assert s.tmpdir != first and not os.path.exists(first) and os.path.isdir(s.tmpdir)
        second = s.tmpdir
        s.stop()
        assert s.tmpdir is None and not os.path.exists(second)
    finally:
        s.stop()
        os.close(held_fd)
        lockdir.sweep_unlocked(server_lib._tmp_root(), server_lib.TMP_PREFIX)
