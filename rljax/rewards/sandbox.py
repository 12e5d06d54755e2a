"""Run untrusted Python in a subprocess with resource limits, no network and no root.

Layers, strongest available first (chosen once per process by probing that each one really works here):
- a new network namespace (`unshare --net`: only a loopback that is down, so even 127.0.0.1 is
  unreachable) and a new PID namespace (when its PID 1 exits or is killed, the kernel kills every process
  left inside, including fork-bomb children that escaped the process group with `setsid`);
- otherwise an audit hook inside the child that refuses non-Unix sockets and exec of other programs;
- privileges dropped to `nobody` with `setpriv` *before* the interpreter starts, when running as root;
- SIGKILL to the sandbox (parent-death signal) if the calling thread dies, so a killed caller leaves no
  sandbox behind;
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (also caps stdout/stderr, which go to files), RLIMIT_NPROC and
  RLIMIT_CORE=0;
- a private temporary working directory, a clean environment, and SIGKILL to the whole process group on
  timeout.
Weak spots (best effort): the child can still read world-readable files and write to world-writable
directories such as /tmp (each file capped by RLIMIT_FSIZE); the audit-hook fallback can be bypassed
by ctypes.
RLIMIT_NPROC counts every process of the sandbox user, so concurrent sandboxes share `max_procs`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_BOOT = pathlib.Path(__file__).with_name("_sandbox_boot.py")
_NETWORK_MODES = ("auto", "namespace", "audit")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run. `returncode` < 0 means killed by that signal; `killed_reason` is
    None for a normal exit, else one of "timeout", "cpu", "memory", "file_size", "signal:<NAME>"."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    killed_reason: str | None
    wall_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How to launch: command prefix (namespaces, privilege drop), interpreter, audit hook on/off."""

    prefix: tuple[str, ...]
    python: str
    audit: bool
    network: str  # "namespace" | "audit"
    user: str


def _namespace_prefix(net: bool, map_root: bool) -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    flags = (["--map-root-user"] if map_root else []) + (["--net"] if net else [])
    return [unshare, *flags, "--pid", "--fork", "--kill-child=SIGKILL", "--"]


def _drop_prefix() -> tuple[list[str], str]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return [], pwd.getpwuid(os.geteuid()).pw_name
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return [], "root"
    return [
        setpriv,
        f"--reuid={nobody.pw_uid}",
        f"--regid={nobody.pw_gid}",
        "--clear-groups",
        "--",
    ], "nobody"


