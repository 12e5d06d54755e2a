"""Mesh construction, logical-axis rules, sharded checkpoint loading and the 8-device sharded forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rljax import models, sharding
from rljax.models import hf as hf_io
from rljax.models.presets import PRESETS
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


QWEN25_7B = PRESETS.get("qwen2.5-7b")  # shapes only; no weights are built


def test_check_divisibility_names_each_tensor_axis_and_valid_sizes():
    axes = models.param_logical_axes(QWEN25_7B)
    lines = sharding.check_divisibility(axes, {"data": 1, "fsdp": 1, "tensor": 8})
    attention = ["q_proj.kernel", "q_proj.bias", "k_proj.kernel", "k_proj.bias", "v_proj.kernel"]
    attention += ["v_proj.bias", "o_proj.kernel"]
    assert sorted(line.split(":")[0] for line in lines) == sorted(f"layers.{t}" for t in attention)
    q = "layers.q_proj.kernel: dimension 2 ('heads', size 28) is not divisible by mesh axis tensor=8"
    k = "layers.k_proj.kernel: dimension 2 ('kv', size 4) is not divisible by mesh axis tensor=8"
    assert any(line.startswith(q) for line in lines) and any(line.startswith(k) for line in lines)
    # vocab 152064, mlp 18944, 28 heads and 4 KV heads are all sharded on tensor: their common divisors.
    assert all(line.endswith("(valid tensor sizes: 1, 2, 4)") for line in lines)
    # A mesh that divides every sharded dimension passes, given as sizes or as a Mesh.
    assert sharding.check_divisibility(axes, {"data": 1, "fsdp": 2, "tensor": 4}) == []
    assert sharding.check_divisibility(axes, make_mesh(fsdp=8)) == []
    # What logical_to_spec still does for a caller that opted in: heads replicated over tensor.
    q_axes = axes["layers"]["q_proj"]["kernel"]
    assert logical_to_spec(q_axes, make_mesh(fsdp=1, tensor=8)) == PartitionSpec(None, None, None, None)


def test_check_divisibility_follows_the_rules_order_over_several_mesh_axes():
    # batch -> (data, fsdp): 12 rows on data=2 leave 6 per data shard, which fsdp=4 does not divide.
    tree = {"acts": LogicalAxes(("batch", "embed"), (12, 64)), "plain": ("batch",)}  # no shape: unchecked
    (line,) = sharding.check_divisibility(tree, {"data": 2, "fsdp": 4, "tensor": 1})
    assert line == (
        "acts: dimension 0 ('batch', size 12, 6 per data shard) is not divisible by mesh axis fsdp=4 "
        "(valid fsdp sizes: 1, 2)"  # the divisors of gcd(6 rows left, 64 embed)
    )
    # Mesh axes of size 1, and a mesh axis already used by an earlier dimension, are never reported.
    fsdp8 = {"data": 1, "fsdp": 8, "tensor": 1}
    assert sharding.check_divisibility({"x": LogicalAxes(("embed", "embed"), (8, 3))}, fsdp8) == []
    assert sharding.check_divisibility({"x": LogicalAxes(("heads",), (3,))}, fsdp8) == []
    with pytest.raises(KeyError, match="unknown logical axis 'nope'"):
        sharding.check_divisibility({"x": LogicalAxes(("nope",), (4,))}, fsdp8)
