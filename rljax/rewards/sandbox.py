"""Run untrusted Python in a subprocess with per-run limits, no network, and no view of other runs.

Two modes (docs/security.md has the threat model):
- `namespace` (the default): needs root (or the capabilities to create namespaces, mount and change uid)
  and a cgroup with the memory and pids controllers (v2, else v1). Each run gets its own cgroup (total
  memory, process count, CPU share; everything in it is killed when the run ends), new mount, PID,
  network, IPC and UTS namespaces (no network at all, a private /proc that shows only the run's own
  processes, size-capped private tmpfs on /tmp, /var/tmp and /dev/shm that vanish with the run, every
  other mount read-only), a uid of its own per concurrent run (`_slots`), and a non-dumpable process with
  no_new_privs. It fails closed: where any of that is missing, `run_python` raises `SandboxUnavailable`
  saying what is missing, and never falls back to something weaker.
- `audit` (only by explicit choice): no namespaces; an audit hook refuses non-Unix sockets, spawning
  programs, and importing ctypes / _posixsubprocess / cffi (which would bypass the hook). Per-run cgroups
  and per-slot uids are still used where available. Python audit hooks are not a security boundary.
Both modes also set RLIMIT_CPU, RLIMIT_AS (per process), RLIMIT_FSIZE (also caps stdout/stderr, which go to
files), RLIMIT_NPROC, RLIMIT_CORE=0, a clean environment, and SIGKILL everything when the wall time is up.
A run whose sandbox could not be set up raises `SandboxError` (counted as a reward error by the pool), so
a broken sandbox never reads as a wrong solution.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from rljax.rewards import _cgroups, _slots

_BOOT = pathlib.Path(__file__).with_name("_sandbox_boot.py")
MODES = ("namespace", "audit")
_settings = {"mode": "namespace", "tmpfs_mb": 64, "cpus": 1.0}  # this process's defaults; see configure()


class SandboxError(RuntimeError):
    """The sandbox itself failed (set-up, limits, a boot step): not the solution's result."""


class SandboxUnavailable(SandboxError):
    """The chosen mode cannot run here; the message says what is missing and what to choose instead."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run. `returncode` < 0 means killed by that signal; `killed_reason` is
    None for a normal exit, else one of "timeout", "cpu", "memory", "file_size", "signal:<NAME>";
    `uid` is the uid the code ran as."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    killed_reason: str | None
    wall_s: float = 0.0
    uid: int = -1


def configure(*, mode: str | None = None, tmpfs_mb: int | None = None, cpus: float | None = None) -> None:
    """Sets this process's defaults for `run_python` (reward workers call it with the run's config).

    mode: "namespace" | "audit"; tmpfs_mb: size of each private tmpfs (/tmp, /var/tmp, /dev/shm), also
    counted in the run's memory; cpus: CPU share of one run (cgroup CPU bandwidth), in cores."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown sandbox mode {mode!r}; valid: {', '.join(MODES)}")
    updates = {"mode": mode, "tmpfs_mb": tmpfs_mb, "cpus": cpus}
    _settings.update({k: v for k, v in updates.items() if v is not None})


@functools.cache
def _layout() -> _cgroups.Layout | None:
    try:
        layout = _cgroups.detect()
    except OSError:
        return None
    _cgroups.sweep_stale(layout)
    return layout


def sweep() -> int:
    """Removes the cgroups of sandboxes whose owner died (e.g. a killed reward worker); returns how many."""
    layout = _layout()
    return _cgroups.sweep_stale(layout) if layout is not None else 0


def _missing(mode: str) -> list[str]:
    """What `mode` needs that this machine lacks (empty when it should work)."""
    if mode == "audit":
        return []
    missing = []
    if os.geteuid() != 0:
        missing.append("root (to create namespaces, mount private /tmp and /proc, and run as per-slot uids)")
    if _layout() is None:
        try:
            _cgroups.detect()
        except OSError as e:
            missing.append(f"per-run cgroups: {e}")
    return missing


