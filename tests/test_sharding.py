"""Mesh construction, logical-axis rules, sharded checkpoint loading and the 8-device sharded forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rljax import models, sharding
from rljax.models import hf as hf_io
from rljax.models.tiny import build_tiny_checkpoint
from rljax.sharding import LogicalAxes, logical_to_spec, make_mesh


def test_make_mesh_sizes_and_errors():
    assert len(jax.devices()) == 8  # tests/conftest.py
    mesh = make_mesh(fsdp=4, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor") and dict(mesh.shape) == {
        "data": 1,
        "fsdp": 4,
        "tensor": 2,
    }
    assert dict(make_mesh(data=2, fsdp=-1).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(make_mesh(devices=jax.devices()[:2]).shape)["fsdp"] == 2
    with pytest.raises(ValueError, match=r"data=1 x fsdp=3 x tensor=2 = 6 devices, but 8"):
        make_mesh(fsdp=3, tensor=2)
    with pytest.raises(ValueError, match="at most one mesh size may be -1"):
        make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="8 devices are not divisible by 3"):
        make_mesh(tensor=3)


def test_logical_rules_skip_axes_that_do_not_divide():
    mesh = make_mesh(fsdp=4, tensor=2)
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), mesh) == PartitionSpec(
        None, "fsdp", "tensor", None
    )
    assert logical_to_spec(("batch", "length"), mesh) == PartitionSpec("fsdp", None)  # data has size 1
    # 14 heads on tensor=4: not divisible, so heads are replicated (Qwen2.5-0.5B on 4-way TP).
    mesh4 = make_mesh(fsdp=2, tensor=4)
    assert logical_to_spec(LogicalAxes(("embed", "heads"), (896, 14)), mesh4) == PartitionSpec("fsdp", None)
    assert logical_to_spec(("embed", "heads"), mesh4, shape=(896, 16)) == PartitionSpec("fsdp", "tensor")
    # batch -> (data, fsdp): both axes when the batch divides both, one when only the first divides.
    mesh22 = make_mesh(data=2, fsdp=4)
    assert logical_to_spec(("batch",), mesh22, shape=(16,)) == PartitionSpec(("data", "fsdp"))
    assert logical_to_spec(("batch",), mesh22, shape=(2,)) == PartitionSpec("data")
    # A mesh axis is used at most once per array.
    assert logical_to_spec(("embed", "embed"), mesh) == PartitionSpec("fsdp", None)
    with pytest.raises(KeyError, match="unknown logical axis 'nope'"):
        logical_to_spec(("nope",), mesh)
    assert LogicalAxes(("a", "b"), (1, 2)) == ("a", "b") and jax.tree.leaves({"x": LogicalAxes(("a",))}) == [
        ("a",)
    ]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_untied"), "qwen2", tie_word_embeddings=False)


def test_logical_axes_cover_every_param(ckpt):
    config, params = models.load_hf_checkpoint(ckpt)
    axes = models.param_logical_axes(config)
    assert jax.tree.structure(params) == jax.tree.structure(axes)
    for x, names in zip(jax.tree.leaves(params), jax.tree.leaves(axes), strict=True):
        assert len(names) == x.ndim and names.shape == x.shape
        assert set(names) <= {"vocab", "embed", "mlp", "heads", "kv", "head_dim", "layers", "norm"}
    assert jax.tree.structure(models.abstract_params(config)) == jax.tree.structure(params)
    assert models.unembed_matrix(config, params).shape == (config.vocab_size, config.hidden_size)


def test_sharded_load_reads_each_element_once_and_forward_matches_one_device(ckpt, monkeypatch):
    config, params = models.load_hf_checkpoint(ckpt)
    mesh = make_mesh(fsdp=4, tensor=2)
    read = []
    real_read = hf_io._TensorSource.read

    def counting_read(self, name, index):
        block = real_read(self, name, index)
        read.append(block.size)
        return block

    monkeypatch.setattr(hf_io._TensorSource, "read", counting_read)
    config_s, sharded = models.load_hf_checkpoint(ckpt, mesh=mesh)
    # Each element is read exactly once in total: blocks, not a full copy per device.
    assert sum(read) == sum(x.size for x in jax.tree.leaves(params))
    expected = sharding.logical_to_sharding(models.param_logical_axes(config), mesh)
    q = sharded["layers"]["q_proj"]["kernel"]
    assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 32)
    for x, ref, s in zip(
        jax.tree.leaves(sharded), jax.tree.leaves(params), jax.tree.leaves(expected), strict=True
    ):
        assert x.sharding == s
        for shard in x.addressable_shards:  # every device holds exactly its slice of the full tensor
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(ref)[shard.index])
    ids = np.random.RandomState(0).randint(0, 512, (8, 16)).astype(np.int32)
    seg = np.ones_like(ids)
    seg[::2, :5] = 0  # left padding on half the rows
    batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", "length"), mesh, shape=ids.shape))
    ids_s, seg_s = jax.device_put(ids, batch_sharding), jax.device_put(seg, batch_sharding)
    fwd = jax.jit(models.forward, static_argnums=0)
    out = fwd(config_s, sharded, ids_s, segment_ids=seg_s)
    single = fwd(config, params, ids, segment_ids=seg)
    assert np.abs(np.asarray(out) - np.asarray(single)).max() <= 1e-5
    hidden = jax.jit(models.hidden_states, static_argnums=0)(config_s, sharded, ids_s, segment_ids=seg_s)
    assert hidden.shape == (8, 16, config.hidden_size) and hidden.dtype == jnp.float32


def test_logical_constraint_inside_jit():
    mesh = make_mesh(fsdp=4, tensor=2)
    f = jax.jit(lambda x: sharding.logical_constraint(x * 2, ("batch", "length", "embed"), mesh))
    y = f(jnp.ones((8, 4, 128)))
    want = NamedSharding(mesh, PartitionSpec("fsdp", None, None))  # fsdp taken by batch first
    assert y.sharding.is_equivalent_to(want, 3)
