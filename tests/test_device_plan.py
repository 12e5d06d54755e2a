"""The device plan (rljax.device_plan) and `python -m rljax.launch --plan`: 1x1, 1x8 colocated, 1x8 split,
2x8 with a rollout node, and the impossible plans; every GPU server on GPUs of its own, with CUDA graphs,
and no GPU's memory shares summing over 0.95."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from rljax import config as C
from rljax import device_plan as dp
from rljax import launch
from rljax.rollout.server import ServerOptions, launch_servers, server_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_vllm(**fields) -> C.Config:
    """The default config with these `rollout.vllm` fields."""
    vllm = dataclasses.replace(C.DEFAULTS.rollout.vllm, **fields)
    return C.validate(
        dataclasses.replace(C.DEFAULTS, rollout=dataclasses.replace(C.DEFAULTS.rollout, vllm=vllm))
    )


def plan_cli(*flags: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rljax.launch",
            "--plan",
            *flags,
            "--",
            "--config=configs/grpo.py",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_sound(out: dict) -> None:
    """What every GPU plan must hold: servers on disjoint GPUs, CUDA graphs, shares within 0.95."""
    seen = set()
    for s in out["servers"]:
        own = {(s["node"], d) for d in s["devices"]}
        assert own and not own & seen, out["servers"]
        seen |= own
        assert "--enforce-eager" not in s["argv"]
        assert s["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, s["devices"]))
        assert s["argv"][s["argv"].index("--tensor-parallel-size") + 1] == str(s["tensor_parallel_size"])
    assert max(out["device_shares"].values()) <= dp.MAX_DEVICE_SHARE
    for t in out["trainers"]:
        assert t["env"]["RLJAX_LOCAL_DEVICE_IDS"] == ",".join(map(str, t["devices"]))
        assert float(t["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(
            t["memory_fraction"], abs=0.005
        )


def test_one_gpu_colocated():
    proc = plan_cli("--gpus", "1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert_sound(out)
    assert out["mode"] == "colocated"
    assert [(t["node"], t["devices"], t["memory_fraction"]) for t in out["trainers"]] == [(0, [0], 0.8)]
    assert [s["devices"] for s in out["servers"]] == [[0]]
    assert out["device_shares"] == {"0:0": 0.95} and out["idle"] == []


@pytest.mark.parametrize("process_per", ["gpu", "node"], ids=["per-device", "per-node"])  # not the gpu marker
def test_eight_gpus_colocated_two_tensor_parallel_servers(process_per):
    over = ("--config.rollout.vllm.num_servers=2", "--config.rollout.vllm.tensor_parallel_size=2")
    proc = plan_cli("--gpus", "8", "--process-per", process_per, overrides=over)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert_sound(out)
    assert [s["devices"] for s in out["servers"]] == [[0, 1], [2, 3]]
    shares = [t["memory_fraction"] for t in out["trainers"]]
    if process_per == "gpu":  # a GPU with a server leaves the trainer 0.95 - 0.15, the others 0.90
        assert [t["devices"] for t in out["trainers"]] == [[d] for d in range(8)]
        assert shares == [0.8] * 4 + [0.9] * 4
    else:  # one process drives all 8: the smallest of their shares
        assert [t["devices"] for t in out["trainers"]] == [list(range(8))] and shares == [0.8]


def test_eight_gpus_split_four_and_four():
    over = (
        "--config.rollout.vllm.server_gpus=4",
        "--config.rollout.vllm.num_servers=2",
        "--config.rollout.vllm.tensor_parallel_size=2",
        "--config.rollout.vllm.gpu_memory_utilization=0.9",
    )
    proc = plan_cli("--gpus", "8", overrides=over)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert_sound(out)
    assert out["mode"] == "split"
    assert [t["devices"] for t in out["trainers"]] == [[0], [1], [2], [3]]
    assert {t["memory_fraction"] for t in out["trainers"]} == {0.9}
    assert [s["devices"] for s in out["servers"]] == [[4, 5], [6, 7]]
    assert all(s["gpu_memory_utilization"] == 0.9 for s in out["servers"])


def test_two_nodes_of_eight_with_a_rollout_node():
    over = ("--config.rollout.vllm.tensor_parallel_size=4", "--config.rollout.vllm.data_parallel_size=2")
    proc = plan_cli("--gpus", "8", "--nodes", "2", "--rollout-nodes", "1", overrides=over)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert_sound(out)
    assert out["mode"] == "rollout_nodes"
    assert [(t["node"], t["devices"]) for t in out["trainers"]] == [(0, [d]) for d in range(8)]
    assert {t["memory_fraction"] for t in out["trainers"]} == {0.9}  # no server on the trainer's node
    assert [(s["node"], s["devices"]) for s in out["servers"]] == [(1, list(range(8)))]
    assert out["idle"] == []


def test_a_rollout_node_with_a_smaller_server_lists_its_idle_gpus():
    out = dp.make_plan(C.DEFAULTS, dp.Machine(8, nodes=2, rollout_nodes=1)).to_json()
    assert out["servers"][0]["devices"] == (0,) and out["idle"] == [f"1:{d}" for d in range(1, 8)]


def test_cpu_plan_places_nothing_and_keeps_eager_mode():
    proc = plan_cli()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mode"] == "cpu" and out["servers"] == [] and out["trainers"][0]["env"] == {}
    options = ServerOptions(cpu_build=True)
    from rljax.rollout.server import server_command

    assert "--enforce-eager" in server_command("/m", "127.0.0.1", 1, options)
    assert "--enforce-eager" not in server_command("/m", "127.0.0.1", 1, ServerOptions(cpu_build=False))


IMPOSSIBLE = [
    # (plan flags, overrides, the field the one-line error names)
    (
        ("--gpus", "8"),
        ("--config.rollout.vllm.gpu_memory_utilization=0.9",),
        "rollout.vllm.gpu_memory_utilization",
    ),
    (("--gpus", "8"), ("--config.mesh.gpu_memory_fraction=0.9",), "mesh.gpu_memory_fraction"),
    (
        ("--gpus", "8"),
        ("--config.rollout.vllm.num_servers=3", "--config.rollout.vllm.tensor_parallel_size=4"),
        "rollout.vllm.num_servers",
    ),
    (
        ("--gpus", "8"),
        ("--config.rollout.vllm.server_gpus=4", "--config.rollout.vllm.tensor_parallel_size=3"),
        "rollout.vllm.num_servers",
    ),
    (("--gpus", "8"), ("--config.rollout.vllm.server_gpus=8",), "rollout.vllm.server_gpus"),
    (("--gpus", "8", "--nodes", "2"), ("--config.rollout.vllm.server_gpus=4",), "rollout.vllm.server_gpus"),
    (
        ("--gpus", "8", "--nodes", "2", "--rollout-nodes", "1"),
        ("--config.rollout.vllm.tensor_parallel_size=3",),
        "rollout.vllm.tensor_parallel_size",
    ),
    (("--gpus", "8", "--nodes", "2", "--rollout-nodes", "2"), (), "--rollout-nodes"),
    (("--gpus", "8", "--process-per", "socket"), (), "--process-per"),
    (("--gpus", "8"), ("--config.mesh.gpu_memory_fraction=0.99",), "mesh.gpu_memory_fraction"),
]


@pytest.mark.parametrize("flags,overrides,field", IMPOSSIBLE)
def test_an_impossible_plan_is_one_line_naming_the_field(flags, overrides, field):
    proc = plan_cli(*flags, overrides=overrides)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rljax: error: config: {field}"), line


def test_gpus_are_counted_without_touching_a_device():
    assert dp.detect_gpus({dp.GPUS_ENV: "4", "CUDA_VISIBLE_DEVICES": "0"}) == 4
    assert dp.detect_gpus({"CUDA_VISIBLE_DEVICES": "2,5,7"}) == 3
    assert dp.detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert dp.visible_devices((1, 2), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "5,6"
    assert dp.visible_devices((1, 2), {}) == "1,2"


def test_owned_servers_get_their_slices_of_the_planned_gpus(monkeypatch, tmp_path):
    plan = dp.make_plan(with_vllm(num_servers=2, tensor_parallel_size=2), dp.Machine(8))
    devices = dp.owned_server_devices(plan)
    assert devices == (0, 1, 2, 3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert server_env(ServerOptions(devices=(2, 3)))["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in server_env(ServerOptions())
    spawned = []
    monkeypatch.setattr("rljax.rollout.server.VLLMServer.spawn", lambda self: spawned.append(self.options))
    monkeypatch.setattr("rljax.rollout.server.VLLMServer.wait_healthy", lambda self, timeout_s: None)
    launch_servers("/m", tmp_path, replicas=2, options=ServerOptions(devices=devices))
    assert [o.devices for o in spawned] == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="3 GPUs do not split among 2 servers"):
        launch_servers("/m", tmp_path, replicas=2, options=ServerOptions(devices=(0, 1, 2)))


def test_a_process_started_by_hand_gets_its_planned_share_before_jax_starts():
    cfg = C.DEFAULTS
    assert dp.planned_trainer_env(cfg, {dp.GPUS_ENV: "8"}) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.80"}
    assert dp.planned_trainer_env(cfg, {dp.GPUS_ENV: "0"}) == {}  # CPU
    launched = {dp.GPUS_ENV: "8", "RLJAX_PROCESS_ID": "0"}
    assert dp.planned_trainer_env(cfg, launched) == {}  # its launcher set it
    assert dp.planned_trainer_env(cfg, {dp.GPUS_ENV: "8", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) == {}


def test_main_refuses_an_impossible_plan_before_jax_starts(tmp_path):
    env = dict(os.environ, **{dp.GPUS_ENV: "8"})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljax.main",
            "--config=configs/grpo.py",
            f"--workdir={tmp_path}/run",
            "--config.rollout.vllm.gpu_memory_utilization=0.9",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("rljax: error: config: rollout.vllm.gpu_memory_utilization: 0.9 of a GPU"), line
    assert not os.path.exists(tmp_path / "run" / "vllm")


def test_local_launcher_starts_the_planned_processes(monkeypatch):
    calls = {}

    def fake_launch(args, num_processes, devices_per_process=0, entry="rljax.main", planned=None):
        calls.update(args=args, n=num_processes, planned=planned)
        return 0

    monkeypatch.setattr(launch, "launch", fake_launch)
    args = [
        "--config=configs/grpo.py",
        "--config.rollout.vllm.server_gpus=2",
        "--config.rollout.vllm.num_servers=2",
    ]
    monkeypatch.chdir(REPO)
    assert launch.main(["--gpus", "4", "--", *args]) == 0
    assert calls["n"] == 2
    assert [e["RLJAX_LOCAL_DEVICE_IDS"] for e in calls["planned"]] == ["0", "1"]
    assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in calls["planned"]} == {"0.90"}
    assert {e[dp.GPUS_ENV] for e in calls["planned"]} == {"4"}  # the leader plans its servers the same way
    assert launch.main(["--gpus", "4", "--nodes", "2", "--", "--config=configs/grpo.py"]) == 2
