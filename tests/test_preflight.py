"""Preflight: one test per impossible setup, golden parameter counts, and the command line."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from rljax import preflight
from rljax.config import Config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024**3

# config.json fields of two public checkpoints (sizes from their Hugging Face model cards).
QWEN25_05B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def write_model(path, fields: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(fields, f)
    return str(path)


def make_cfg(model_path: str, **sections) -> Config:
    """Config with per-section overrides, e.g. rollout={"batch_size": 30}; bypasses `validate` on purpose."""
    cfg = Config()
    changes = {}
    for name, fields in sections.items():
        section = getattr(cfg, name)
        nested = {
            k: dataclasses.replace(getattr(section, k), **v) for k, v in fields.items() if isinstance(v, dict)
        }
        flat = {k: v for k, v in fields.items() if not isinstance(v, dict)}
        changes[name] = dataclasses.replace(section, **flat, **nested)
    cfg = dataclasses.replace(cfg, **changes)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_path))


def failures(cfg, num_devices=8, num_processes=1, memory=80 * GIB, urls=(), compiled=False, log=None):
    """run_preflight; memory from the hand formula unless `compiled` (compiling takes seconds per setup)."""
    return preflight.run_preflight(
        cfg,
        num_devices=num_devices,
        num_processes=num_processes,
        device_memory_bytes=memory,
        rollout_urls=urls,
        compiled=compiled,
        log=log or (lambda line: None),
    )


@pytest.fixture
def qwen(tmp_path):
    return write_model(tmp_path / "qwen", QWEN25_05B)


def only(lines: list[str], *fragments: str) -> None:
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_golden_parameter_counts(tmp_path):
    # Published totals: Qwen2.5-0.5B 494,032,768 (tied, qkv bias); Llama-3-8B 8,030,261,248 (untied).
    assert preflight.read_model_shape(write_model(tmp_path / "q", QWEN25_05B)).num_params == 494_032_768
    assert preflight.read_model_shape(write_model(tmp_path / "l", LLAMA3_8B)).num_params == 8_030_261_248


def test_feasible_setup_passes(qwen):
    assert failures(make_cfg(qwen)) == []


def test_feasible_setup_passes_on_compiled_numbers(qwen):
    logged = []
    assert failures(make_cfg(qwen), compiled=True, log=logged.append) == []  # Qwen2.5-0.5B, 64 x 512
    (line,) = logged
    assert line.startswith("memory per device, GiB, at its peak") and "compiled for 64 rows x 512" in line
    assert "budget 80.00 GiB (the device's own)" in line


def test_mesh_does_not_match_devices(qwen):
    only(failures(make_cfg(qwen, mesh={"fsdp": 3})), "mesh", "but there are 8 devices")


def test_devices_not_spread_evenly_over_processes(qwen):
    cfg = make_cfg(qwen, rollout={"batch_size": 48})  # 48 splits over 12 devices: only the spread is wrong
    only(failures(cfg, num_devices=12, num_processes=8), "spread evenly", "8 processes")


def test_global_batch_not_divisible_by_group_size(qwen):
    cfg = make_cfg(qwen, rollout={"batch_size": 36, "group_size": 8})  # 36 does split over 4 devices
    only(failures(cfg, num_devices=4), "rollout.batch_size", "group_size=8")


def test_grpo_group_of_one(qwen):
    only(failures(make_cfg(qwen, rollout={"group_size": 1})), "rollout.group_size", "at least 2")


def test_minibatches_do_not_divide_batch(qwen):
    only(failures(make_cfg(qwen, trainer={"minibatches": 3})), "trainer.minibatches", "batch_size=64")


def test_micro_batch_does_not_divide_minibatch(qwen):
    only(failures(make_cfg(qwen, trainer={"micro_batch_size": 24})), "micro_batch_size", "minibatch of 64")


def test_micro_batch_does_not_split_over_devices(qwen):
    lines = failures(make_cfg(qwen, trainer={"micro_batch_size": 4}))
    only(lines, "micro_batch_size", "data*fsdp = 8", "0.5 per device")


def test_missing_config_json(tmp_path):
    only(failures(make_cfg(str(tmp_path / "nowhere"))), "model.path", "no config.json")


def test_trainer_memory_exceeds_device_by_the_formula(tmp_path):
    llama = write_model(tmp_path / "llama", LLAMA3_8B)
    vllm = {"urls": ("http://x",), "gpu_memory_utilization": 0.5}  # separate servers, ample budget
    cfg = make_cfg(llama, mesh={"fsdp": 1, "data": 8}, rollout={"vllm": vllm})
    lines = failures(cfg, urls=())  # 8,030,261,248 float32 params unsharded = 29.92 GiB
    only(lines, "memory:", "per device", "hand formula", "params 29.92", "a device has 80.00 GiB")


def test_budget_from_mesh_device_memory_gib(qwen):
    vllm = {"urls": ("http://x",)}
    lines = failures(make_cfg(qwen, mesh={"device_memory_gib": 1.0}, rollout={"vllm": vllm}))
    assert len(lines) == 2, lines  # the budget is the device's size for the trainer and vLLM alike
    assert lines[0].startswith("memory:") and "a device has 1.00 GiB (mesh.device_memory_gib)" in lines[0]
    assert "gpu_memory_utilization: 0.15 of 1.00 GiB" in lines[1]


def test_fallback_to_the_formula_says_why(qwen):
    logged = []
    cfg = make_cfg(qwen, rollout={"batch_size": 48})
    assert failures(cfg, num_devices=12, compiled=True, log=logged.append) == []  # this process has 8
    assert logged == [
        "memory: hand-formula estimate, not compiled (this process sees 8 devices, the check is for 12)"
    ]


def test_trainer_plus_colocated_vllm_exceeds_device(tmp_path):
    llama = write_model(tmp_path / "llama", LLAMA3_8B)
    fits_alone = make_cfg(llama, rollout={"vllm": {"urls": ("http://x",), "gpu_memory_utilization": 0.3}})
    assert failures(fits_alone, urls=()) == []
    colocated = make_cfg(llama, rollout={"vllm": {"gpu_memory_utilization": 0.9}})
    only(failures(colocated), "memory:", "vLLM's 72.00 GiB")


def test_rollout_budget_too_small_for_weights(tmp_path):
    llama = write_model(tmp_path / "llama", LLAMA3_8B)  # 16 GB of bf16 weights
    only(
        failures(make_cfg(llama, rollout={"vllm": {"gpu_memory_utilization": 0.1}})),
        "gpu_memory_utilization",
        "8.00 GiB",
        "vLLM needs",
    )


# A small decoder whose compiled step takes seconds; sizes chosen so that no part dominates.
SMALL = {
    "model_type": "qwen2",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("remat, beta", [("full", 0.1), ("none", 0.0)])
def test_formula_against_compiled_numbers(tmp_path, remat, beta):
    """The fallback formula within 2x of the compiled peak, both ways (measured: 1.09x and 0.74x).

    Data parallel (params replicated) with materialized attention: the layout and attention the formula
    describes. Its parameter + optimizer parts must match the step's compiled arguments to 5%.
    """
    model = write_model(tmp_path / "small", SMALL)
    cfg = make_cfg(
        model,
        mesh={"data": 8, "fsdp": 1},
        model={"remat": remat, "attention_impl": "materialized"},
        algo={"beta": beta},
        rollout={"batch_size": 64, "vllm": {"max_model_len": 256}},
    )
    report, why = preflight.compiled_memory(cfg, num_devices=8)
    assert report is not None, why
    parts = preflight.estimate_train_memory(cfg, preflight.read_model_shape(model), num_devices=8)
    compiled = max(m.total_bytes for m in report.values())
    assert 0.5 < preflight.estimated_peak(parts) / compiled < 2.0, (parts, report)
    state_bytes = parts["params"] + parts["optimizer"]
    step = report["train_step"]
    assert step.alias_bytes == pytest.approx(state_bytes, rel=0.05)
    assert step.resident_bytes == pytest.approx(parts["reference"], rel=0.05)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    servers = []

    def start(status: int) -> str:
        handler = type("H", (_Health,), {"status": status})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for s in servers:
        s.shutdown()


def test_rollout_urls_reachability(qwen, health_server):
    up, sick, down = health_server(200), health_server(503), f"http://127.0.0.1:{_closed_port()}"
    lines = failures(make_cfg(qwen, rollout={"vllm": {"urls": (up,)}}), urls=(up, sick, down))
    assert len(lines) == 2, lines
    assert f"{sick} answered HTTP 503" in lines[0]
    assert f"{down} is not reachable" in lines[1]


def test_cli_reports_failures_one_line_each(qwen):
    env = dict(os.environ, JAX_PLATFORMS="cpu", RLJAX_CPU_DEVICES="2")
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljax.preflight",
            "--config=configs/grpo.py:smoke",
            f"--config.model.path={qwen}",
            "--config.mesh.fsdp=1",
            "--config.mesh.data=4",
            f"--config.rollout.vllm.urls=('{url}',)",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    fails = [line for line in proc.stdout.splitlines() if line.startswith("preflight: FAIL")]
    assert len(fails) == 2, proc.stdout
    assert "but there are 2 devices" in fails[0] and f"{url} is not reachable" in fails[1]
    assert "Traceback" not in proc.stderr


def test_cli_fails_on_the_memory_budget_with_compiled_numbers(qwen):
    env = dict(os.environ, JAX_PLATFORMS="cpu", RLJAX_CPU_DEVICES="2")
    args = [
        f"--config.model.path={qwen}",
        "--config.mesh.device_memory_gib=2",  # vLLM's 0.9 of it holds the weights, the trainer does not fit
        "--config.rollout.vllm.gpu_memory_utilization=0.9",
        "--config.rollout.batch_size=16",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.preflight", "--config=configs/grpo.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    report = [line for line in proc.stdout.splitlines() if line.startswith("preflight: memory per device")]
    fails = [line for line in proc.stdout.splitlines() if line.startswith("preflight: FAIL")]
    assert len(report) == 1 and "compiled for 16 rows x 512 tokens" in report[0], proc.stdout
    assert len(fails) == 1 and "FAIL memory:" in fails[0] and "(mesh.device_memory_gib)" in fails[0], fails


def test_the_hand_formula_reads_each_remat_policy_from_its_registration():
    from rljax.memory_formula import keeps_activations
    from rljax.models.remat import REMAT_POLICIES

    kept = {name: keeps_activations(name) for name in REMAT_POLICIES.names()}
    assert kept == {
        "none": True,  # every layer's activations
        "full": False,  # each layer's input, one layer recomputed at a time
        "dots_saveable": False,
        "dots_with_no_batch_dims_saveable": False,
    }


SMOLLM2 = "smollm2-135m-instruct"


def planted_conversion(cache) -> str:
    """A finished conversion of smollm2-135m-instruct in `cache`, as `rljax.models.fetch` leaves it (its
    marker), holding only a config.json: what the checks read."""
    from rljax.models import fetch

    done = write_model(cache / SMOLLM2, QWEN25_05B)
    check = dataclasses.asdict(fetch.ParityCheck(1e-5))
    marker = {"sha256": fetch.FETCHABLE.get(SMOLLM2).sha256, "check": check}
    (cache / SMOLLM2 / fetch.MARKER).write_text(json.dumps(marker))
    return done


def test_cli_reads_a_fetchable_model_name_from_its_cached_conversion(tmp_path):
    """`model.path=smollm2-135m-instruct` (a name `rljax.models.fetch` converts) is checked on the cached
    conversion, as `rljax.main` runs it; unresolved, the name has no config.json."""
    planted_conversion(tmp_path)
    env = dict(os.environ, JAX_PLATFORMS="cpu", RLJAX_CACHE=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljax.preflight",
            "--config=configs/grpo.py",
            f"--config.model.path={SMOLLM2}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "config.json" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    report = [line for line in proc.stdout.splitlines() if line.startswith("preflight: memory per device")]
    assert len(report) == 1, proc.stdout + proc.stderr
    assert not (tmp_path / "wheels").exists()  # found in the cache, nothing downloaded


def test_serve_serves_a_fetchable_model_name_from_its_cached_conversion(tmp_path, monkeypatch):
    from rljax.rollout import serve

    monkeypatch.setenv("RLJAX_CACHE", str(tmp_path))
    done = planted_conversion(tmp_path)
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    opts = serve.argparse.Namespace(host="127.0.0.1", port=8000, token_file=str(token), model="", vllm_arg=[])
    argv, _ = serve.build(opts, ["--config=configs/grpo.py", f"--config.model.path={SMOLLM2}"])
    assert done in argv and SMOLLM2 not in argv, argv
