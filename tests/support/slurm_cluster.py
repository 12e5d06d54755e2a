"""A real single-node Slurm cluster on localhost for launch tests (Debian's slurmctld/slurmd 22.05).

`SlurmCluster(root)` writes slurm.conf under `root`, starts `slurmctld -D` and `slurmd -D -N localhost`
(kept by PID, stopped by PID), and waits until the node is idle. Client commands (`sbatch`, `squeue`,
`scontrol`, `scancel`) find the cluster through `SLURM_CONF`, which `env()` sets. The recipe is the one in
shared/notes/PLATFORM.md: no systemd, no munge (auth/none), no accounting.

`slurm_cluster` (conftest loads this module as a plugin) is the one cluster of a test run: started by the
first test that asks for it, stopped by PID after the last one (`shared.Shared`), also on failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
from shared import Shared

CONF_TEMPLATE = """\
ClusterName=rljaxtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
# A requeued job may start again only after the credential lifetime (default 120 s); keep tests short.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MinJobAge=300
KillWait=10
InactiveLimit=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def slurm_installed() -> bool:
    """True when the daemons and client commands the cluster needs are on PATH (or in /usr/sbin)."""
    return all(_which(cmd) for cmd in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel"))


def _which(cmd: str) -> str | None:
    return shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/usr/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Start with `start()` (or as a context manager), stop with `stop()`; always tears down by PID."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.conf = os.path.join(self.root, "slurm.conf")
        self._procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for client commands (and jobs, which inherit it from sbatch)."""
        env = dict(os.environ, SLURM_CONF=self.conf)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin"
        env.update(extra)
        return env

    def write_conf(self) -> None:
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        text = CONF_TEMPLATE.format(root=self.root, ctld_port=_free_port(), slurmd_port=_free_port())
        with open(self.conf, "w") as f:
            f.write(text)

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        self.write_conf()
        env = self.env()
        for args in ([_which("slurmctld"), "-D"], [_which("slurmd"), "-D", "-N", "localhost"]):
            log = open(os.path.join(self.root, os.path.basename(args[0]) + ".stdout"), "w")
            self._procs.append(
                subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
            log.close()
        try:
            self.wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; see {self.root}")
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env(), capture_output=True, text=True)
            state = out.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise TimeoutError(f"slurm node not idle after {timeout_s}s (state {state!r}); see {self.root}")

    def stop(self) -> None:
        """Cancels every job, then stops slurmd and slurmctld by PID (TERM, then KILL)."""
        if self._procs and all(p.poll() is None for p in self._procs):
            subprocess.run(
                ["scancel", "--full", "-u", "root"], env=self.env(), capture_output=True, timeout=20
            )
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self._procs.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------ jobs
    def run(self, *args: str, check: bool = True, **env: str) -> str:
        """Runs a Slurm client command against this cluster; returns stdout."""
        proc = subprocess.run(list(args), env=self.env(**env), capture_output=True, text=True, timeout=60)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def job_field(self, job_id: str, name: str) -> str:
        """One `scontrol show job` field (e.g. JobState, ExitCode, Restarts); '' once the job is gone."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        for token in out.split():
            key, _, value = token.partition("=")
            if key == name:
                return value
        return ""

    def wait_job(self, job_id: str, timeout_s: float, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")):
        """Polls until the job state is one of `until`; returns the state (TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in until:
                return state
            time.sleep(1.0)
        raise TimeoutError(f"job {job_id} still {state!r} after {timeout_s}s")


_CLUSTER = Shared("slurm_cluster", SlurmCluster.stop)


@pytest.fixture
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    """The test run's single-node Slurm cluster (~5-10 s to start; the tests that use it run one after another
    on one worker, `parallel.py`, and share it)."""
    return _CLUSTER.get(lambda: SlurmCluster(str(tmp_path_factory.mktemp("slurm"))).start())
