"""Bad input through the real CLI: exit 2, exactly one stderr line naming the field or file, no traceback,
and no vLLM server started (every case fails before preflight, the server and the reward workers).

Most cases run `rljax.main.run(argv)` in this process (the same code path as `python -m rljax.main`;
its flags start from their defaults on every call) with `SystemExit` and stderr captured, and with the
vLLM server's start replaced by a spy; a handful run as real `python -m rljax.main` subprocesses.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from jax_env import child_env

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = f"--config={REPO}/configs/grpo.py"
MODEL = REPO / "assets" / "tiny_arith"


# ---------------------------------------------------------------------------------------- bad inputs
def truncated_safetensors(d: pathlib.Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def edit_config_json(**changes):
    def edit(d: pathlib.Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def remove(*names):
    def edit(d: pathlib.Path) -> None:
        for name in names:
            (d / name).unlink()

    return edit


def edit_tensor(change):
    """Rewrites model.safetensors with `change(name, array) -> array` applied to every tensor."""

    def edit(d: pathlib.Path) -> None:
        from safetensors.numpy import load_file, save_file

        f = d / "model.safetensors"
        tensors = {name: change(name, x) for name, x in load_file(str(f)).items()}
        save_file(tensors, str(f), metadata={"format": "pt"})

    return edit


def nan_in(target: str):
    def change(name, x):
        return x if name != target else np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x)

    return change


MODEL_CASES = {  # name -> (edit of a copy of the tiny model dir, fragments of the error line)
    "tensor_of_integers": (
        edit_tensor(lambda n, x: x.astype(np.int32) if n == "model.norm.weight" else x),
        ["model.path", "model.norm.weight", "I32", "floating-point"],
    ),
    "tensor_with_a_nan": (
        edit_tensor(nan_in("model.layers.0.mlp.up_proj.weight")),
        ["model.path", "non-finite", "up_proj"],
    ),
    "truncated_safetensors": (truncated_safetensors, ["model.path", "model.safetensors", "not a readable"]),
    "config_json_not_json": (
        lambda d: (d / "config.json").write_text("{not json"),
        ["model.path", "config.json", "JSONDecodeError"],
    ),
    "config_json_zero_heads": (edit_config_json(num_attention_heads=0), ["model.path", "config.json"]),
    "config_json_string_size": (edit_config_json(hidden_size="big"), ["model.path", "config.json"]),
    "config_json_wrong_vocab": (
        edit_config_json(vocab_size=1024),
        ["model.path", "embed_tokens", "expected", "(1024, 128)"],
    ),
    "no_safetensors": (remove("model.safetensors"), ["model.path", "no *.safetensors files"]),
    "no_tokenizer": (
        remove("tokenizer.json", "tokenizer_config.json"),
        ["model.path", "tokenizer has 1 tokens"],
    ),
}


def write_file(name: str, text: str):
    def make(tmp: pathlib.Path) -> str:
        (tmp / name).write_text(text)
        return str(tmp / name)

    return make


ARG_CASES = {  # name -> (overrides, with {tmp} and {file} filled in, fragments of the error line)
    "learning_rate_inf": (["--config.optim.learning_rate=1e999"], ["optim.learning_rate", "finite", "inf"]),
    "max_model_len_negative": (["--config.rollout.vllm.max_model_len=-512"], ["rollout.vllm.max_model_len"]),
    "removed_field": (
        ["--config.rollout.vllm.port=8000"],
        ["rollout.vllm.port", "removed", "rollout.vllm.urls"],
    ),
    "num_workers_huge": (["--config.reward.num_workers=1000000"], ["reward.num_workers", "[1, 256]"]),
    "num_workers_float": (["--config.reward.num_workers=1e6"], ["reward.num_workers", "expected int"]),
    "reward_weight_inf": (["--config.reward.weights=(1e999,)"], ["reward.weights", "finite"]),
    "beta_negative": (["--config.algo.beta=-0.1"], ["algo.beta", ">= 0.0"]),
    "adam_b2_above_one": (["--config.optim.b2=1.5"], ["optim.b2", "[0.0, 1.0]"]),
    "gpu_memory_above_one": (
        ["--config.rollout.vllm.gpu_memory_utilization=2.0"],
        ["rollout.vllm.gpu_memory_utilization"],
    ),
    "seed_negative": (["--config.trainer.seed=-1"], ["trainer.seed"]),
    "lora_rank_negative": (["--config.model.lora_rank=-4"], ["model.lora_rank", ">= 0"]),
    "lora_alpha_zero": (
        ["--config.model.lora_rank=8", "--config.model.lora_alpha=0"],
        ["model.lora_alpha", "> 0"],
    ),
    "lora_target_bad_regex": (
        ["--config.model.lora_rank=8", "--config.model.lora_targets=('q_proj(',)"],
        ["model.lora_targets", "not a valid regex"],
    ),
    "lora_rank_above_vllms": (["--config.model.lora_rank=1024"], ["model.lora_rank", "up to 512"]),
    "lora_with_fp8_push": (
        [  # servers elsewhere (GPU): the CPU build's own fp8 refusal does not apply
            "--config.model.lora_rank=8",
            "--config.rollout.weight_sync.dtype=float8_e4m3",
            "--config.rollout.vllm.urls=('http://127.0.0.1:9',)",
        ],
        ["rollout.weight_sync.dtype", "only its adapter"],
    ),
    "lora_with_ppo": (
        [
            "--config.model.lora_rank=8",
            "--config.algo.family=ppo",
            "--config.trainer.tokens_per_micro_batch=0",
        ],
        ["model.lora_rank", "GRPO family"],
    ),
    "unknown_logprob_impl": (
        ["--config.trainer.logprob_impl=fused"],
        ["trainer.logprob_impl", "'fused'", "xla"],
    ),
    "logprob_impl_not_on_this_backend": (  # the tests run on CPU; triton runs on NVIDIA GPUs only
        ["--config.trainer.logprob_impl=triton"],
        ["trainer.logprob_impl", "does not run on cpu", "valid there: auto", "xla"],
    ),
    "tcp_host_empty_entry": (
        ["--config.rollout.weight_sync.tcp_host=10.0.0.1,,10.0.0.2"],
        ["rollout.weight_sync.tcp_host", "one address per trainer host"],
    ),
    "unknown_flag": (["--nosuch_flag=1"], ["flags:", "nosuch_flag"]),
    "config_file_syntax_error": (
        [],
        ["--config", "broken.py", "SyntaxError"],
    ),
    "unknown_data_source": (["--config.data.source=csv"], ["data.source", "'csv'", "valid:", "jsonl"]),
    "missing_data_path": (
        ["--config.data.source=jsonl", "--config.data.path={tmp}/none.jsonl"],
        ["data.path", "none.jsonl", "no file"],
    ),
    "file_source_without_path": (["--config.data.source=jsonl"], ["data.path", "needs a path"]),
    "data_file_bad_json": (
        ["--config.data.source=jsonl", "--config.data.path={file}"],
        ["data.path", "bad.jsonl:2", "invalid JSON"],
        write_file("bad.jsonl", '{"prompt": "1+1", "answer": "2"}\n{oops\n'),
    ),
    "data_file_missing_answer": (
        ["--config.data.source=jsonl", "--config.data.path={file}"],
        ["data.path", "noanswer.jsonl", "field 'answer'", "not found"],
        write_file("noanswer.jsonl", '{"prompt": "1+1"}\n' * 3),
    ),
    "unknown_source_option": (
        ["--config.data.source_options=(('digits', 3),)"],
        ["data.source_options", "digits"],
    ),
    "reward_option_of_an_unused_reward": (
        ["--config.reward.options=(('code', (('timeout_s', 1),)),)"],
        ["reward.options", "'code'", "reward.functions"],
    ),
    "reward_option_unknown_key": (
        ["--config.reward.options=(('math', (('extrct', 'hash'),)),)"],
        ["reward.options", "'math'", "extrct"],
    ),
    "template_unknown_field": (
        ["--config.data.template={{question}}"],
        ["data.template", "'question'", "prompt"],
    ),
    "conversation_prompts_without_chat_template": (
        ["--config.data.source=jsonl", "--config.data.path={file}", "--config.data.eval_size=4"],
        ["data.chat_template", "conversations", "data.chat_template=true"],
        write_file(
            "chat.jsonl",
            "".join(
                json.dumps({"prompt": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1)}) + "\n"
                for i in range(16)
            ),
        ),
    ),
    "data_file_deeply_nested": (
        ["--config.data.source=jsonl", "--config.data.path={file}"],
        ["data.path", "RecursionError"],
        write_file("deep.jsonl", '{"prompt": "1+1=", "answer": ' + "[" * 200_000 + "]" * 200_000 + "}\n"),
    ),
    "prompt_longer_than_the_context": (
        ["--config.data.source=jsonl", "--config.data.path={file}", "--config.data.eval_size=4"],
        ["rollout.vllm.max_model_len", "512", "prompt of", "tokens", "rollout.max_tokens=16"],
        write_file(
            "long.jsonl",
            "".join(
                json.dumps({"prompt": f"{i}+1 " * (300 if i == 7 else 1) + "=", "answer": str(i + 1)}) + "\n"
                for i in range(16)
            ),
        ),
    ),
    "template_not_utf8": (["--config.data.template=\udcff{{prompt}}"], ["data.template", "UTF-8"]),
    "system_prompt_not_utf8": (["--config.data.system_prompt=a\udcffb"], ["data.system_prompt", "UTF-8"]),
    "unknown_reward": (["--config.reward.functions=('maths',)"], ["reward.functions", "'maths'", "math"]),
    "reward_module_missing": (
        ["--config.reward.functions=('no_such_pkg.rewards:score',)"],
        ["reward.functions", "no_such_pkg", "cannot import"],
    ),
    "reward_not_callable": (["--config.reward.functions=('os:sep',)"], ["reward.functions", "not callable"]),
    "unknown_eval_function": (["--config.reward.eval_function=exact"], ["reward.eval_function", "'exact'"]),
    "unknown_env": (["--config.rollout.env=chess"], ["rollout.env", "'chess'", "valid:"]),
    "workdir_under_a_file": ([], ["--workdir", "not a writable directory"]),
    # Passes every input check and preflight; its checkpoint (of another state) fails before the server.
    "workdir_checkpoint_of_another_model": ([], ["checkpoint:", "step 1", "does not fit this run's state"]),
    "workdir_is_a_file": ([], ["--workdir", "not a writable directory"]),
    "workdir_checkpoints_is_a_file": ([], ["--workdir", "checkpoints", "is a file", "directory"]),
    "workdir_metrics_is_a_directory": ([], ["--workdir", "metrics.jsonl", "is a directory", "file"]),
}


def save_foreign_checkpoint(directory: pathlib.Path) -> None:
    """A real orbax step 1 whose state is not this config's TrainState."""
    import jax.numpy as jnp

    from rljax.checkpoint import Checkpointer

    ck = Checkpointer(str(directory), async_save=False)
    ck.save(1, {"w": jnp.zeros((3, 4))}, {"data": {}}, {})
    ck.close()


