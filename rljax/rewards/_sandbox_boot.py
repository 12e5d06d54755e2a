"""Sandbox boot (stdlib only; the caller runs `python -I boot.py KEY=VALUE...` as root or as itself).

Three processes, so that nothing the solution runs can reach the trusted ones:
- outer (host PID namespace, caller's uid): joins the run's cgroups before anything forks, so every
  descendant is counted and killed with them; in `namespace` mode it dies with its caller (parent-death
  signal), unshares mount, PID, network, IPC and UTS namespaces and forks
- init (PID 1 of the new PID namespace, still privileged): makes every mount private and read-only, then
  pivots into a private root: a tmpfs holding only the `bind=` paths (the interpreter, its libraries and
  packages, read-only), the host's top-level links, /dev/{null,zero,full,random,urandom}, and empty mount
  points; the host's tree is detached. It mounts a fresh /proc (only this sandbox's processes) and
  size-capped tmpfs on /tmp, /var/tmp and /dev/shm (gone with the namespace), copies main.py there and forks
- user: drops to the slot's uid/gid (no supplementary groups), becomes non-dumpable (no ptrace, no
  /proc/<pid>/mem for anyone of its uid) with no_new_privs, installs a seccomp filter (no kernel keyrings,
  no new user namespaces, no unshare/setns), sets rlimits, installs the audit hook in `audit` mode, and
  runs main.py.
The waiting process writes "exit N" / "signal N" to the status fd; a failed set-up step writes
"boot <error>" instead, which the caller reports as a sandbox error, never as the solution's result. In
`audit` mode there are no namespaces: outer forks user directly in the caller's working dir.
"""

import os
import resource
import sys


def _parse_args(args):
    """KEY=VALUE arguments (no json: importing it costs ~10 ms per run); `cgroup` may repeat."""
    cfg = {"cgroups": [], "binds": []}
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "cgroup":
            cfg["cgroups"].append(value)
        elif key == "bind":
            cfg["binds"].append(value)
        elif key in ("mode", "code_path", "workdir"):
            cfg[key] = value
        else:
            cfg[key] = int(value) if value else None
    return cfg


CFG = _parse_args(sys.argv[1:])
AF_UNIX = 1  # Linux; avoids importing socket before the hook is installed
BLOCKED_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"}
BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "cffi", "_cffi_backend"}
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 38, 22
MNT_DETACH, CLONE_NEWUSER = 2, 0x10000000
# Syscall numbers the private root and the filter need: (pivot_root, add_key, request_key, keyctl, unshare,
# clone, clone3, setns) per architecture, with the seccomp audit arch.
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(pivot_root=155, add_key=248, request_key=249, keyctl=250, unshare=272,
                                clone=56, clone3=435, setns=308)),
    "aarch64": (0xC00000B7, dict(pivot_root=41, add_key=217, request_key=218, keyctl=219, unshare=97,
                                 clone=220, clone3=435, setns=268)),
}  # fmt: skip
DEVICES = ("null", "zero", "full", "random", "urandom")
_MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")
_IS_USER = False


def _audit_hook(event, args):
    # Why: without namespaces, block AF_INET/AF_INET6/... sockets, exec of another program (curl, a second
    # interpreter) that the hook could not see into, and the modules that call the C library directly
    # (ctypes, _posixsubprocess), which would bypass every other check.
    if event == "socket.__new__" and len(args) > 1 and args[1] != AF_UNIX:
        raise PermissionError("network access is disabled in the sandbox")
    if event in BLOCKED_EVENTS or event.startswith("ctypes."):
        raise PermissionError(f"{event} is disabled in the sandbox")
    if event == "import" and args[0].partition(".")[0] in BLOCKED_IMPORTS:
        raise PermissionError(f"import of {args[0]} is disabled in the sandbox")


def _report(message):
    os.write(CFG["status_fd"], (message + "\n").encode())


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _set_limits():
    both = lambda res, value: resource.setrlimit(res, (value, value))
    both(resource.RLIMIT_CORE, 0)
    both(resource.RLIMIT_FSIZE, CFG["fsize"])
    both(resource.RLIMIT_NPROC, CFG["nproc"])
    both(resource.RLIMIT_AS, CFG["as"])
    # Soft limit sends SIGXCPU; the hard limit one second later is a SIGKILL for code that catches it.
    resource.setrlimit(resource.RLIMIT_CPU, (CFG["cpu_s"], CFG["cpu_s"] + 1))


