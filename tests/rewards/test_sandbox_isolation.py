"""Issue 17's sandbox attacks, tried through the public API (run_python, the code reward, the pool).

Each test states the attack, shows it contained, and where it applies checks the time to stop against a
liveness deadline (a sandbox that failed to stop it would run into its much longer wall timeout).
Namespace mode needs root and cgroups: this machine and CI run as root with cgroup v1 controllers.
"""

import dataclasses
import errno
import glob
import json
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid

import numpy as np
import pytest
from test_sandbox import DEADLINE_S, run_timed

from rljax.rewards import RewardPool, _cgroups
from rljax.rewards import sandbox as sandbox_lib
from rljax.rewards.sandbox import SandboxError, SandboxUnavailable, run_python

# Four processes, each touching 257 MB (bytes * n writes every page, so the memory is really used).
FOUR_X_257MB = """
import os, time
blocks = []
for _ in range(3):
    if os.fork() == 0:
        break
block = b"x" * (257 << 20)
print("holding 257 MB", flush=True)
time.sleep(2)
"""


def test_total_memory_of_all_processes_is_capped():
    # Before: RLIMIT_AS is per process, so 4 x 257 MB all ran under memory_mb=300.
    result, elapsed = run_timed(FOUR_X_257MB, memory_mb=300, max_procs=8, timeout_s=20.0)
    assert result.stdout.count("holding 257 MB") < 4, result.stdout
    assert result.killed_reason == "memory" and not result.timed_out
    assert elapsed < DEADLINE_S, f"took {elapsed:.1f}s to stop"
    # The same program with room for all four is not stopped (the limit, not the program, did it).
    roomy = run_python(FOUR_X_257MB, memory_mb=1400, max_procs=8, timeout_s=20.0)
    assert roomy.stdout.count("holding 257 MB") == 4 and roomy.killed_reason is None, roomy.stderr


FILL_TMP = """
import errno, json, os
report = {}
for directory in ("/tmp", "/dev/shm", "/var/tmp"):
    written = 0
    try:
        for i in range(10_000):
            with open(f"{directory}/fill-TAG-{i}", "wb") as f:
                f.write(b"x" * (1 << 20))
            written += 1
    except OSError as e:
        report[directory] = [written, errno.errorcode[e.errno]]
print(json.dumps(report))
"""


def test_tmp_and_shm_writes_are_capped_and_gone_after_the_run():
    # Before: /tmp and /dev/shm were the host's, with no total cap, and files outlived the run.
    tag = uuid.uuid4().hex
    result, elapsed = run_timed(
        FILL_TMP.replace("TAG", tag), tmpfs_mb=8, memory_mb=512, max_file_mb=4, timeout_s=20.0
    )
    report = json.loads(result.stdout)
    for directory in ("/tmp", "/dev/shm", "/var/tmp"):
        written, code = report[directory]
        assert written <= 8 and code == "ENOSPC", report  # 1 MB files into an 8 MB tmpfs
    assert elapsed < DEADLINE_S
    leftovers = [
        p for d in ("/tmp", "/dev/shm", "/var/tmp", tempfile.gettempdir()) for p in glob.glob(f"{d}/*{tag}*")
    ]
    assert leftovers == []
    # The next run starts with an empty /tmp: nothing of the first run is visible.
    again = run_python(f"import glob\nprint(glob.glob('/tmp/*{tag}*') + glob.glob('/dev/shm/*'))")
    assert again.stdout.strip() == "[]", again.stdout


def _host_dir_outside_private_mounts() -> str:
    """A writable host directory the sandbox's uid can reach through its read-only mounts: not under /tmp,
    /var/tmp or /dev/shm, which it replaces with private tmpfs (a checkout under /tmp is invisible there),
    and every ancestor searchable by others (root's home is not: EACCES before the mount could answer)."""
    private = ("/tmp", "/var/tmp", "/dev/shm")

    def reachable(path: str) -> bool:
        parts = pathlib.Path(path).parts
        return all(os.stat(os.path.join(*parts[: i + 1])).st_mode & 0o001 for i in range(len(parts)))

    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.getcwd(), here, os.path.expanduser("~"), "/var/lib", "/opt", "/srv", "/mnt"):
        real = os.path.realpath(candidate)
        outside = not any(real == p or real.startswith(p + "/") for p in private)
        if outside and os.path.isdir(real) and os.access(real, os.W_OK) and reachable(real):
            return real
    pytest.fail(f"no writable, world-searchable directory outside {private} to plant the test's directory in")


