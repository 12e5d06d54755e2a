"""Hugging Face interop: tensor names and layout, save/load round trips, bad checkpoints, configs."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from rljax import models
from rljax.models.tiny import build_tiny_checkpoint, tiny_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VARIANTS = [(f, tied) for f in ("qwen2", "qwen3", "llama") for tied in (True, False)]
IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in VARIANTS]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(family, tied) -> checkpoint dir, built once for the module."""
    out = {}
    for family, tied in VARIANTS:
        path = tmp_path_factory.mktemp(f"{family}_{tied}")
        out[family, tied] = build_tiny_checkpoint(path, family, tie_word_embeddings=tied, seed=len(out))
    return out


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


IDS_24 = np.random.RandomState(0).randint(0, 512, (2, 24))


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_tensor_names_are_exactly_transformers_state(ckpts, variant):
    path = ckpts[variant]
    config, params = models.load_hf_checkpoint(path)
    ref = hf_model(path)
    tied = set(getattr(ref, "_tied_weights_keys", None) or {}) if variant[1] else set()
    expected = set(ref.state_dict()) - tied
    specs = models.hf_tensor_specs(config)
    assert set(specs) == expected
    assert set(specs) == set(load_file(str(path / "model.safetensors")))  # what save_pretrained wrote
    assert ("lm_head.weight" in specs) == (not variant[1])
    names = []
    state = ref.state_dict()
    for name, arr in models.iter_hf_tensors(config, params):
        names.append(name)
        assert (arr.shape, arr.dtype.name) == specs[name]
        np.testing.assert_array_equal(arr, state[name].numpy(), err_msg=name)  # bitwise, HF layout
    assert names == list(specs)  # every weight exactly once, in state-dict order