# The probe checks the whole chain: it starts, runs as the slot uid, imports stdlib modules lazily (the
# interpreter must be readable by that uid), writes its dir and a temp file, and cannot reach 127.0.0.1.
_PROBE = """
import errno, fractions, json, os, socket, tempfile
open("probe.txt", "w").write("ok")
tempfile.mkstemp()
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(1.0)
    s.connect(("127.0.0.1", 9))
    net = "open"
except OSError as e:
    net = "open" if e.errno == errno.ECONNREFUSED else "blocked"
print(json.dumps({"uid": os.getuid(), "net": net, "pid": os.getpid()}))
"""


@functools.cache
def check(mode: str) -> dict[str, str]:
    """Probes `mode` once per process; returns what it uses, or raises SandboxUnavailable saying why."""
    if mode not in MODES:
        raise ValueError(f"unknown sandbox mode {mode!r}; valid: {', '.join(MODES)}")
    hint = " (reward.sandbox=audit runs a weaker audit-hook sandbox, only by explicit choice)"
    missing = _missing(mode)
    if missing:
        raise SandboxUnavailable(
            f"sandbox mode {mode!r} is not available here: needs {'; '.join(missing)}{hint}"
        )
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        if not os.path.exists(python):
            continue
        try:
            result = _run(mode, python, _PROBE, **_probe_limits())
            report = json.loads(result.stdout.strip().splitlines()[-1])
        except (SandboxError, ValueError, IndexError, KeyError) as e:
            problem = f"probe with {python} failed: {e}"
            continue
        problem = f"probe with {python}: {report} (stderr {result.stderr[-300:]!r})"
        isolated = report["net"] == "blocked" and (mode == "audit" or report["pid"] <= 3)
        expected_uid = result.uid if result.uid >= 0 else os.geteuid()  # -1: not root, no slot uid
        if result.returncode == 0 and isolated and report["uid"] == expected_uid:
            return {"mode": mode, "python": python, "user": str(result.uid), "cgroups": str(_layout())}
    raise SandboxUnavailable(f"sandbox mode {mode!r} does not work here: {problem}{hint}")


def _probe_limits() -> dict[str, object]:
    return dict(stdin="", timeout_s=20.0, memory_mb=1024, max_file_mb=1, max_procs=64)


def sandbox_info(mode: str | None = None) -> dict[str, str]:
    """What `run_python` uses here for `mode` (default: the configured one): {"mode", "python", "user",
    "cgroups"}; raises SandboxUnavailable when that mode cannot run (reward workers call it at start)."""
    return check(mode or _settings["mode"])


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_file_mb: int = 16,
    max_procs: int = 32,
    cpu_s: int | None = None,
    env: dict[str, str] | None = None,
    mode: str | None = None,
    tmpfs_mb: int | None = None,
    max_output_bytes: int = 1 << 20,
) -> SandboxResult:
    """Runs `code` as `main.py` in a fresh sandbox and returns its (size-capped) output and how it ended.

    `timeout_s` is wall time (then everything in the run is killed); `cpu_s` (per process) defaults to
    ceil(timeout_s) + 1; `memory_mb` caps the run's total memory (cgroup, tmpfs included) and each
    process's address space; `max_file_mb` caps every file written, stdout and stderr included;
    `max_procs` caps the run's processes; `env` adds variables to the clean environment; `mode` is
    "namespace" or "audit" (default: `configure`'s, else "namespace"); `tmpfs_mb` sizes each private
    tmpfs (namespace mode; default: `configure`'s).
    Raises SandboxUnavailable when the mode cannot run here, SandboxError when a run's set-up failed.
    """
    info = check(mode or _settings["mode"])
    return _run(
        info["mode"],
        info["python"],
        code,
        stdin=stdin,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_file_mb=max_file_mb,
        max_procs=max_procs,
        cpu_s=cpu_s,
        env=env,
        tmpfs_mb=tmpfs_mb,
        max_output_bytes=max_output_bytes,
    )


