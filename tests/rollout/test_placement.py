"""Host placement of the trainer and the vLLM server, and the canary's trainer side started early."""

import os
import subprocess
import sys
import textwrap

import pytest

from rljax import config as C
from rljax.rollout import placement
from rljax.rollout.server import ServerOptions, server_env
from rljax.weight_sync import idle_spin


def test_auto_leaves_the_trainer_all_cores_in_sync_mode_and_splits_them_in_async_mode():
    cpus = (0, 1, 2, 3)
    sync = placement.plan_placement(cpus, "auto", overlap=False, server_on_host=True)
    assert sync == placement.Placement(server_cpus=(0, 1, 2), trainer_cpus=())
    split = placement.plan_placement(cpus, "auto", overlap=True, server_on_host=True)
    assert split == placement.Placement(server_cpus=(0, 1), trainer_cpus=(2, 3))
    assert placement.plan_placement((0, 1), "split", overlap=False, server_on_host=True).trainer_cpus == (1,)
    # two cores: one each was slower than sharing both (async), so auto places like sync mode
    assert placement.plan_placement((0, 1), "auto", overlap=True, server_on_host=True) == placement.Placement(
        (0,)
    )
    # nothing to place: a remote server, one core, or placement off
    for cpus_, mode, on_host in [((0, 1), "auto", False), ((0,), "auto", True), ((0, 1), "none", True)]:
        assert (
            placement.plan_placement(cpus_, mode, overlap=True, server_on_host=on_host)
            == placement.Placement()
        )
    with pytest.raises(ValueError, match="auto, none, split"):
        placement.plan_placement(cpus, "both", overlap=True, server_on_host=True)


def test_server_env_carries_the_cores_and_the_idle_spin():
    env = server_env(ServerOptions(cpus=(0, 2), idle_spin_s=0.0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,2" and env["OMP_NUM_THREADS"] == "2"
    assert float(env[idle_spin.IDLE_SPIN_ENV]) == 0.0
    unbound = server_env(ServerOptions())
    assert unbound.get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


def test_config_fields_are_checked():
    with pytest.raises(C.ConfigError, match="rollout.vllm.placement"):
        C.from_config_dict({"rollout": {"vllm": {"placement": "everywhere"}}})
    cfg = C.Config()
    bad = cfg.__class__(rollout=cfg.rollout.__class__(vllm=cfg.rollout.vllm.__class__(idle_spin_s=-1.0)))
    with pytest.raises(C.ConfigError, match="rollout.vllm.idle_spin_s"):
        C.validate(bad)


def test_pin_process_moves_every_thread():
    code = textwrap.dedent(
        """
        import os, threading, time
        from rljax.rollout import placement
        stop = threading.Event()
        t = threading.Thread(target=stop.wait); t.start()   # a thread that exists before the pin
        moved = placement.pin_process((0,))
        masks = {os.sched_getaffinity(int(tid)) == {0} for tid in os.listdir('/proc/self/task')}
        stop.set(); t.join()
        print(moved, masks)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    moved, masks = out.stdout.split(maxsplit=1)
    assert int(moved) >= 2 and masks.strip() == "{True}"


def test_quiet_idle_spin_lowers_vllms_busy_loop():
    code = textwrap.dedent(
        """
        from rljax.weight_sync.worker import plugin as vllm_plugin
        from vllm.distributed.device_communicators import shm_broadcast
        sb = shm_broadcast
        before = sb.SpinCondition.__init__.__defaults__[0], sb.SHM_READER_RECHECK_INTERVAL_MS
        vllm_plugin.quiet_idle_spin()
        after = sb.SpinCondition.__init__.__defaults__[0], sb.SHM_READER_RECHECK_INTERVAL_MS
        print(*before, *after)
        """
    )
    env = dict(os.environ, **{idle_spin.IDLE_SPIN_ENV: "0.002"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert [float(x) for x in out.stdout.split()] == [1.0, 5000, 0.002, idle_spin.IDLE_RECHECK_MS]


def test_engine_close_gives_the_cores_back():
    code = textwrap.dedent(
        """
        import os
        from types import SimpleNamespace
        from rljax.rollout import RolloutEngine, placement
        everything = placement.allowed_cpus()
        from rljax.weight_sync.gate import PolicyGate
        part = SimpleNamespace(close=lambda: None, gate=PolicyGate())  # a client and syncer: nothing to close
        engine = RolloutEngine(part, part)
        engine.unpin_cpus = everything
        placement.pin_process(everything[-1:])   # what make_engine does in async mode
        pinned = placement.allowed_cpus()
        engine.close()
        print(pinned == everything[-1:], placement.allowed_cpus() == everything)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
