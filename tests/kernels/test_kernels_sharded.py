"""token_logprobs(..., mesh=...) on 8 simulated CPU devices: the fused impls under shard_map equal one device
(values and both gradients, inside jax.jit with sharded inputs), and the compiled HLO of the sharded head
gathers neither the hidden states nor (with tensor > 1) the full unembedding."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from rljax.kernels import fused, token_logprobs
from test_kernels import RTOL, make_inputs, rel_err

from rljax import sharding

MESHES = {
    "fsdp8": dict(fsdp=8),
    "fsdp4-tensor2": dict(fsdp=4, tensor=2),
    "data2-fsdp2-tensor2": dict(data=2, fsdp=2, tensor=2),
}
# N, d, V: rows and vocab divisible by the meshes; Pallas's CPU blocks (1024 x 8192) cover them in one go.
N, D, V = 64, 16, 1000


def shard_inputs(mesh, hidden, unembed, targets, g_logp, g_ent):
    """Rows over (data, fsdp), unembed [V,d] over (tensor, fsdp) as the trainer lays them out."""
    rows = NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh))
    table = NamedSharding(mesh, sharding.logical_to_spec(("vocab", "embed"), mesh, shape=unembed.shape))
    put = jax.device_put
    return put(hidden, rows), put(unembed, table), put(targets, rows), put(g_logp, rows), put(g_ent, rows)


def head_loss(impl, mesh, entropy, temperature=0.8):
    def loss(h, w, t, g_logp, g_ent):
        out = token_logprobs(
            h, w, t, temperature=temperature, return_entropy=entropy, impl=impl, block_size=128, mesh=mesh
        )
        lp, ent = out if entropy else (out, None)
        total = jnp.sum(lp * g_logp) + (jnp.sum(ent * g_ent) if entropy else 0.0)
        return total, (lp, ent)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def test_axis_names_agree_with_the_sharding_rules():
    assert sharding.LOGICAL_RULES["batch"] == fused.ROW_AXES
    assert sharding.LOGICAL_RULES["vocab"] == (fused.VOCAB_AXIS,)
    assert sharding.LOGICAL_RULES["embed"] == (fused.EMBED_AXIS,)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("entropy", [True, False], ids=["ent", "logp"])
def test_sharded_head_matches_one_device(impl, mesh_name, entropy):
    mesh = sharding.make_mesh(**MESHES[mesh_name])
    args = make_inputs(N, D, V, seed=3)
    args = (args[0], args[1], args[2].at[5].set(-100), args[3], args[4])  # an ignored target
    (_, (lp1, ent1)), (dh1, dw1) = jax.jit(head_loss(impl, None, entropy))(*args)
    sharded = shard_inputs(mesh, *args)
    (_, (lp, ent)), (dh, dw) = jax.jit(head_loss(impl, mesh, entropy))(*sharded)
    assert len(dh.sharding.device_set) == 8 and dh.sharding.is_equivalent_to(sharded[0].sharding, 2)
    assert dw.sharding.is_equivalent_to(sharded[1].sharding, 2)  # the gradient comes back sharded like W
    assert float(lp[5]) == 0.0
    for a, b in ((lp, lp1), (dh, dh1), (dw, dw1)) + (((ent, ent1),) if entropy else ()):
        assert rel_err(a, b) <= RTOL


def test_rows_not_divided_by_the_mesh_are_padded():
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    args = make_inputs(13, D, V, seed=4)
    (_, (lp1, ent1)), (dh1, dw1) = jax.jit(head_loss("pallas", None, True))(*args)
    (_, (lp, ent)), (dh, dw) = jax.jit(head_loss("pallas", mesh, True))(*args)
    assert lp.shape == (13,) and dh.shape == (13, D)
    for a, b in ((lp, lp1), (ent, ent1), (dh, dh1), (dw, dw1)):
        assert rel_err(a, b) <= RTOL


def test_vocab_not_divided_by_tensor_splits_rows_over_it():
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    layout = fused.head_layout(mesh, vocab=999, dim=D)
    assert layout.rows == ("fsdp", "tensor") and layout.vocab is None and layout.embed == "fsdp"
    args = make_inputs(N, D, 999, seed=5)
    (_, (lp1, ent1)), (dh1, dw1) = jax.jit(head_loss("pallas", None, True))(*args)
    (_, (lp, ent)), (dh, dw) = jax.jit(head_loss("pallas", mesh, True))(*args)
    for a, b in ((lp, lp1), (ent, ent1), (dh, dh1), (dw, dw1)):
        assert rel_err(a, b) <= RTOL


def all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Result shapes of every all-gather in compiled HLO text (`%x = f32[500,16]{1,0} all-gather(...)`)."""
    pattern = re.compile(r"=\s*\w+\[([\d,]*)\][^=]*?\sall-gather(?:-start)?\(")
    return [tuple(int(x) for x in m.group(1).split(",") if x) for m in pattern.finditer(hlo)]