def _clean_env(workdir: str, extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        # Why: BLAS thread pools reserve address space per thread and would trip RLIMIT_AS.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


SYSTEM_BINDS = ("/usr", "/etc/ld.so.cache", "/etc/localtime")


@functools.lru_cache(maxsize=8)
def root_binds(python: str) -> tuple[str, ...]:
    """What a namespace-mode run sees of the host, read-only, at the same paths: the system's programs and
    libraries (/usr; /bin, /lib, ... are links to it or bound too), the dynamic linker's cache, and the
    interpreter's own prefix and virtual environment when they live elsewhere. Nothing else: no home, no
    run directory, no data set, no path socket."""
    real = os.path.realpath(python)
    paths = list(SYSTEM_BINDS) + [os.path.dirname(os.path.dirname(real))]
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        paths.append(venv)
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.isdir(top) and not os.path.islink(top):  # a distribution without merged /usr
            paths.append(top)
    kept = [p for p in dict.fromkeys(paths) if os.path.exists(p)]
    return tuple(p for p in kept if not any(p != q and p.startswith(q + "/") for q in kept))


def _prepare_dir(root: str, mode: str, uid: int | None, code: str, stdin: str) -> str:
    """Files of one run under `root`; returns the workdir the code sees. In namespace mode the code is
    copied into the private /tmp by the boot, and the sandbox never needs to see `root` at all."""
    pathlib.Path(root, "main.py").write_text(code)
    pathlib.Path(root, "stdin").write_text(stdin)
    shutil.copyfile(_BOOT, os.path.join(root, "boot.py"))
    if mode == "namespace":
        return "/tmp"
    os.chmod(root, 0o711)  # audit: the sandbox uid may traverse to its workdir, not list or read our files
    os.chmod(os.path.join(root, "boot.py"), 0o644)
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    os.replace(os.path.join(root, "main.py"), os.path.join(work, "main.py"))
    if uid is not None:
        for path in (work, os.path.join(work, "main.py")):
            os.chown(path, uid, uid)
    return work


@contextmanager
def _run_cgroups(mode: str, memory_mb: int, max_procs: int) -> Iterator[list[pathlib.Path]]:
    layout = _layout()
    if layout is None:
        if mode == "namespace":
            raise SandboxUnavailable("sandbox mode 'namespace' lost its cgroups")
        yield []
        return
    # +2: the boot's outer process and the namespace's init are counted too.
    cpu_millis = int(_settings["cpus"] * 1000)
    dirs = _cgroups.create(
        layout, memory=int(memory_mb) << 20, pids=int(max_procs) + 2, cpu_millis=cpu_millis
    )
    try:
        yield dirs
    finally:
        _cgroups.remove(dirs)


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _launch_prefix(mode: str) -> list[str]:
    # Audit mode's boot does not load ctypes (the user process would inherit it), so setpriv sets the
    # parent-death signal there; namespace mode sets it itself.
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "SIGKILL", "--"] if mode == "audit" and setpriv else []