def test_the_host_is_hidden_and_what_is_shown_is_read_only():
    """A private root: a file with the answer planted in a world-readable host directory, a world-writable
    one and a listening path socket there cannot even be named (ENOENT); /usr, which the interpreter
    needs, is read-only (EROFS). Audit mode (no namespaces) reads, writes and connects: each probe works."""
    open_dir = pathlib.Path(
        tempfile.mkdtemp(prefix=".rljax-root-test-", dir=_host_dir_outside_private_mounts())
    )
    listener = socket.socket(socket.AF_UNIX)
    try:
        open_dir.chmod(0o777)
        (open_dir / "answers.txt").write_text("42")
        (open_dir / "answers.txt").chmod(0o644)
        listener.bind(str(open_dir / "control.sock"))
        os.chmod(open_dir / "control.sock", 0o777)
        listener.listen(1)
        code = (
            "import os, socket\n"
            "def attempt(fn):\n"
            "    try:\n"
            "        return repr(fn())\n"
            "    except OSError as e:\n"
            "        return e.errno\n"
            f"d = {str(open_dir)!r}\n"
            "print(attempt(lambda: open(os.path.join(d, 'answers.txt')).read()))\n"
            "print(attempt(lambda: open(os.path.join(d, 'planted'), 'w').close()))\n"
            "print(attempt(lambda: socket.socket(socket.AF_UNIX).connect(os.path.join(d, 'control.sock'))))\n"
            "print(attempt(lambda: open('/usr/planted', 'w').close()))\n"
        )
        hidden = run_python(code).stdout.split()
        assert hidden == [str(errno.ENOENT)] * 3 + [str(errno.EROFS)], hidden
        assert not (open_dir / "planted").exists()
        shown = run_python(code, mode="audit").stdout.split()
        assert shown[:3] == ["'42'", "None", "None"], shown  # the same probes, without the private root
    finally:
        listener.close()
        shutil.rmtree(open_dir)


KERNEL_STATE = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
def call(*args):
    r = libc.syscall(*args)
    return r if r >= 0 else -ctypes.get_errno()
