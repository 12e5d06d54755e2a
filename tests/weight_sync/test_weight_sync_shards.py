"""Sharded staging's shard selection: each element of a sharded array is taken exactly once (replicas
dropped), from the shards' own devices (8 simulated CPU devices, one process)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax.weight_sync.staging import owned_shards


@pytest.mark.parametrize(
    "axes,spec",
    [
        ((8,), PartitionSpec("a", None)),  # fsdp=8: 8 disjoint row blocks
        ((2, 4), PartitionSpec("b", "a")),  # 2-D blocks
        ((2, 4), PartitionSpec(None, "b")),  # 4 column blocks, each replicated twice
        ((8,), PartitionSpec()),  # fully replicated: one copy staged
    ],
)
def test_owned_shards_cover_every_element_exactly_once(axes, spec):
    names = ("a", "b")[: len(axes)]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(axes), names)
    full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    x = jax.device_put(jnp.asarray(full), NamedSharding(mesh, spec))
    count = np.zeros(full.shape, np.int32)
    rebuilt = np.zeros_like(full)
    shards = owned_shards(x)
    for index, data in shards:
        count[index] += 1
        rebuilt[index] = data
    np.testing.assert_array_equal(count, 1)  # exactly once: no replica staged twice, nothing missed
    np.testing.assert_array_equal(rebuilt, full)
    staged = sum(d.nbytes for _, d in shards)
    assert staged == full.nbytes
    assert all(d.nbytes == full.nbytes // len(shards) for _, d in shards)  # even blocks


def test_owned_slices_reassemble_on_the_receiving_side():
    from rljax.weight_sync.wire import SliceAssembler

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    x = jax.device_put(jnp.asarray(full), NamedSharding(mesh, PartitionSpec("b", None)))
    asm = SliceAssembler({"w": ((16, 8), "float32")})
    shards = owned_shards(x)
    results = [asm.add("w", tuple((s.start, s.stop) for s in index), data) for index, data in shards]
    assert all(r is None for r in results[:-1]) and asm.incomplete() == []
    np.testing.assert_array_equal(results[-1], full)


def test_assembler_rejects_overlap_and_out_of_range_naming_the_tensor():
    from rljax.weight_sync.wire import SliceAssembler

    asm = SliceAssembler({"w": ((4, 2), "float32")})
    assert asm.add("w", ((0, 2), (0, 2)), np.ones((2, 2), np.float32)) is None
    with pytest.raises(ValueError, match="'w'.*overlaps"):
        asm.add("w", ((1, 3), (0, 2)), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="not inside"):
        asm.add("w", ((2, 5), (0, 2)), np.ones((3, 2), np.float32))
    assert asm.incomplete() == ["w"]


def test_slice_buckets_round_trip_through_the_wire_and_assemble(tmp_path):
    import zlib

    from rljax.weight_sync.staging import stage_buckets
    from rljax.weight_sync.wire import SliceAssembler, TensorEntry

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("fsdp",))
    full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    x = jax.device_put(jnp.asarray(full), NamedSharding(mesh, PartitionSpec("fsdp", None)))
    spec = {"w": ((16, 8), "float32")}
    items = [("w", d, tuple((s.start, s.stop) for s in i)) for i, d in owned_shards(x)]
    buckets = list(stage_buckets(items, bucket_bytes=128, directory=tmp_path, checksums=True, spec=spec))
    asm, out = SliceAssembler(spec), None
    for b in buckets:
        raw = open(b.path, "rb").read()
        for item in b.update_info(copy=False)["tensors"]:
            e = TensorEntry.from_wire(item)
            data = raw[e.offset : e.offset + e.nbytes]
            assert zlib.crc32(data) == e.crc32
            out = asm.add(e.name, e.index, np.frombuffer(data, np.float32).reshape(e.shape))
        b.unlink()
    np.testing.assert_array_equal(out, full)
    with pytest.raises(ValueError, match="pushed twice"):
        list(stage_buckets(items + items[:1], bucket_bytes=1 << 20, directory=tmp_path, spec=spec))


def _config(family: str, tied: bool):
    from rljax import models

    return models.ModelConfig(
        family=family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        attention_bias=family == "qwen2",
    )


@pytest.mark.parametrize(
    "family,tied", [("qwen2", True), ("qwen2", False), ("llama", True), ("llama", False)]
)
@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 1, 8), (1, 4, 2), (2, 2, 2)])
def test_owned_hf_slices_tile_every_hf_tensor_exactly_once(family, tied, mesh_shape):
    """fsdp=8, tensor=8 (kv heads replicated over it), fsdp x tensor, data x fsdp x tensor (replicas
    over data): every element of every HF tensor is staged once, equal to the unsharded conversion, and
    the staged bytes are the model's bytes in the serving dtype."""
    from rljax import models
    from rljax.distributed import cast_params
    from rljax.sharding import logical_to_sharding, make_mesh

    config = _config(family, tied)
    mesh = make_mesh(*mesh_shape)
    params = models.init_params(config, jax.random.key(0))
    shardings = logical_to_sharding(models.param_logical_axes(config), mesh)
    sharded = jax.device_put(params, shardings)
    ref = dict(models.iter_hf_tensors(config, jax.tree.map(np.asarray, params), "bfloat16"))
    count = {k: np.zeros(v.shape, np.int32) for k, v in ref.items()}
    rebuilt = {k: np.zeros_like(v) for k, v in ref.items()}
    staged = 0
    for name, piece, index in models.iter_owned_hf_slices(
        config, cast_params(sharded, "bfloat16"), "bfloat16"
    ):
        where = (
            tuple(slice(None) for _ in piece.shape) if index is None else tuple(slice(a, b) for a, b in index)
        )
        assert piece.dtype == ref[name].dtype
        count[name][where] += 1
        rebuilt[name][where] = piece
        staged += piece.nbytes
    for k in ref:
        np.testing.assert_array_equal(count[k], 1, err_msg=k)
        np.testing.assert_array_equal(rebuilt[k], ref[k], err_msg=k)
    assert staged == sum(v.nbytes for v in ref.values())
    assert ("lm_head.weight" in ref) == (not tied)