def _run(mode: str, python: str, code: str, *, stdin: str, timeout_s: float, memory_mb: int,
         max_file_mb: int, max_procs: int, cpu_s: int | None = None, env: dict[str, str] | None = None,
         tmpfs_mb: int | None = None, max_output_bytes: int = 1 << 20) -> SandboxResult:  # fmt: skip
    start = time.monotonic()
    slot = _slots.hold_slot() if os.geteuid() == 0 else nullcontext(None)
    with (
        slot as uid,
        tempfile.TemporaryDirectory(prefix="rljax-sandbox-", ignore_cleanup_errors=True) as root,
    ):
        work = _prepare_dir(root, mode, uid, code, stdin)
        with _run_cgroups(mode, memory_mb, max_procs) as cgroups:
            status_fd = os.open(os.path.join(root, "status"), os.O_CREAT | os.O_RDWR | os.O_APPEND, 0o600)
            cfg = {
                "fsize": int(max_file_mb) << 20,
                "nproc": int(max_procs),
                "as": int(memory_mb) << 20,
                "cpu_s": int(cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1),
                "mode": mode,
                "status_fd": status_fd,
                "uid": "" if uid is None else uid,
                "caller": os.getpid(),
                "code_path": os.path.join(root, "main.py"),
                "workdir": work,
                "tmpfs_bytes": int(tmpfs_mb or _settings["tmpfs_mb"]) << 20,
            }
            args = [f"{k}={v}" for k, v in cfg.items()] + [f"cgroup={d}" for d in cgroups]
            args += [f"bind={path}" for path in root_binds(python)] if mode == "namespace" else []
            argv = [*_launch_prefix(mode), python, "-I", os.path.join(root, "boot.py"), *args]
            timed_out = _launch_and_wait(argv, root, work, env, status_fd, timeout_s, cgroups)
            status = os.pread(status_fd, 4096, 0).decode(errors="replace")
            os.close(status_fd)
            memory_killed = _cgroups.memory_killed(cgroups)
        stdout = _read_capped(os.path.join(root, "stdout"), max_output_bytes)
        stderr = _read_capped(os.path.join(root, "stderr"), max_output_bytes)
    returncode = _decode_status(status, timed_out, stderr)
    reason = _killed_reason(returncode, timed_out, stderr, memory_killed)
    wall_s = time.monotonic() - start
    return SandboxResult(stdout, stderr, returncode, timed_out, reason, wall_s, -1 if uid is None else uid)


def _launch_and_wait(argv, root, work, env, status_fd, timeout_s, cgroups) -> bool:
    """Starts the boot, waits up to `timeout_s`, then kills everything of the run; returns timed_out."""
    paths = {name: os.path.join(root, name) for name in ("stdin", "stdout", "stderr")}
    with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout:
        with open(paths["stderr"], "wb") as ferr:
            proc = subprocess.Popen(
                argv, stdin=fin, stdout=fout, stderr=ferr, cwd=root, env=_clean_env(work, env),
                start_new_session=True, pass_fds=(status_fd,),
            )  # fmt: skip
            timed_out = not _wait_exit(proc, timeout_s)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # audit mode without cgroups: the process group
            except (ProcessLookupError, PermissionError):
                pass
            _cgroups.kill_all(cgroups)  # stragglers of a normal exit, setsid'd children, a fork bomb
            proc.wait()
    return timed_out


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `proc` exited within `timeout_s` (a pidfd wakes us at once; Popen.wait(timeout) polls with
    sleeps of up to 50 ms, which was most of a short run's overhead)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
        os.close(pidfd)


def _decode_status(status: str, timed_out: bool, stderr: str) -> int:
    lines = status.splitlines()
    boot_errors = [line[5:] for line in lines if line.startswith("boot ")]
    if boot_errors:
        raise SandboxError(f"sandbox set-up failed: {boot_errors[0]}")
    if not lines:
        if timed_out:
            return -signal.SIGKILL
        raise SandboxError(f"sandbox ended without a status (stderr: {stderr[-500:]!r})")
    kind, _, value = lines[-1].partition(" ")
    return int(value) if kind == "exit" else -int(value)


def _killed_reason(returncode: int, timed_out: bool, stderr: str, memory_killed: bool) -> str | None:
    if timed_out:
        return "timeout"
    if returncode == -signal.SIGXCPU:
        return "cpu"
    if returncode == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        return "file_size"
    if memory_killed or "MemoryError" in stderr:
        return "memory"
    if returncode < 0:
        return f"signal:{signal.Signals(-returncode).name}"
    return None