def test_iter_hf_tensors_same_from_host_views_and_device_slices(ckpts, monkeypatch):
    config, params = models.load_hf_checkpoint(ckpts["qwen2", True])
    host = list(models.iter_hf_tensors(config, params))  # CPU arrays: stacked layers sliced in numpy
    from rljax.models import hf

    assert hf._in_host_memory(np.zeros(2)) and hf._in_host_memory(jax.numpy.zeros(2))
    monkeypatch.setattr(hf, "_in_host_memory", lambda x: False)  # the accelerator path: per-layer slices
    device = list(models.iter_hf_tensors(config, params))
    assert [n for n, _ in host] == [n for n, _ in device]
    for (name, a), (_, b) in zip(host, device, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_iter_hf_tensors_is_lazy_and_casts(ckpts):
    config, params = models.load_hf_checkpoint(ckpts["qwen3", False])
    it = models.iter_hf_tensors(config, params, dtype="bfloat16")
    name, first = next(it)
    assert name == "model.embed_tokens.weight" and first.dtype.name == "bfloat16"
    assert models.hf_tensor_specs(config, "bfloat16")[name] == ((512, 128), "bfloat16")


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_save_load_round_trip_is_bitwise_and_transformers_loads_it(ckpts, variant, tmp_path):
    path = ckpts[variant]
    config, params = models.load_hf_checkpoint(path)
    out = models.save_hf_checkpoint(config, params, tmp_path / "saved", tokenizer_dir=path)
    config2, params2 = models.load_hf_checkpoint(out)
    assert config2 == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    original, saved = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(original) == set(saved)
    for k in original:
        assert original[k].tobytes() == saved[k].tobytes(), k
    np.testing.assert_array_equal(hf_logits(hf_model(out), IDS_24), hf_logits(hf_model(path), IDS_24))
    tok = models.load_tokenizer(out)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False)
    assert text.startswith("<|im_start|>user\n") and tok.decode(tok("1 + 2 = 3")["input_ids"]) == "1 + 2 = 3"
    for fname in ("generation_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (out / fname).read_bytes() == (path / fname).read_bytes()


def test_sharded_save_writes_an_index_that_both_loaders_read(ckpts, tmp_path):
    path = ckpts["llama", False]
    config, params = models.load_hf_checkpoint(path)
    out = models.save_hf_checkpoint(config, params, tmp_path / "sharded", max_shard_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(models.hf_tensor_specs(config))
    _, params2 = models.load_hf_checkpoint(out)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(hf_logits(hf_model(out), IDS_24), hf_logits(hf_model(path), IDS_24))


def test_bf16_checkpoint_loads_as_bf16_and_dtype_overrides(ckpts, tmp_path):
    config, params = models.load_hf_checkpoint(ckpts["qwen2", True], dtype="bfloat16")
    assert config.param_dtype == config.compute_dtype == "bfloat16"
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}
    out = models.save_hf_checkpoint(config, params, tmp_path / "bf16")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    config2, params2 = models.load_hf_checkpoint(out)
    assert config2.param_dtype == "bfloat16"
    config3, params3 = models.load_hf_checkpoint(out, dtype="float32")
    np.testing.assert_array_equal(
        np.asarray(params3["layers"]["q_proj"]["kernel"]),
        np.asarray(params2["layers"]["q_proj"]["kernel"]).astype(np.float32),
    )


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_attention_bias_variants_match_transformers(family, tmp_path):
    """Qwen3/Llama `attention_bias=True` puts a bias on q/k/v *and* o_proj."""
    cfg = tiny_hf_config(family, tie_word_embeddings=False)
    cfg.attention_bias = True
    cfg.initializer_range = 0.1
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    ref.save_pretrained(str(tmp_path))
    config, params = models.load_hf_checkpoint(tmp_path)
    assert config.attention_bias and config.attention_out_bias
    assert "model.layers.1.self_attn.o_proj.bias" in models.hf_tensor_specs(config)
    diff = np.abs(np.asarray(models.forward(config, params, IDS_24)) - hf_logits(ref, IDS_24)).max()
    assert diff <= 1e-5


def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_checkpoints_raise_naming_the_tensor_and_shape(ckpts, tmp_path):
    src = ckpts["qwen2", False]
    q = "model.layers.1.self_attn.q_proj.weight"
    missing = _broken_copy(src, tmp_path / "missing", lambda t: t.pop(q))
    with pytest.raises(
        ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.q_proj\.weight'.*\(128, 128\)"
    ):
        models.load_hf_checkpoint(missing)
    extra = _broken_copy(src, tmp_path / "extra", lambda t: t.update(extra_head=np.zeros((3, 4), np.float32)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'extra_head' \(shape \(3, 4\)\)"):
        models.load_hf_checkpoint(extra)
    wrong = _broken_copy(src, tmp_path / "wrong", lambda t: t.update({q: t[q][:64]}))
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.1\.self_attn\.q_proj\.weight' has shape \(64, 128\), expected \(128, 128\)",
    ):
        models.load_hf_checkpoint(wrong)


def test_unknown_architecture_and_unsupported_options_raise(ckpts):
    d = json.loads((ckpts["llama", True] / "config.json").read_text())
    with pytest.raises(
        ValueError,
        match=r"architecture 'MistralForCausalLM'; supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3",
    ):
        models.ModelConfig.from_hf_dict({**d, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(KeyError, match=r"unknown rope type 'yarn'.*default, llama3"):
        models.ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="sliding-window"):
        models.ModelConfig.from_hf_dict({**d, "use_sliding_window": True})


def test_config_parses_legacy_rope_keys_and_round_trips(ckpts):
    d = json.loads((ckpts["llama", True] / "config.json").read_text())
    config = models.ModelConfig.from_hf_dict(d)
    assert config.rope_theta == 500000.0 and config.rope_scaling.factor == 8.0
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling=d["rope_parameters"], torch_dtype="float32")
    assert models.ModelConfig.from_hf_dict(legacy) == config
    assert models.ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    assert hash(dataclasses.replace(config)) == hash(config)
    # Llama 3 scaling: high frequencies kept, low ones divided by `factor`, a smooth band between.
    plain = models.rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    scaled = models.rope_inv_freq(config)
    assert scaled[0] == plain[0] and np.isclose(scaled[-1], plain[-1] / 8.0)
    ratio = plain / scaled
    assert np.all(np.diff(ratio) >= -1e-6) and np.any((ratio > 1.01) & (ratio < 7.99))
