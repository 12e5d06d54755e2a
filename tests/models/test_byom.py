"""Bring your own model: `examples/fused_qwen.py` (an NNX decoder outside the package, with fused q/k/v and
gate/up params and its own names) loads Qwen2 checkpoints through its HF table, equals transformers and
the built-in decoder, saves bitwise, and trains through `python -m rljax.main` with real vLLM serving the
synced weights (the loop's canary checks each sync at 1e-4)."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax_env import child_env

from rljax import models
from rljax.config import Config, ConfigError, validate
from rljax.models.params import bind_table
from rljax.models.tiny import build_tiny_checkpoint
from rljax.sharding import make_mesh

REPO = pathlib.Path(__file__).resolve().parents[2]
FUSED = "examples.fused_qwen:FusedQwen2"
TOL = 1e-5  # float32 logits vs transformers, as for the built-in decoder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fwd = jax.jit(models.forward, static_argnums=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for tied in (True, False):
        path = tmp_path_factory.mktemp(f"qwen2_{tied}")
        out[tied] = build_tiny_checkpoint(path, "qwen2", tie_word_embeddings=tied, seed=int(tied))
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fused_layout_loads_and_matches_transformers_and_builtin(ckpts, tied):
    config, params = models.load_hf_checkpoint(ckpts[tied], decoder=FUSED)
    assert type(models.build_model(config, params=params)).__name__ == "FusedQwen2"
    assert params["blocks"]["qkv"]["kernel"].shape == (2, 128, 4 + 2 * 2, 32)
    assert params["blocks"]["gate_up"]["kernel"].shape == (2, 128, 512)
    assert ("head" in params) == (not tied)
    ids = np.random.RandomState(0).randint(0, 512, (2, 24)).astype(np.int32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpts[tied], dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.as_tensor(ids)).logits.numpy()
    logits = np.asarray(fwd(config, params, ids))
    assert np.abs(logits - want).max() <= TOL and np.abs(logits).max() > 1.0
    builtin_config, builtin = models.load_hf_checkpoint(ckpts[tied])
    assert np.abs(logits - np.asarray(fwd(builtin_config, builtin, ids))).max() <= TOL
    # Same HF tensors (names, order, values) from either layout: weight sync sends what vLLM expects.
    ours = list(models.iter_hf_tensors(config, params))
    theirs = list(models.iter_hf_tensors(builtin_config, builtin))
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    for (name, a), (_, b) in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_fused_save_load_is_bitwise(ckpts, tmp_path):
    config, params = models.load_hf_checkpoint(ckpts[False], decoder=FUSED)
    out = models.save_hf_checkpoint(config, params, tmp_path / "saved", tokenizer_dir=ckpts[False])
    config2, params2 = models.load_hf_checkpoint(out, decoder=FUSED)
    assert config2 == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert ref.config.architectures == ["Qwen2ForCausalLM"]


def test_fused_params_shard_by_their_metadata_on_a_mesh(ckpts):
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    config, params = models.load_hf_checkpoint(ckpts[False], decoder=FUSED, mesh=mesh)
    axes = models.param_logical_axes(config)
    assert axes["blocks"]["qkv"]["kernel"] == ("layers", "embed", None, "head_dim")
    spec = params["blocks"]["qkv"]["kernel"].sharding.spec
    assert tuple(spec) == (None, "fsdp", None, None)
    _, host = models.load_hf_checkpoint(ckpts[False], decoder=FUSED)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_model_family_resolves_registry_names_and_import_paths():
    assert models.resolve_decoder("qwen3") is models.Decoder
    assert models.resolve_decoder(FUSED).__name__ == "FusedQwen2"
    with pytest.raises(KeyError, match="valid names: llama, qwen2, qwen3"):
        models.resolve_decoder("gpt2")
    with pytest.raises(ValueError, match="cannot import"):
        models.resolve_decoder("examples.nope:Model")
    with pytest.raises(ValueError, match="not an nnx.Module class"):
        models.resolve_decoder("json:dumps")
    with pytest.raises(ConfigError, match="model.family"):
        validate(Config(model=dataclasses.replace(Config().model, family="examples.fused_qwen:Nope")))
    validate(Config(model=dataclasses.replace(Config().model, family=FUSED)))


def test_a_table_that_misses_a_param_is_an_error(ckpts):
    config = models.ModelConfig.from_hf_dict(json.loads((ckpts[True] / "config.json").read_text()))
    cls = models.resolve_decoder(FUSED)
    rows = [r for r in cls.hf_table(config) if "up_proj" not in r.hf_name]
    abstract = models.abstract_params(dataclasses.replace(config, decoder=FUSED))
    with pytest.raises(ValueError, match="do not tile"):
        bind_table(rows, abstract, config.num_layers)


@pytest.mark.vllm
@pytest.mark.slow
def test_fused_model_trains_through_main_with_vllm(tmp_path, arith_server):
    """Three GRPO steps of the smoke job with the fused decoder: every sync passes the canary at 1e-4.

    On the session's tiny_arith server: the fused decoder's first push replaces whatever it served."""
    env = child_env(JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable,
        "-m",
        "rljax.main",
        "--config=configs/grpo.py:smoke",
        f"--workdir={tmp_path}",
        f"--config.model.family={FUSED}",
        "--config.trainer.steps=3",
        "--config.trainer.eval_every=0",
        "--config.rollout.weight_sync.canary_tolerance=1e-4",
        *arith_server.main_args(),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["step"] > 0]
    assert len(train) == 3
    keys = ("weight_sync/canary_logprob_max_abs_diff", "logprob/trainer_vs_rollout_abs_diff_max")
    print("fused decoder through main:", [{k: m[k] for k in keys} for m in train])
    for m in train:
        assert m["weight_sync/canary_logprob_max_abs_diff"] <= 1e-4, m
        assert m["logprob/trainer_vs_rollout_abs_diff_max"] < 1e-4, m
        assert m["weight_sync/bytes"] > 1e6 and m["policy/version"] == m["step"]