def build_argv(name: str, tmp: pathlib.Path) -> tuple[list[str], list[str], pathlib.Path]:
    """(argv, fragments, workdir) of one case."""
    workdir = tmp / "work"
    if name in MODEL_CASES:
        edit, fragments = MODEL_CASES[name]
        model = tmp / "model"
        shutil.copytree(MODEL, model)
        edit(model)
        return ["rljax", CONFIG, f"--workdir={workdir}", f"--config.model.path={model}"], fragments, workdir
    overrides, fragments, *make = ARG_CASES[name]
    file = make[0](tmp) if make else ""
    overrides = [o.format(tmp=tmp, file=file) for o in overrides]
    config = CONFIG
    if name == "config_file_syntax_error":
        (tmp / "broken.py").write_text("def get_config(preset=None):\n    return {\n")
        config = f"--config={tmp}/broken.py"
    if name == "workdir_under_a_file":
        (tmp / "plain").write_text("")
        workdir = tmp / "plain" / "work"
    if name == "workdir_is_a_file":
        workdir.write_text("")
    if name == "workdir_checkpoint_of_another_model":
        save_foreign_checkpoint(workdir / "checkpoints")
    if name == "workdir_checkpoints_is_a_file":
        workdir.mkdir()
        (workdir / "checkpoints").write_text("")
    if name == "workdir_metrics_is_a_directory":
        (workdir / "metrics.jsonl").mkdir(parents=True)
    return ["rljax", config, f"--workdir={workdir}", *overrides], fragments, workdir