def compiled_hlo(impl, mesh, n, d, v, with_mesh=True):
    rows = NamedSharding(mesh, sharding.logical_to_spec(("batch",), mesh))
    table = NamedSharding(mesh, sharding.logical_to_spec(("vocab", "embed"), mesh, shape=(v, d)))
    abstract = (
        jax.ShapeDtypeStruct((n, d), jnp.float32, sharding=rows),
        jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=table),
        jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rows),
        jax.ShapeDtypeStruct((n,), jnp.float32, sharding=rows),
        jax.ShapeDtypeStruct((n,), jnp.float32, sharding=rows),
    )
    return jax.jit(head_loss(impl, mesh if with_mesh else None, True)).lower(*abstract).compile().as_text()


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_sharded_head_gathers_only_the_fsdp_split_of_its_vocab_shard(impl):
    n, d, v = 256, 32, 1000  # distinct sizes, so a gathered array is recognisable by its shape
    hlo = compiled_hlo(impl, sharding.make_mesh(fsdp=4, tensor=2), n, d, v)
    gathers = all_gather_shapes(hlo)
    assert gathers, "the FSDP gather of unembed [V/2, d/4] -> [V/2, d] should be there"
    assert set(gathers) == {(v // 2, d)}, gathers  # not [V, d], nothing with the rows of hidden
    assert "reduce-scatter" in hlo  # d(unembed) goes back to its [V/2, d/4] shards


def test_without_the_mesh_spmd_gathers_the_vocab_and_the_rows():
    # Why the head is wrapped: left to XLA's SPMD partitioner, the xla impl's chunk loop gathers the whole
    # vocab of the unembedding and blocks of hidden rows (and this is the walker seeing such gathers).
    n, d, v = 256, 32, 1000
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    gathers = all_gather_shapes(compiled_hlo("xla", mesh, n, d, v, with_mesh=False))
    assert any(s[0] == v for s in gathers) and any(s[0] > n // 8 and s[-1] == d for s in gathers), gathers


def test_one_device_mesh_runs_under_shard_map():
    layout = fused.head_layout(jax.sharding.Mesh(jax.devices()[:1], ("fsdp",)), V, D)
    assert layout.mesh is not None and layout.rows == () and layout.vocab is None and layout.embed is None


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_fused_kernels_under_shard_map_on_one_gpu(impl):
    # The jax_triton / XLA fused call inside shard_map (on a one-GPU mesh) equals the plain call.
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    args = make_inputs(300, 128, 5000, seed=7)
    (_, (lp1, ent1)), (dh1, dw1) = jax.jit(head_loss(impl, None, True))(*args)
    (_, (lp, ent)), (dh, dw) = jax.jit(head_loss(impl, mesh, True))(*args)
    for a, b in ((lp, lp1), (ent, ent1), (dh, dh1), (dw, dw1)):
        assert rel_err(a, b) <= RTOL