# The probe checks the whole chain: it starts, runs as the expected user, can write its working dir and
# a temp file, imports stdlib modules lazily (the interpreter's stdlib must be readable by that user), and
# cannot reach 127.0.0.1 (ECONNREFUSED would mean the network is reachable).
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
print(json.dumps({"uid": os.getuid(), "net": net}))
"""


def _probe(plan: _Plan, expect_uid: int | None) -> bool:
    try:
        result = _run(plan, _PROBE, stdin="", timeout_s=20.0, memory_mb=1024, max_file_mb=1, max_procs=64)
        report = json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return False
    uid_ok = expect_uid is None or report["uid"] == expect_uid
    return result.returncode == 0 and report["net"] == "blocked" and uid_ok


@functools.cache
def _plans() -> dict[str, _Plan]:
    """The strongest working launch plan per network mode ("namespace", "audit"); probed once per process."""
    drop, user = _drop_prefix()
    me = pwd.getpwuid(os.geteuid()).pw_name
    expect_uid = pwd.getpwnam("nobody").pw_uid if user == "nobody" and drop else None
    map_root = os.geteuid() != 0  # unprivileged: a user namespace is needed to create the others
    net_ns, pid_ns = _namespace_prefix(True, map_root), _namespace_prefix(False, map_root)
    # SIGKILL to the launcher if our thread dies (e.g. a reward worker killed mid-run); with --kill-child
    # that takes the whole PID namespace down.
    setpriv = shutil.which("setpriv")
    guards = ([[setpriv, "--pdeathsig", "SIGKILL", "--"]] if setpriv else []) + [[]]
    # Changing uid clears the parent-death signal that `unshare --kill-child` set, so the dropping
    # setpriv sets it again (variant without it for an old setpriv).
    drops = [drop[:-1] + ["--pdeathsig", "SIGKILL", "--"], drop] if drop else []
    candidates = {
        "namespace": [(net_ns + d, user) for d in drops] + [(net_ns, me)] if net_ns else [],
        "audit": [(p + d, user) for d in drops for p in (pid_ns, [])] + [(pid_ns, me), ([], me)],
    }
    pythons = [sys.executable] + [p for p in ["/usr/bin/python3"] if os.path.exists(p)]
    plans: dict[str, _Plan] = {}
    for network, options in candidates.items():
        tried = set()
        for (prefix, who), guard, python in itertools.product(options, guards, pythons):
            plan = _Plan(tuple(guard + prefix), python, network == "audit", network, who)
            if plan not in tried and _probe(plan, expect_uid if who == "nobody" else None):
                plans[network] = plan
                break
            tried.add(plan)
    if "audit" not in plans:
        raise RuntimeError(
            "sandbox: no working launch plan (even a plain subprocess with the audit hook failed)"
        )
    return plans


def sandbox_info() -> dict[str, str]:
    """What `run_python(network="auto")` uses here: {"network", "user", "python", "command_prefix"}."""
    plan = _select("auto")
    return {
        "network": plan.network,
        "user": plan.user,
        "python": plan.python,
        "command_prefix": " ".join(plan.prefix),
    }


def _select(network: str) -> _Plan:
    if network not in _NETWORK_MODES:
        raise ValueError(f"unknown sandbox network mode {network!r}; valid: {', '.join(_NETWORK_MODES)}")
    plans = _plans()
    if network == "auto":
        return plans.get("namespace", plans["audit"])
    if network not in plans:
        raise RuntimeError(f"sandbox network mode {network!r} is not available here; have {sorted(plans)}")
    return plans[network]


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
    network: str = "auto",
    max_output_bytes: int = 1 << 20,
) -> SandboxResult:
    """Runs `code` as `main.py` in a fresh sandbox and returns its (size-capped) output and how it ended.

    `timeout_s` is wall time (then the process group and PID namespace are killed); `cpu_s` defaults to
    ceil(timeout_s) + 1; `memory_mb` caps the address space; `max_file_mb` caps every file written,
    stdout and stderr included; `max_procs` caps processes of the sandbox user; `env` adds variables to
    the clean environment; `network` is "auto" (namespace if it works here, else audit hook),
    "namespace" or "audit".
    """
    plan = _select(network)
    return _run(
        plan,
        code,
        stdin=stdin,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_file_mb=max_file_mb,
        max_procs=max_procs,
        cpu_s=cpu_s,
        env=env,
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


def _prepare_dir(root: str, plan: _Plan, code: str, stdin: str) -> str:
    os.chmod(root, 0o711)  # the sandbox user may traverse to its workdir, not list or read our files
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    pathlib.Path(work, "main.py").write_text(code)
    pathlib.Path(root, "stdin").write_text(stdin)
    boot = pathlib.Path(root, "boot.py")
    boot.write_text(_BOOT.read_text())
    boot.chmod(0o644)
    if plan.user == "nobody":
        nobody = pwd.getpwnam("nobody")
        for path in (work, os.path.join(work, "main.py")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
    return work


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _run(plan: _Plan, code: str, *, stdin: str, timeout_s: float, memory_mb: int, max_file_mb: int,
         max_procs: int, cpu_s: int | None = None, env: dict[str, str] | None = None,
         max_output_bytes: int = 1 << 20) -> SandboxResult:  # fmt: skip
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rljax-sandbox-", ignore_cleanup_errors=True) as root:
        work = _prepare_dir(root, plan, code, stdin)
        status_r = os.open(os.path.join(root, "status"), os.O_CREAT | os.O_RDWR, 0o600)
        cfg = {
            "fsize": int(max_file_mb) << 20,
            "nproc": int(max_procs),
            "as": int(memory_mb) << 20,
            "cpu_s": int(cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1),
            "audit": plan.audit,
            "status_fd": status_r,
        }
        argv = [*plan.prefix, plan.python, "-I", os.path.join(root, "boot.py"), json.dumps(cfg)]
        paths = {name: os.path.join(root, name) for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout:
            with open(paths["stderr"], "wb") as ferr:
                proc = subprocess.Popen(
                    argv, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=_clean_env(work, env),
                    start_new_session=True, pass_fds=(status_r,),
                )  # fmt: skip
                try:
                    proc.wait(timeout=timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out = True
                _kill_group(proc)  # also reaps stragglers of a normal exit outside a PID namespace
        status = os.pread(status_r, 64, 0).decode()
        os.close(status_r)
        stdout = _read_capped(paths["stdout"], max_output_bytes)
        stderr = _read_capped(paths["stderr"], max_output_bytes)
    returncode = _decode_status(status, proc.returncode, timed_out)
    reason = _killed_reason(returncode, timed_out, stderr)
    return SandboxResult(stdout, stderr, returncode, timed_out, reason, time.monotonic() - start)


def _decode_status(status: str, fallback: int, timed_out: bool) -> int:
    kind, _, value = status.partition(" ")
    if kind == "exit":
        return int(value)
    if kind == "signal":
        return -int(value)
    return -signal.SIGKILL if timed_out else fallback


def _killed_reason(returncode: int, timed_out: bool, stderr: str) -> str | None:
    if timed_out:
        return "timeout"
    if returncode == -signal.SIGXCPU:
        return "cpu"
    if returncode == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        return "file_size"
    if "MemoryError" in stderr:
        return "memory"
    if returncode < 0:
        return f"signal:{signal.Signals(-returncode).name}"
    return None