def _wait_for(pid):
    """Waits for `pid`, reaping any other child on the way (as PID 1, orphans are ours); returns its
    "exit N" / "signal N"."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        if done == pid:
            code = os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            return f"{'signal' if os.WIFSIGNALED(status) else 'exit'} {code}"


def _become_user(libc):
    uid = CFG["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if libc is not None:
        _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _seccomp(libc)
    _set_limits()
    os.chdir(CFG["workdir"])


def _filter_program():
    """Classic BPF over `seccomp_data` (nr at 0, arch at 4, args[0] low word at 16): kill on a foreign
    architecture; EPERM for the kernel keyrings (add_key, request_key, keyctl: the user keyring outlives a
    run), for unshare and setns, and for clone with CLONE_NEWUSER; ENOSYS for clone3 (its flags sit behind
    a pointer the filter cannot read; the C library then falls back to clone); everything else allowed."""
    import platform

    arch, nr = _SYSCALLS[platform.machine()]
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    denied = [nr[n] for n in ("add_key", "request_key", "keyctl", "unshare", "setns")]
    jge = 0x35  # BPF_JMP|JGE|K: x32 numbers (nr | 2**30) reach the same calls under x86_64's arch value
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0), (jge, 0, 1, 1 << 30)]
    prog += [(ret, 0, 0, eperm)]
    for number in denied:
        prog += [(jeq, 0, 1, number), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, enosys)]
    prog += [(jeq, 0, 3, nr["clone"]), (ld, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm)]
    return prog + [(ret, 0, 0, allow)]


def _seccomp(libc):
    import ctypes

    class Filter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint),
        ]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    rows = _filter_program()
    filters = (Filter * len(rows))(*[Filter(*row) for row in rows])
    program = Program(len(rows), filters)
    _check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(program), 0, 0), "prctl(PR_SET_SECCOMP)")


def _run_user(libc):
    try:
        _become_user(libc)
    except BaseException as e:  # noqa: BLE001 - reported as a sandbox error
        _report(f"boot {type(e).__name__}: {e}")
        os._exit(125)
    os.close(CFG["status_fd"])
    global _IS_USER
    _IS_USER = True  # from here on, errors are the solution's: Python reports them as usual
    if CFG["mode"] == "audit":
        sys.addaudithook(_audit_hook)
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    main = type(sys)("__main__")  # runpy would import pkgutil & co: ~8 ms per run
    main.__file__ = os.path.abspath("main.py")
    sys.modules["__main__"] = main
    with open("main.py") as f:
        source = f.read()
    try:
        exec(compile(source, main.__file__, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - reported as Python would, without the boot's frames
        e = e.with_traceback(e.__traceback__.tb_next)
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)
    sys.exit(0)  # a normal interpreter exit (flushes stdout), not the boot's os._exit below


def _fork_user_and_wait(libc):
    pid = os.fork()
    if pid == 0:
        _run_user(libc)
        return
    _report(_wait_for(pid))


def _mount(libc, source, target, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _remount_read_only(libc):
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            points.append((fields[4], fields[5]))
    for point, options in points:  # read-only everything; only the private tmpfs below are writable
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= sum(_MOUNT_FLAGS.get(o, 0) for o in options.split(","))
        try:
            _mount(libc, None, point.encode().decode("unicode_escape"), None, flags, None)
        except OSError:
            pass  # a mount the kernel will not remount (e.g. a locked one) keeps its flags


def _parents(new, source):
    """Creates `source`'s parent directories under `new` with the host's modes and owners, so the private
    root lets no uid reach a path it could not reach on the host (a 0700 home stays closed)."""
    path = ""
    for part in os.path.dirname(source).strip("/").split("/") if os.path.dirname(source) != "/" else []:
        path += "/" + part
        if not os.path.isdir(new + path):
            st = os.stat(path)
            os.mkdir(new + path)
            os.chmod(new + path, st.st_mode & 0o7777)
            os.chown(new + path, st.st_uid, st.st_gid)


def _bind(libc, source, target, new):
    """`source` read-only at `target` = `new` + `source` (created as a file or directory first)."""
    _parents(new, source)
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()
    _mount(libc, source, target, None, MS_BIND | MS_REC, None)
    _mount(libc, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)


def _pivot_to_private_root(libc):
    """A new root on a tmpfs holding only `CFG["binds"]` (the interpreter, its libraries and packages, read
    only), the top-level links to them (/bin -> usr/bin, ...), a few devices and empty mount points; the
    host's tree is detached, so no host file, run directory or path socket can be named from inside."""
    import platform

    new = "/tmp"  # the host's /tmp, covered inside this mount namespace only
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for top in sorted(os.listdir("/")):
        if os.path.islink("/" + top):
            os.symlink(os.readlink("/" + top), new + "/" + top)
    for path in CFG["binds"]:
        _bind(libc, path, new + path, new)
    os.makedirs(new + "/dev")
    _mount(libc, "tmpfs", new + "/dev", "tmpfs", MS_NOSUID, "size=64k,nr_inodes=64,mode=0755")
    for device in DEVICES:
        if os.path.exists("/dev/" + device):
            _bind(libc, "/dev/" + device, f"{new}/dev/{device}", new)
    for point in ("proc", "tmp", "var/tmp", "dev/shm", "old"):
        os.makedirs(f"{new}/{point}", exist_ok=True)
    nr = _SYSCALLS[platform.machine()][1]
    _check(libc.syscall(nr["pivot_root"], new.encode(), (new + "/old").encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/old", MNT_DETACH), "umount /old")
    os.rmdir("/old")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _private_mounts(libc, code):
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    _remount_read_only(libc)
    _pivot_to_private_root(libc)
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    for target in PRIVATE_TMP:
        size = f"size={CFG['tmpfs_bytes']},nr_inodes=4096,mode=1777"
        _mount(libc, "tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, size)
    path = os.path.join(CFG["workdir"], "main.py")
    with open(path, "w") as f:
        f.write(code)
    if CFG["uid"] is not None:
        os.chown(path, CFG["uid"], CFG["uid"])


def _namespace_init(libc, code):
    _check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    _private_mounts(libc, code)
    _fork_user_and_wait(libc)


def _outer():
    for directory in CFG["cgroups"]:
        with open(os.path.join(directory, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if CFG["mode"] == "audit":
        _fork_user_and_wait(None)
        os._exit(0)
    libc = _libc()
    _check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != CFG["caller"]:
        os._exit(137)  # the caller died before the parent-death signal was set
    with open(CFG["code_path"]) as f:
        code = f.read()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(libc.unshare(flags), "unshare")
    pid = os.fork()
    if pid == 0:
        _namespace_init(libc, code)
        os._exit(0)
    _wait_for(pid)
    os._exit(0)  # no interpreter teardown for a process that only waited


try:
    _outer()
except BaseException as e:  # noqa: BLE001 - reported as a sandbox error
    if _IS_USER:
        raise
    _report(f"boot {type(e).__name__}: {e}")
    os._exit(125)
