"""LoRA on the built-in decoder and a bring-your-own one: B = 0 is the base model exactly, a trained
adapter equals its merged weights to 1e-5 (float32), and the PEFT tensors merge into the HF weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import lora

TOL = 1e-5  # float32 logits: adapter on the activations vs folded into the weights (summation order only)
FUSED = "examples.fused_qwen:FusedQwen2"
FUSED_TARGETS = ("qkv", "out", "gate_up", "down")


def small_config(family="qwen2", **kw):
    return models.ModelConfig(
        family=family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        **kw,
    )


def with_lora(config, rank=4, alpha=8.0, **kw):
    return dataclasses.replace(config, lora_rank=rank, lora_alpha=alpha, **kw)


def trained_adapter(config, seed=1):
    """A fresh adapter with a random B (as after training): B = 0 would hide layout mistakes."""
    adapter = lora.init_adapter(config, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(adapter)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return tree.unflatten(
        [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )


IDS = (np.arange(2 * 12).reshape(2, 12) * 7 % 64).astype(np.int32)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_zero_b_is_the_base_model_and_trained_adapter_equals_merged_weights(family):
    config = small_config(family)
    lc = with_lora(config)
    adapter = lora.init_adapter(lc, jax.random.key(1))
    assert all(float(jnp.abs(m["kernel_lora_b"]).max()) == 0 for m in adapter["layers"].values())
    check_forwards(config, lc)


def check_forwards(config, lc):
    """B = 0 gives the base model's logits bit for bit; a trained adapter gives the merged weights' to TOL
    (and logits off the base's). Returns (base params, trained adapter)."""
    base = models.init_params(config, jax.random.key(0))
    want = np.asarray(models.forward(config, base, IDS))
    zero_b = lora.init_adapter(lc, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(models.forward(lc, lora.combine(base, zero_b), IDS)), want)
    adapter = trained_adapter(lc)
    got = np.asarray(models.forward(lc, lora.combine(base, adapter), IDS))
    merged = np.asarray(models.forward(config, lora.merged_params(lc, base, adapter), IDS))
    assert np.abs(got - merged).max() <= TOL and np.abs(got - want).max() > 1e-3
    return base, adapter


def test_adapter_shapes_axes_and_split():
    lc = with_lora(small_config(), rank=3)
    adapter = lora.abstract_adapter(lc)
    q = adapter["layers"]["q_proj"]
    assert q["kernel_lora_a"].shape == (2, 32, 3) and q["kernel_lora_b"].shape == (2, 3, 4, 8)
    assert adapter["layers"]["o_proj"]["kernel_lora_a"].shape == (2, 4, 8, 3)
    axes = lora.adapter_logical_axes(lc)["layers"]
    assert axes["q_proj"]["kernel_lora_a"] == ("layers", "embed", None)
    assert axes["down_proj"]["kernel_lora_b"] == ("layers", None, "embed")
    full = models.abstract_params(lc)
    base, adapter2 = lora.split_params(full)
    assert jax.tree.structure(base) == jax.tree.structure(models.abstract_params(small_config()))
    assert jax.tree.structure(lora.combine(base, adapter2)) == jax.tree.structure(full)
    # The HF table is the base model's: checkpoint load/save and the full weight push are unchanged.
    assert models.hf_tensor_specs(lc) == models.hf_tensor_specs(small_config())


def test_targets_select_modules_and_no_match_raises():
    lc = with_lora(small_config(), lora_targets=("q_proj", "layers/v_proj"))
    assert sorted(lora.abstract_adapter(lc)["layers"]) == ["q_proj", "v_proj"]
    assert lora.peft_config(lc)["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="match no module"):
        models.abstract_params(with_lora(small_config(), lora_targets=("nope",)))


def check_peft_tensors(lc, base, adapter):
    """PEFT lora_A [r, in], lora_B [out, r]: W_hf + (alpha / r) B A equals the merged model's HF tensor."""
    config = lora.base_config(lc)
    tensors = lora.peft_tensors(lc, adapter)
    before = dict(models.iter_hf_tensors(config, base))
    after = dict(models.iter_hf_tensors(config, lora.merged_params(lc, base, adapter)))
    scale = lc.lora_alpha / lc.lora_rank
    names = [n for n in tensors if n.endswith("lora_A.weight")]
    assert names
    for name in names:
        hf = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        a, b = tensors[name], tensors[name.replace("lora_A", "lora_B")]
        assert a.dtype == np.float32 and a.shape[0] == b.shape[1] == lc.lora_rank
        np.testing.assert_allclose(after[hf], before[hf] + scale * (b @ a), atol=1e-6, err_msg=name)
    changed = {n for n in after if not np.array_equal(after[n], before[n])}
    assert changed == {n.removeprefix("base_model.model.").replace(".lora_A", "") for n in names}


def test_peft_tensors_are_the_merged_hf_weights():
    lc = with_lora(small_config(), rank=4, alpha=16.0)
    base = models.init_params(lora.base_config(lc), jax.random.key(0))
    adapter = trained_adapter(lc)
    check_peft_tensors(lc, base, adapter)
    names = list(lora.peft_tensors(lc, adapter))
    assert names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cfg = lora.peft_config(lc, "/models/base")
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 16.0 and cfg["peft_type"] == "LORA"
    assert cfg["bias"] == "none" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["base_model_name_or_path"] == "/models/base"


def test_bring_your_own_decoder_with_lora():
    config = small_config(decoder=FUSED)
    lc = with_lora(config, lora_targets=FUSED_TARGETS)
    assert lora.abstract_adapter(lc)["blocks"]["qkv"]["kernel_lora_b"].shape == (2, 4, 4 + 2 * 2, 8)
    base, adapter = check_forwards(config, lc)
    # The fused q/k/v and gate/up adapters split into PEFT's per-module tensors (one A, its B's part).
    check_peft_tensors(lc, base, adapter)
    assert lora.peft_config(lc)["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def test_lora_gradients_reach_the_adapter_only():
    lc = with_lora(small_config())
    base = models.init_params(lora.base_config(lc), jax.random.key(0))
    adapter = lora.init_adapter(lc, jax.random.key(1))

    def loss(adapter):
        return models.forward(lc, lora.combine(base, adapter), IDS).mean()

    grads = jax.grad(loss)(adapter)
    assert jax.tree.structure(grads) == jax.tree.structure(adapter)
    # B = 0: A gets no gradient yet, B does (as in PEFT's first step).
    assert float(jnp.abs(grads["layers"]["q_proj"]["kernel_lora_b"]).max()) > 0
    assert float(jnp.abs(grads["layers"]["q_proj"]["kernel_lora_a"]).max()) == 0
