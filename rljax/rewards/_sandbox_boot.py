"""Boot script of the sandbox child (stdlib only; copied next to the code and run as `python -I boot.py CFG`).

It runs as the sandbox user (privileges are dropped by `setpriv` before the interpreter starts, so the
interpreter never holds root), sets the resource limits, optionally installs the audit hook that blocks
sockets and process spawning, then forks: the child runs `main.py` in the working directory; the parent
waits for it and writes "exit N" or "signal N" to the status fd. In a PID namespace the parent is PID 1, so
user code cannot signal it, and when it exits the kernel kills every process left in the namespace.
"""

import json
import os
import resource
import sys

CFG = json.loads(sys.argv[1])
AF_UNIX = 1  # Linux; avoids importing socket before the hook is installed
BLOCKED_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"}


def _audit_hook(event, args):
    # Why: without a network namespace, block AF_INET/AF_INET6/... sockets and any exec of another program
    # (curl, a second interpreter) that the hook could not see into.
    if event == "socket.__new__" and len(args) > 1 and args[1] != AF_UNIX:
        raise PermissionError("network access is disabled in the sandbox")
    if event in BLOCKED_EVENTS:
        raise PermissionError(f"{event} is disabled in the sandbox")


def _set_limits():
    both = lambda res, value: resource.setrlimit(res, (value, value))
    both(resource.RLIMIT_CORE, 0)
    both(resource.RLIMIT_FSIZE, CFG["fsize"])
    both(resource.RLIMIT_NPROC, CFG["nproc"])
    both(resource.RLIMIT_AS, CFG["as"])
    # Soft limit sends SIGXCPU; the hard limit one second later is a SIGKILL for code that catches it.
    resource.setrlimit(resource.RLIMIT_CPU, (CFG["cpu_s"], CFG["cpu_s"] + 1))


def _wait_and_report(pid, status_fd):
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        message = f"signal {os.WTERMSIG(status)}"
    else:
        message = f"exit {os.WEXITSTATUS(status)}"
    os.write(status_fd, message.encode())
    os.close(status_fd)


_set_limits()
if CFG["audit"]:
    sys.addaudithook(_audit_hook)
_pid = os.fork()
if _pid == 0:
    os.close(CFG["status_fd"])
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    import runpy

    runpy.run_path("main.py", run_name="__main__")
else:
    _wait_and_report(_pid, CFG["status_fd"])