def test_a_cut_head_dim_splits_a_merged_hf_dim_into_rows():
    """A block that cuts an inner merged dim (head_dim of q_proj) is not one HF range: one piece per
    head, still exactly covering the block."""
    from rljax import models
    from rljax.models.params import hf_blocks

    config = _config("llama", True)
    (e,) = [e for e in models.param_entries(config) if e.path == ("layers", "q_proj", "kernel")]
    full = np.arange(np.prod(e.shape), dtype=np.float32).reshape(e.shape)  # [d, H, hd]
    hf = e.to_hf(full)  # [H*hd, d]
    count = np.zeros(hf.shape, np.int32)
    for lo in (0, 4):  # head_dim cut in halves, d cut in halves
        for d0 in (0, 16):
            index = (slice(d0, d0 + 16), slice(0, 8), slice(lo, lo + 4))
            pieces = hf_blocks(e, index, full[index])
            assert len(pieces) == 8  # one per head
            for hf_index, piece in pieces:
                where = tuple(slice(a, b) for a, b in hf_index)
                count[where] += 1
                np.testing.assert_array_equal(piece, hf[where])
    np.testing.assert_array_equal(count, 1)


def test_the_on_device_cast_before_staging_has_no_collective_in_its_hlo():
    """The one jitted op of the sharded sync path (float32 masters -> bfloat16 on each shard's device)
    compiles to no all-gather or other collective on an fsdp x tensor mesh: each device casts its own
    shards (per-device output = its own shards, half their bytes)."""
    from rljax import distributed, models
    from rljax.sharding import logical_to_sharding, make_mesh

    config = _config("qwen2", False)
    mesh = make_mesh(1, 4, 2)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        models.abstract_params(config),
        logical_to_sharding(models.param_logical_axes(config), mesh),
    )
    compiled = distributed._cast.lower(abstract, jnp.dtype("bfloat16")).compile()
    text = compiled.as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert op not in text
    mem = compiled.memory_analysis()
    model_bytes = sum(x.size * 4 for x in jax.tree.leaves(abstract))
    assert mem.output_size_in_bytes <= 0.55 * mem.argument_size_in_bytes  # bf16: half (+ buffer alignment)
    assert mem.argument_size_in_bytes < model_bytes / 2  # its own shards, not a copy of the model


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 2, 4)])
def test_fused_params_split_across_hf_tensors_tile_them_exactly_once(mesh_shape):
    """A decoder with fused q/k/v and gate/up params (examples/fused_qwen.py): each shard of the fused
    gate/up axis (split over tensor) lands in the HF tensor(s) its range covers; q/k/v split by part."""
    import dataclasses

    from rljax import models
    from rljax.sharding import logical_to_sharding, make_mesh

    config = dataclasses.replace(_config("qwen2", False), decoder="examples.fused_qwen:FusedQwen2")
    mesh = make_mesh(*mesh_shape)
    params = models.init_params(config, jax.random.key(1))
    sharded = jax.device_put(params, logical_to_sharding(models.param_logical_axes(config), mesh))
    ref = dict(models.iter_hf_tensors(config, jax.tree.map(np.asarray, params)))
    count = {k: np.zeros(v.shape, np.int32) for k, v in ref.items()}
    for name, piece, index in models.iter_owned_hf_slices(config, sharded):
        where = (
            tuple(slice(None) for _ in piece.shape) if index is None else tuple(slice(a, b) for a, b in index)
        )
        count[name][where] += 1
        np.testing.assert_array_equal(piece, ref[name][where], err_msg=name)
    for k in ref:
        np.testing.assert_array_equal(count[k], 1, err_msg=k)


def test_a_block_straddling_two_fused_parts_lands_in_both():
    import dataclasses

    from rljax import models
    from rljax.models.params import hf_blocks

    config = dataclasses.replace(_config("qwen2", False), decoder="examples.fused_qwen:FusedQwen2")
    entries = [e for e in models.param_entries(config) if e.path == ("blocks", "gate_up", "kernel")]
    full = np.arange(np.prod(entries[0].shape), dtype=np.float32).reshape(entries[0].shape)  # [d, 2F]
    index = (slice(0, 32), slice(48, 80))  # F = 64: 16 columns of gate, 16 of up
    got = {e.hf_name: hf_blocks(e, index, full[index]) for e in entries}
    assert sorted(len(v) for v in got.values()) == [1, 1]
    for e in entries:
        ((hf_index, piece),) = got[e.hf_name]
        assert piece.shape == (16, 32)
        np.testing.assert_array_equal(piece, e.to_hf(full)[tuple(slice(a, b) for a, b in hf_index)])