def assert_one_line_error(code, stderr: str, fragments: list[str], workdir: pathlib.Path) -> None:
    assert code == 2, (code, stderr[-3000:])
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rljax: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    if workdir.is_dir():
        assert not (workdir / "vllm").exists()  # the owned server's log dir


ALL_CASES = sorted(MODEL_CASES) + sorted(ARG_CASES)


@pytest.fixture
def server_spy(monkeypatch):
    """Records (and refuses) any vLLM server start in this process."""
    from rljax.rollout.server import VLLMServer

    started = []

    def start(self):
        started.append(self)
        raise AssertionError("a vLLM server was started for a bad input")

    monkeypatch.setattr(VLLMServer, "start", start)
    return started


def test_at_least_twenty_cases():
    assert len(ALL_CASES) >= 20


@pytest.mark.parametrize("name", ALL_CASES)
def test_bad_input_in_process(name, tmp_path, monkeypatch, capsys, server_spy):
    from rljax import main

    monkeypatch.chdir(REPO)
    argv, fragments, workdir = build_argv(name, tmp_path)
    with pytest.raises(SystemExit) as e:
        main.run(argv)  # its own argv: sys.argv is not consulted
    assert_one_line_error(e.value.code, capsys.readouterr().err, fragments, workdir)
    assert server_spy == []


