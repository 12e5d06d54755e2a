"""The NNX decoder: module <-> pure params, logical axes as Param metadata, and a program whose size does not
grow with depth (the layers are one scanned body)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax import models

TINY = models.ModelConfig(
    family="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    qk_norm=True,
    attention_impl="blockwise",
    attention_block_size=8,
)


def test_build_model_state_is_the_params_layout():
    model = models.build_model(TINY, rngs=nnx.Rngs(1))
    assert isinstance(model, nnx.Module) and isinstance(model, models.Decoder)
    params = nnx.to_pure_dict(nnx.state(model))
    abstract = models.abstract_params(TINY)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract), strict=True):
        assert p.shape == a.shape and p.dtype == a.dtype
    assert params["layers"]["q_proj"]["kernel"].shape == (2, 32, 2, 16)
    # A module merged from params computes what the functional API computes from the same params.
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 16)), jnp.int32)
    merged = models.build_model(TINY, params=params)
    pos, seg = jnp.broadcast_to(jnp.arange(16), (2, 16)), jnp.ones((2, 16), jnp.int32)
    np.testing.assert_array_equal(
        merged(ids, positions=pos, segment_ids=seg), models.hidden_states(TINY, params, ids)
    )


def test_logical_axes_come_from_param_metadata():
    model = models.build_model(TINY, rngs=nnx.Rngs(0))
    axes = models.param_logical_axes(TINY)
    assert model.layers.q_proj.kernel.get_metadata()["out_sharding"] == (
        "layers",
        "embed",
        "heads",
        "head_dim",
    )
    assert axes["layers"]["q_proj"]["kernel"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["q_proj"]["kernel"].shape == (2, 32, 2, 16)
    assert axes["embed"]["embedding"] == ("vocab", "embed") and axes["final_norm"]["scale"] == ("norm",)
    assert axes["lm_head"]["kernel"] == ("vocab", "embed")


def test_init_params_follows_the_module_initialisers():
    params = models.init_params(TINY, jax.random.key(0), std=0.5)
    assert float(jnp.std(params["layers"]["gate_proj"]["kernel"])) == pytest.approx(0.5, rel=0.1)
    np.testing.assert_array_equal(params["layers"]["attn_norm"]["scale"], 1.0)
    assert models.init_params(TINY, jax.random.key(0))["embed"]["embedding"].dtype == jnp.float32


def _program_ops(config: models.ModelConfig) -> list[str]:
    """StableHLO op names of the jitted loss+gradient of the forward (the train step's model part)."""

    def loss(params, ids):
        return jax.nn.log_softmax(models.forward(config, params, ids)).mean()

    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    text = jax.jit(jax.value_and_grad(loss)).lower(models.abstract_params(config), ids).as_text()
    return re.findall(r"= (?:\"?)(stablehlo\.[a-z_]+|func\.call|call)", text)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_program_size_does_not_grow_with_depth(remat):
    # 2 layers scanned (auto would run them straight-line) vs 24 under auto (deep: one compiled body)
    shallow = _program_ops(dataclasses.replace(TINY, num_layers=2, remat=remat, unroll_layers=1))
    deep = _program_ops(dataclasses.replace(TINY, num_layers=24, remat=remat))
    assert "stablehlo.while" in deep  # the layers are a loop, not 24 unrolled copies
    assert len(deep) == len(shallow) and sorted(deep) == sorted(shallow)
    unrolled = _program_ops(dataclasses.replace(TINY, num_layers=2, remat=remat))
    # auto: the shallow stack straight-line (the layer loops of forward and backward gone, the layer
    # body twice: more ops; the attention's and the head's own loops remain)
    assert unrolled.count("stablehlo.while") == shallow.count("stablehlo.while") - 2
    assert len(unrolled) > len(shallow)


def test_decoder_without_a_cache_path_says_so():
    class NoCache(models.Decoder):
        cached = None

    models.DECODERS.add("_nocache_test", NoCache)
    config = dataclasses.replace(TINY, decoder="_nocache_test")
    params = models.init_params(config, jax.random.key(0))
    with pytest.raises(NotImplementedError, match="no KV-cache path"):
        models.prefill(config, params, models.init_cache(config, 1, 8), jnp.zeros((1, 4), jnp.int32))
