"""`python -m rljax.export`: a run's checkpoint becomes a Hugging Face directory that transformers loads,
with the restored params bit for bit and rljax's logits; bad inputs exit 2 with one line.

The workdir is real: a tiny Qwen2 base model and real orbax checkpoints of two steps (the train state of
`trainer.init_train_state`, params sharded over two devices, each step's params moved off the base model).
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax_env import child_env

from rljax import export, models, trainer
from rljax.checkpoint import Checkpointer
from rljax.config import Config, MeshConfig, to_dict
from rljax.models.tiny import build_tiny_checkpoint
from rljax.sharding import make_mesh
from rljax.trainer.state import resolve_model_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = pathlib.Path(__file__).resolve().parents[1]
# float32 logits of two implementations of a 2-layer model agree to ~1e-6; 1e-4 is the bound.
LOGIT_TOL = 1e-4
IDS = np.random.RandomState(0).randint(0, 512, (2, 24))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, {step: host params}, policy ModelConfig) of a tiny run with checkpoints 1 and 2."""
    root = tmp_path_factory.mktemp("export")
    base = build_tiny_checkpoint(root / "model", "qwen2", tie_word_embeddings=False, seed=3)
    cfg = Config(mesh=MeshConfig(data=1, fsdp=2))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(base)))
    mesh = make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2])
    model_config, params = models.load_hf_checkpoint(base, mesh=mesh)
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    checkpointer = Checkpointer(str(root / "work" / "checkpoints"), async_save=False)
    saved = {}
    for step in (1, 2):
        leaves, treedef = jax.tree.flatten(state.params)
        keys = jax.random.split(jax.random.key(step), len(leaves))
        moved = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
        step_params = jax.tree.unflatten(treedef, moved)
        checkpointer.save(step, state.replace(params=step_params), {"data": {}}, to_dict(cfg))
        saved[step] = jax.tree.map(np.asarray, step_params)
    checkpointer.close()
    return root / "work", saved, resolve_model_config(cfg, model_config)


def hf_logits(path, ids=IDS):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def assert_trees_equal(got, want):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))


def test_export_of_the_latest_step_loads_in_transformers_with_rljax_logits(run, tmp_path):
    workdir, saved, model_config = run
    in_flight = workdir / "checkpoints" / "3.orbax-checkpoint-tmp-1"  # a save of a run still training
    in_flight.mkdir()
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "rljax.export", f"--workdir={workdir}", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"rljax.export: step 2 of {workdir} -> {out} (float32)" in proc.stdout
    assert in_flight.is_dir(), "export must leave a running run's in-flight save alone"
    in_flight.rmdir()
    assert not list(tmp_path.glob(".hf.tmp-*"))
    # the files transformers and vLLM read
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "float32"
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    tokenizer = models.load_tokenizer(out)
    assert eos == tokenizer.convert_tokens_to_ids("<|im_end|>") and tokenizer.chat_template
    assert (out / "chat_template.jinja").is_file() and (out / "tokenizer.json").is_file()
    # the tensors are the checkpoint's, bit for bit, and restore_params reads the same
    _, exported = models.load_hf_checkpoint(out)
    assert_trees_equal(exported, saved[2])
    step_dir = workdir / "checkpoints" / "2"
    assert_trees_equal(export.restore_params(step_dir, model_config), saved[2])
    # transformers on the export computes rljax's logits for the restored params
    f32 = dataclasses.replace(model_config, param_dtype="float32", compute_dtype="float32")
    ours = np.asarray(models.forward(f32, jax.tree.map(jax.numpy.asarray, saved[2]), IDS))
    diff = float(np.abs(hf_logits(out) - ours).max())
    print(f"export parity: max |logit diff| {diff:.3g}")
    assert diff <= LOGIT_TOL, diff


def test_export_of_an_earlier_step_and_in_bfloat16(run, tmp_path):
    workdir, saved, _ = run
    step, out = export.export(str(workdir), str(tmp_path / "s1"), step=1)
    assert step == 1
    assert_trees_equal(models.load_hf_checkpoint(out)[1], saved[1])
    step, out = export.export(str(workdir), str(tmp_path / "bf16"), dtype="bfloat16")
    config, params = models.load_hf_checkpoint(out)
    assert step == 2 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}


