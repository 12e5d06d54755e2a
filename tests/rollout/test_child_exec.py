"""rljax/rollout/child_exec.py: how VLLMServer starts its child (no preexec_fn, so no fork warning from JAX).

A trainer process with JAX's threads running spawns a "server" through `VLLMServer.spawn` (the command
swapped for a Python script that reports its signal disposition and affinity, then sleeps); the trainer
prints no fork warning; SIGKILLing the trainer makes the server get SIGTERM (it writes a marker file).
"""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

SERVER = """
import os, signal, sys, time
out = sys.argv[1]
usr1 = "ignored" if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else "default"
with open(out + ".start", "w") as f:
    f.write(f"{usr1} {len(os.sched_getaffinity(0))} {os.getpid()}")
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
        usr1, cores, pid = wait_for(out.with_suffix(".start"), "the server never started").split()
        assert usr1 == "ignored"  # the trainer's preemption signal is not the server's
        assert int(cores) == len(os.sched_getaffinity(0))
        trainer.send_signal(signal.SIGKILL)
        _, stderr = trainer.communicate(timeout=30)
        wait_for(out.with_suffix(".term"), "the server did not get SIGTERM when its trainer died")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    assert "fork" not in stderr, stderr
