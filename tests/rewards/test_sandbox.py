"""The sandbox stops an infinite loop, a fork bomb, a memory bomb, a huge file write and a network attempt.

Limits are kept low so each case ends in about a second. The wall-clock bounds below are liveness
deadlines (a stalled sandbox would blow through them by far), not performance thresholds.
"""

import glob
import os
import socket
import time
import uuid

import pytest

from rljax.rewards import _slots
from rljax.rewards.sandbox import run_python, sandbox_info

DEADLINE_S = 15.0  # generous: the slowest case (memory bomb) ends in ~2 s on a loaded 2-core machine
IS_ROOT = os.geteuid() == 0


def processes_tagged(tag: str) -> int:
    """Live processes whose environment carries `tag` (sandbox children get it through `env=`)."""
    count = 0
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                count += tag.encode() in f.read()
        except OSError:
            pass
    return count


def wait_until_gone(tag: str, within_s: float = 5.0) -> int:
    end = time.monotonic() + within_s
    while processes_tagged(tag) and time.monotonic() < end:
        time.sleep(0.05)
    return processes_tagged(tag)


def run_timed(code: str, **kwargs):
    start = time.monotonic()
    result = run_python(code, **kwargs)
    return result, time.monotonic() - start


def test_runs_code_with_stdin_in_a_private_writable_dir_as_a_slot_uid():
    code = (
        "import os, sys, tempfile\n"
        "open('out.txt', 'w').write(sys.stdin.read().upper())\n"
        "fd, name = tempfile.mkstemp()\n"
        "print(open('out.txt').read(), os.getuid(), os.path.dirname(name) == os.getcwd(), sorted(os.environ))"
    )
    result = run_python(code, stdin="hello", env={"EXTRA": "1"})
    words = result.stdout.split()
    assert result.returncode == 0 and result.killed_reason is None, result.stderr
    assert words[0] == "HELLO" and words[2] == "True"
    assert int(words[1]) == result.uid
    if IS_ROOT:  # privileges dropped to the uid of a free slot
        assert _slots.UID_BASE <= result.uid < _slots.UID_BASE + _slots.NUM_SLOTS
    assert "EXTRA" in result.stdout and "PYTHONPATH" not in result.stdout  # clean env plus extras


def test_exit_codes_and_exceptions_are_reported():
    assert run_python("import sys; sys.exit(3)").returncode == 3
    failed = run_python("raise ValueError('boom')")
    assert failed.returncode == 1 and "ValueError: boom" in failed.stderr
    crashed = run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert crashed.returncode == -11 and crashed.killed_reason == "signal:SIGSEGV"


def test_infinite_loop_is_killed_at_the_wall_timeout():
    result, elapsed = run_timed("while True:\n    pass", timeout_s=1.0)
    assert result.timed_out and result.killed_reason == "timeout" and result.returncode == -9
    assert elapsed < DEADLINE_S


def test_cpu_limit_stops_a_busy_loop_before_the_wall_timeout():
    result, elapsed = run_timed("while True:\n    pass", timeout_s=30.0, cpu_s=1)
    assert not result.timed_out and result.killed_reason == "cpu"
    assert elapsed < DEADLINE_S


def test_fork_bomb_is_contained_and_leaves_no_process():
    tag = uuid.uuid4().hex
    bomb = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"  # escape the process group: only the PID namespace catches these
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
    )
    result, elapsed = run_timed(bomb, timeout_s=1.0, max_procs=8, env={"BOMB_TAG": tag})
    assert result.timed_out and elapsed < DEADLINE_S
    # The process-group kill could not reach the setsid'd children: the run's cgroup and PID namespace do.
    assert sandbox_info()["mode"] == "namespace"
    assert wait_until_gone(tag) == 0


def test_background_children_do_not_outlive_a_normal_exit():
    tag = uuid.uuid4().hex
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = run_python(code, timeout_s=5.0, env={"BG_TAG": tag})
    assert result.returncode == 0 and "parent done" in result.stdout
    assert wait_until_gone(tag) == 0


def test_memory_bomb_hits_the_address_space_limit():
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))"
    result, elapsed = run_timed(bomb, memory_mb=192, timeout_s=10.0)
    assert result.killed_reason == "memory" and result.returncode == 1 and not result.timed_out
    assert elapsed < DEADLINE_S


def test_huge_file_write_is_capped():
    code = "f = open('big.bin', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)"
    result, elapsed = run_timed(code, max_file_mb=2, timeout_s=10.0)
    assert result.killed_reason == "file_size" and not result.timed_out
    assert "File too large" in result.stderr and elapsed < DEADLINE_S


def test_output_flood_is_capped_by_the_file_limit():
    result = run_python("while True:\n    print('y' * 1000)", max_file_mb=1, timeout_s=10.0)
    assert not result.timed_out and len(result.stdout) <= 2**20


@pytest.mark.parametrize("network", ["namespace", "audit"])
def test_network_attempt_to_localhost_fails(network):
    assert sandbox_info(network)["mode"] == network, f"sandbox mode {network!r} should work on this machine"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    )
    result, elapsed = run_timed(code, mode=network, timeout_s=10.0)
    assert "connected" not in result.stdout and result.returncode == 1
    expected = "Network is unreachable" if network == "namespace" else "network access is disabled"
    assert expected in result.stderr and elapsed < DEADLINE_S
    with pytest.raises(BlockingIOError):
        server.accept()  # nothing ever reached the listening socket
    server.close()


def test_audit_mode_also_blocks_spawning_other_programs():
    result = run_python("import subprocess\nsubprocess.run(['true'])", mode="audit")
    assert result.returncode == 1 and "is disabled in the sandbox" in result.stderr


def test_unknown_mode_lists_choices():
    with pytest.raises(ValueError, match="namespace, audit"):
        run_python("pass", mode="none")


def test_sandbox_dies_with_a_killed_caller(tmp_path):
    import subprocess
    import sys

    tag = uuid.uuid4().hex
    caller_code = (
        "from rljax.rewards.sandbox import run_python\n"
        f"run_python('import time\\ntime.sleep(120)', timeout_s=100.0, env={{'CALLER_TAG': {tag!r}}})\n"
    )
    os.chmod(tmp_path, 0o711)  # the killed caller cannot remove its sandbox dir: keep it in tmp_path
    caller = subprocess.Popen(
        [sys.executable, "-c", caller_code], env={**os.environ, "TMPDIR": str(tmp_path)}
    )
    end = time.monotonic() + DEADLINE_S
    while not processes_tagged(tag) and time.monotonic() < end:
        time.sleep(0.05)
    assert processes_tagged(tag), "the sandboxed child never started"
    caller.kill()  # SIGKILL: the caller cannot clean up; the parent-death signal must
    caller.wait()
    assert wait_until_gone(tag) == 0