def test_unavailable_sandbox_is_a_config_error(tmp_path, monkeypatch, capsys, server_spy):
    """A code reward whose sandbox mode cannot run here (no root or no cgroups) is one line naming
    reward.sandbox before any server or reward worker starts, not a worker traceback later."""
    from rljax import main
    from rljax.rewards import sandbox

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sandbox, "_missing", lambda mode: [] if mode == "audit" else ["root (test)"])
    sandbox.check.cache_clear()
    workdir = tmp_path / "work"
    argv = ["rljax", CONFIG, f"--workdir={workdir}", "--config.reward.functions=('code',)"]
    try:
        with pytest.raises(SystemExit) as e:
            main.run(argv)
    finally:
        sandbox.check.cache_clear()  # later tests probe the real machine again
    assert_one_line_error(e.value.code, capsys.readouterr().err, ["reward.sandbox", "root (test)"], workdir)
    assert server_spy == []


def test_a_reward_module_that_exits_on_import_is_one_line(tmp_path, monkeypatch, capsys, server_spy):
    """User code run during the checks (importing a custom reward) that raises SystemExit: one line and
    exit 2, not the user's exit code with no output."""
    from rljax import main

    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(REPO)
    workdir = tmp_path / "work"
    argv = ["rljax", CONFIG, f"--workdir={workdir}", "--config.reward.functions=('exits_on_import:score',)"]
    with pytest.raises(SystemExit) as e:
        main.run(argv)
    fragments = ["reward.functions", "exits_on_import", "SystemExit"]
    assert_one_line_error(e.value.code, capsys.readouterr().err, fragments, workdir)
    assert server_spy == []


@pytest.mark.parametrize(
    "variable, value",
    [("RLJAX_CPU_DEVICES", "eight"), ("RLJAX_CPU_DEVICES", "0"), ("RLJAX_LOCAL_DEVICE_IDS", "0,x")],
)
def test_a_malformed_device_variable_is_one_line(variable, value, tmp_path):
    """Through the real CLI: the variable is read before JAX starts."""
    workdir = tmp_path / "work"
    env = child_env(JAX_PLATFORMS="cpu", **{variable: value})
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.main", CONFIG, f"--workdir={workdir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert_one_line_error(proc.returncode, proc.stderr, [variable, repr(value)], workdir)


def test_good_inputs_resolve(tmp_path, monkeypatch):
    """The checks accept the default job's inputs (the control for the table above)."""
    from rljax.config import Config
    from rljax.loop.inputs import resolve_inputs

    monkeypatch.chdir(REPO)
    train, held_out = resolve_inputs(Config(), str(tmp_path / "work"))
    assert len(held_out) == Config().data.eval_size and len(train) > 1000
    assert (tmp_path / "work").is_dir() and not list((tmp_path / "work").iterdir())


@pytest.mark.parametrize(
    "name",
    [
        "learning_rate_inf",
        "truncated_safetensors",
        "missing_data_path",
        "unknown_reward",
        "workdir_under_a_file",
    ],
)
def test_bad_input_real_cli(name, tmp_path):
    """The same through `python -m rljax.main` in a fresh process (one CPU device, as on a laptop)."""
    argv, fragments, workdir = build_argv(name, tmp_path)
    env = child_env(JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.main", *argv[1:]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert_one_line_error(proc.returncode, proc.stderr, fragments, workdir)
    assert "vllm" not in proc.stdout.lower()