nr = {"x86_64": (248, 250, 272), "aarch64": (217, 219, 97)}[__import__("platform").machine()]
add_key, keyctl, unshare = nr
print(call(add_key, b"user", b"rljax-left-behind", b"answer", 6, -4))  # into the user keyring
print(call(keyctl, 0, -4, 0))  # KEYCTL_GET_KEYRING_ID of the user keyring
print(call(unshare, 0x10000000))  # CLONE_NEWUSER
print(call(x32 := 0x40000000 | 250, 0, -4, 0) if nr[0] == 248 else -errno.EPERM)  # the x32 alias
import threading, subprocess
t = threading.Thread(target=print, args=("thread",)); t.start(); t.join()
print(subprocess.run(["/bin/sh", "-c", "echo child"], capture_output=True, text=True).stdout.strip())
"""


def test_kernel_keyrings_and_new_user_namespaces_are_out_of_reach():
    """The user keyring outlives a run for the same uid and a new user namespace would give the code root
    inside it: the seccomp filter refuses both (EPERM), while threads and child processes still work."""
    out = run_python(KERNEL_STATE).stdout.split()
    assert out[:4] == [str(-errno.EPERM)] * 4, out
    assert out[4:] == ["thread", "child"], out


SPY = """
import glob, json, os
report = {"visible_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
for what in ("mem", "cmdline", "environ", "cwd"):
    path = f"/proc/{VICTIM}/{what}"
    try:
        data = os.readlink(path) if what == "cwd" else open(path, "rb").read(4096)
        report[what] = repr(data)
    except OSError as e:
        report[what] = type(e).__name__
sources = {}
for path in VICTIM_SOURCES:  # where the victim's code lies on the host
    try:
        sources[path] = open(path).read()
    except OSError as e:
        sources[path] = type(e).__name__
report["sources"] = sources
print(json.dumps(report))
"""


@pytest.mark.parametrize("mode", ["namespace", "audit"])
def test_a_sandbox_cannot_read_another_ones_source_or_memory(mode):
    # Before: one uid and the host /proc for all: one sandbox read another's source and opened its
    # /proc/<pid>/mem read/write. Namespace mode hides the other run entirely (private /proc and /tmp);
    # audit mode (host /proc) still refuses, by the distinct uid and the non-dumpable process.
    tag, secret = uuid.uuid4().hex, uuid.uuid4().hex
    victim_code = f"SECRET = {secret!r}\nimport time\ntime.sleep(5)\n"
    victim = threading.Thread(
        target=run_python,
        args=(victim_code,),
        kwargs=dict(timeout_s=10.0, env={"VICTIM_TAG": tag}, mode=mode),
    )
    victim.start()
    end = time.monotonic() + DEADLINE_S
    while not (pids := tagged_pids(tag)) and time.monotonic() < end:
        time.sleep(0.05)
    assert pids, "the victim never started"
    pattern = f"{tempfile.gettempdir()}/rljax-sandbox-*/**/main.py"
    sources = [p for p in glob.glob(pattern, recursive=True) if secret in pathlib.Path(p).read_text()]
    assert sources, "the victim's source should be on the host for this test to try it"
    spy = SPY.replace("VICTIM_SOURCES", repr(sources)).replace("VICTIM", str(max(pids)))
    result = run_python(spy, mode=mode, timeout_s=10.0)
    victim.join()
    report = json.loads(result.stdout)
    assert secret not in result.stdout
    # A process's cmdline is world-readable on the host /proc (audit mode); it holds no secret.
    for what in ("mem", "environ", "cwd") + (("cmdline",) if mode == "namespace" else ()):
        assert report[what] in ("PermissionError", "FileNotFoundError"), (what, report[what])
    denied = ("PermissionError", "FileNotFoundError")
    assert len(report["sources"]) == len(sources), report["sources"]
    assert all(v in denied for v in report["sources"].values()), report["sources"]
    if mode == "namespace":
        assert max(report["visible_pids"]) <= 3, report["visible_pids"]  # only its own processes


def tagged_pids(tag: str) -> list[int]:
    pids = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            if tag.encode() in pathlib.Path(path).read_bytes():
                pids.append(int(path.split("/")[2]))
        except OSError:
            pass
    return pids


FORK_BOMB = (
    "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```"
)
CORRECT = "```python\ndef f(x):\n    return 2 * x\n```"


def test_a_fork_bomb_does_not_zero_a_concurrent_correct_sample():
    # Before: all sandboxes shared `nobody`'s RLIMIT_NPROC, so a fork bomb made a concurrent correct
    # sample score 0 with no error counted. Now each run has its own uid and pids cgroup.
    example = {"tests": ["assert f(2) == 4", "assert f(5) == 10"]}
    batch = [
        {"prompt": "", "completion": c, "example": example} for c in (FORK_BOMB, CORRECT, FORK_BOMB, CORRECT)
    ]
    spec = ("code", 1.0, {"timeout_s": 3.0, "max_procs": 16})
    with RewardPool([spec], num_workers=2, timeout_s=20.0) as pool:
        assert pool.wait_ready()
        start = time.monotonic()
        rewards, _, metrics = pool.score(batch)
        elapsed = time.monotonic() - start
    np.testing.assert_array_equal(rewards, np.float32([0, 1, 0, 1]))
    assert metrics["reward_fn/errors"] == 0 and metrics["reward_fn/timeouts"] == 0
    assert elapsed < 2 * DEADLINE_S


def processes_of_uid(uid: int) -> list[str]:
    """Host processes (zombies included) running as `uid`, as 'pid state'."""
    found = []
    for path in glob.glob("/proc/[0-9]*/status"):
        try:
            fields = dict(
                line.split(":", 1) for line in pathlib.Path(path).read_text().splitlines() if ":" in line
            )
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid:
            found.append(f"{path.split('/')[2]} {fields['State'].strip()}")
    return found


ZOMBIE_MAKER = """
import os, time
for _ in range(6):
    if os.fork() == 0:
        os._exit(0)  # never reaped: a zombie
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        time.sleep(300)
while True:
    pass
"""


def test_a_timed_out_run_leaves_no_zombie_or_process_and_no_cgroup():
    # Before: timed-out runs could leave zombies that ate the shared uid's process budget.
    result, elapsed = run_timed(ZOMBIE_MAKER, timeout_s=1.5, max_procs=16)
    assert result.timed_out and elapsed < DEADLINE_S
    assert processes_of_uid(result.uid) == []
    layout = sandbox_lib._layout()
    mine = [
        p
        for parent in set(layout.parents.values())
        for p in parent.glob(f"{_cgroups.PREFIX}*.{os.getpid()}.*")
    ]
    assert mine == []


def test_boot_failure_is_an_error_not_a_zero():
    # A sandbox that cannot start its code (here: no process left for it) raises; the pool counts it.
    with pytest.raises(SandboxError, match="set-up failed"):
        run_python("print('hi')", max_procs=0)
    example = {"tests": ["assert f(2) == 4"]}
    with RewardPool([("code", 1.0, {"max_procs": 0})], num_workers=1, timeout_s=20.0) as pool:
        rewards, _, metrics = pool.score([{"prompt": "", "completion": CORRECT, "example": example}])
    assert rewards[0] == 0.0 and metrics["reward_fn/errors"] == 1


def test_namespace_mode_fails_closed_where_cgroups_are_missing(monkeypatch):
    monkeypatch.setattr(_cgroups, "ROOT", pathlib.Path("/nonexistent-cgroup-root"))
    sandbox_lib.check.cache_clear()
    sandbox_lib._layout.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="cgroup.*reward.sandbox=audit"):
            run_python("print('hi')", mode="namespace")
        assert run_python("print('hi')", mode="audit").stdout == "hi\n"  # only by explicit choice
    finally:
        monkeypatch.undo()
        sandbox_lib.check.cache_clear()
        sandbox_lib._layout.cache_clear()


CTYPES_SOCKET = """
import ctypes
libc = ctypes.CDLL(None)
fd = libc.socket(2, 1, 0)
addr = (ctypes.c_ubyte * 16)(2, 0, PORT >> 8, PORT & 255, 127, 0, 0, 1)
print("connect", libc.connect(fd, addr, 16))
"""


@pytest.mark.parametrize(
    "attack",
    [
        CTYPES_SOCKET,
        "import os\nos.system('id')",
        "import _posixsubprocess",
        "import gc, sys\n"  # a ctypes module object left in memory by the boot, if any
        "mods = [o for o in gc.get_objects() if type(o) is type(sys) and 'ctypes' in o.__name__]\n"
        "mods[0].CDLL(None).getpid()",
        "import subprocess\nsubprocess.run(['id'])",
    ],
)
def test_audit_mode_blocks_ctypes_and_spawning(attack):
    # Before: the audit-hook fallback was bypassed by ctypes (a socket reached a loopback listener) and
    # system("id") ran. Audit mode now refuses ctypes, _posixsubprocess, system and exec.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    code = attack.replace("PORT", str(server.getsockname()[1]))
    result = run_python(code, mode="audit", timeout_s=10.0)
    assert result.returncode != 0 and "uid=" not in result.stdout and "connect" not in result.stdout
    assert "disabled in the sandbox" in result.stderr or "IndexError" in result.stderr, result.stderr
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


def test_no_network_not_even_abstract_unix_sockets():
    # A network namespace also hides the host's abstract Unix sockets (which file permissions do not guard).
    name = f"\0rljax-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)
    server.listen()
    server.setblocking(False)
    code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({name!r})\nprint('connected')"
    result = run_python(code, timeout_s=10.0)
    assert "connected" not in result.stdout and "ConnectionRefusedError" in result.stderr, result.stderr
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


def test_sandbox_is_not_dumpable_and_has_no_new_privs():
    code = "print(open('/proc/self/status').read())"
    status = dict(line.split(":", 1) for line in run_python(code).stdout.splitlines() if ":" in line)
    assert status["NoNewPrivs"].strip() == "1"
    assert status["CapEff"].strip() == "0000000000000000"
    # Not dumpable: /proc/self/* of a non-dumpable process belongs to root, not to the process's uid.
    owner = run_python("import os\nprint(os.stat('/proc/self/mem').st_uid, os.getuid())").stdout.split()
    assert owner[0] == "0" and owner[1] != "0"


def test_config_lists_the_sandbox_modes_and_rejects_others():
    from rljax import config as config_lib

    assert config_lib.SANDBOX_MODES == sandbox_lib.MODES
    cfg = config_lib.Config()
    assert cfg.reward.sandbox == "namespace"  # the default fails closed
    bad = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, sandbox="none"))
    with pytest.raises(config_lib.ConfigError, match="reward.sandbox.*namespace, audit"):
        config_lib.validate(bad)


def test_stale_cgroups_are_swept_by_owner_identity_not_by_pid():
    # A PID alone may be reused or belong to another PID namespace: owners are (namespace, pid, start time).
    layout = sandbox_lib._layout()
    sleeper = subprocess.Popen(["sleep", "30"])
    dead_owner = _cgroups._owner_token(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    ns, pid, start = _cgroups._owner_token(os.getpid()).split(".")
    names = {
        "live": f"{ns}.{pid}.{start}",
        "dead": dead_owner,
        "reused_pid": f"{ns}.{pid}.{int(start) + 1}",
        "other_namespace": f"{int(ns) + 1}.{sleeper.pid}.1",
    }
    dirs = {
        k: [p / f"{_cgroups.PREFIX}{v}-0" for p in set(layout.parents.values())] for k, v in names.items()
    }
    try:
        for paths in dirs.values():
            for path in paths:
                path.mkdir()
        assert _cgroups.sweep_stale(layout) >= 2
        exists = {k: all(p.exists() for p in paths) for k, paths in dirs.items()}
        assert exists == {"live": True, "dead": False, "reused_pid": False, "other_namespace": True}
    finally:
        _cgroups.remove([p for paths in dirs.values() for p in paths])