def exit_code_and_error(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        export.main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_bad_inputs_exit_2_with_one_line(run, tmp_path, capsys):
    workdir, _, _ = run
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    (tmp_path / "empty_run").mkdir()
    cases = {
        "no_workdir": (["--workdir", str(tmp_path / "nope")], "--workdir: no such directory"),
        "no_checkpoint": (["--workdir", str(tmp_path / "empty_run")], "no checkpoint in"),
        "unknown_step": (["--workdir", str(workdir), "--step", "7"], "available: 1, 2"),
        "out_taken": (
            ["--workdir", str(workdir), "--out", str(tmp_path / "taken")],
            "exists and is not empty",
        ),
        "no_base_model": (
            ["--workdir", str(workdir), "--model-path", str(tmp_path / "gone")],
            "not a Hugging Face checkpoint directory here",
        ),
    }
    for name, (argv, fragment) in cases.items():
        if "--out" not in argv:
            argv = [*argv, "--out", str(tmp_path / f"out_{name}")]
        code, err = exit_code_and_error(capsys, *argv)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("rljax: error: "), (name, err)
        assert fragment in lines[0], (name, lines[0])
        assert not (tmp_path / f"out_{name}").exists(), name


# --- a LoRA run: the checkpoint holds the adapter; export merges it or writes it as a PEFT adapter ---

LORA_RANK, LORA_ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(workdir, base dir, LoRA policy ModelConfig, host base params, host adapter) of a LoRA checkpoint at
    step 1 whose adapter is off zero (B random), saved with its base's identity as the loop saves it."""
    from rljax.checkpoint import base_identity
    from rljax.models import lora

    root = tmp_path_factory.mktemp("export_lora")
    base_dir = build_tiny_checkpoint(root / "model", "qwen2", tie_word_embeddings=False, seed=4)
    cfg = Config(mesh=MeshConfig(data=1, fsdp=2))
    model = dataclasses.replace(cfg.model, path=str(base_dir), lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA)
    cfg = dataclasses.replace(cfg, model=model)
    mesh = make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2])
    model_config, base = models.load_hf_checkpoint(base_dir)
    policy = resolve_model_config(cfg, model_config)
    adapter = lora.init_adapter(policy, jax.random.key(1))
    noise = lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape, x.dtype)  # noqa: E731
    adapter = jax.tree.map(noise, adapter)
    state = trainer.init_train_state(cfg, model_config, adapter, mesh)
    checkpointer = Checkpointer(str(root / "work" / "checkpoints"), async_save=False)
    checkpointer.save(1, state, {"data": {}}, to_dict(cfg) | {"lora_base": base_identity(str(base_dir))})
    checkpointer.close()
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    return root / "work", base_dir, policy, host(base), host(adapter)


def test_a_lora_checkpoint_exports_as_the_merged_model_with_the_lora_forwards_logits(lora_run, tmp_path):
    from rljax.models import lora

    workdir, _, policy, base, adapter = lora_run
    step, out = export.export(str(workdir), str(tmp_path / "merged"))
    assert step == 1 and not (out / "adapter_config.json").exists()
    want = np.asarray(models.forward(policy, lora.combine(base, adapter), IDS))  # base + (x A) B, unmerged
    np.testing.assert_allclose(hf_logits(out), want, atol=LOGIT_TOL, rtol=0)
    base_logits = np.asarray(models.forward(lora.base_config(policy), base, IDS))
    assert np.abs(hf_logits(out) - base_logits).max() > 1e-2  # the adapter matters


def test_a_lora_checkpoint_exports_as_a_peft_adapter_over_its_base(lora_run, tmp_path):
    from safetensors.numpy import load_file

    workdir, base_dir, policy, _, _ = lora_run
    _, merged_dir = export.export(str(workdir), str(tmp_path / "merged"))
    _, out = export.export(str(workdir), str(tmp_path / "adapter"), adapter=True)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == LORA_RANK and config["lora_alpha"] == LORA_ALPHA
    assert config["base_model_name_or_path"] == str(base_dir) and (out / "tokenizer_config.json").exists()
    tensors = load_file(str(out / "adapter_model.safetensors"))
    base = load_file(str(base_dir / "model.safetensors"))
    merged = load_file(str(merged_dir / "model.safetensors"))
    adapted = set()
    for name, a in tensors.items():  # PEFT's merge rule, W + alpha/r * B @ A, gives the merged export
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        assert a.shape[0] == LORA_RANK and b.shape[1] == LORA_RANK
        w = base[f"{module}.weight"] + (LORA_ALPHA / LORA_RANK) * (b @ a)
        np.testing.assert_allclose(merged[f"{module}.weight"], w, atol=1e-6, err_msg=module)
        adapted.add(module.rsplit(".", 1)[-1])
    assert adapted == set(config["target_modules"]) and len(tensors) == 2 * 7 * policy.num_layers
    untouched = [k for k in base if k.rsplit(".", 2)[-2] not in adapted]  # norms, embeddings, head
    assert untouched and all(np.array_equal(base[k], merged[k]) for k in untouched)


def test_lora_export_refuses_a_different_base_and_adapter_of_a_full_run(lora_run, run, tmp_path, capsys):
    workdir, _, _, _, _ = lora_run
    other = build_tiny_checkpoint(tmp_path / "other", "qwen2", tie_word_embeddings=False, seed=9)
    capsys.readouterr()  # transformers' save progress bar
    cases = {
        "other_base": ([str(workdir), "--model-path", str(other)], "is not the base model"),
        "full_run": ([str(run[0]), "--adapter"], "full fine-tuning run"),
    }
    for name, ((wd, *rest), fragment) in cases.items():
        code, err = exit_code_and_error(capsys, "--workdir", wd, *rest, "--out", str(tmp_path / name))
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and fragment in lines[0], (name, err)
        assert not (tmp_path / name).exists(), name


def test_the_exported_adapter_loads_in_peft_with_the_merged_models_logits(lora_run, tmp_path):
    """PEFT itself (`PeftModel.from_pretrained` over the base) reads the exported adapter: its logits are
    the merged export's (and rljax's unmerged LoRA forward's)."""
    import peft  # the test extra: the adapter's real reader

    workdir, base_dir, _, _, _ = lora_run
    _, merged_dir = export.export(str(workdir), str(tmp_path / "merged"))
    _, adapter_dir = export.export(str(workdir), str(tmp_path / "adapter"), adapter=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        got = model(torch.as_tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, hf_logits(merged_dir), atol=LOGIT_TOL, rtol=0)
