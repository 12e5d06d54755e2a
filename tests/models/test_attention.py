"""Attention implementations vs the materialized reference: values and gradients, packing, padding, GQA,
KV cache, bf16, 1 vs 8 simulated devices, and compiled memory that grows linearly with the length."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rljax import sharding
from rljax.models import attention
from rljax.models.attention import ATTENTION_IMPLS, resolve_attention_impl
from rljax.models.blockwise import _block_lists, _needed_blocks
from rljax.types import BRANCH_SHIFT

TOL = 1e-5  # the bound for float32 parity, values and gradients
BLOCK = 16  # small blocks so the test shapes span several query and key blocks


def packed_segments(t: int) -> np.ndarray:
    """i32[3,t]: three packed segments + end padding; left padding + one segment; four packed segments."""
    seg = np.zeros((3, t), np.int32)
    seg[0, : t - 12] = np.repeat([1, 2, 3], [10, 15, t - 37])
    seg[1, 5:] = 1
    seg[2] = np.repeat([1, 2, 3, 4], [t // 4, t // 4, t // 4, t - 3 * (t // 4)])
    return seg


def self_case(h: int, kv: int, t: int = 45, hd: int = 8, seed: int = 0, dtype=jnp.float32):
    """Self-attention over packed rows: T not a multiple of BLOCK."""
    rng = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(rng.randn(3, t, n, hd), dtype) for n in (h, kv, kv))
    seg, slots = jnp.asarray(packed_segments(t)), jnp.arange(t, dtype=jnp.int32)
    return (q, k, v), dict(q_slots=slots, k_slots=slots, q_segments=seg, k_segments=seg)


def cache_case(
    h: int = 4, kv: int = 2, t: int = 13, s: int = 53, index: int = 20, hd: int = 8, seed: int = 1
):
    """Prefill of T tokens at cache slots index..index+T-1 of an S-slot cache (S > T). Row 1's left padding
    reaches into the new tokens; slots after index+T are unwritten (segment 0, never visible)."""
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(3, t, h, hd), jnp.float32)
    k, v = (jnp.asarray(rng.randn(3, s, kv, hd), jnp.float32) for _ in range(2))
    seg = np.zeros((3, s), np.int32)
    seg[0, : index + t] = 1
    seg[1, index + 3 : index + t] = 1
    seg[2, 4 : index + t] = 1
    segs = dict(q_segments=jnp.asarray(seg[:, index : index + t]), k_segments=jnp.asarray(seg))
    slots = dict(q_slots=index + jnp.arange(t, dtype=jnp.int32), k_slots=jnp.arange(s, dtype=jnp.int32))
    return (q, k, v), {**slots, **segs}


IMPLS = {
    "blockwise": ATTENTION_IMPLS.get("blockwise"),
    "sdpa_xla": functools.partial(attention.sdpa_attention, implementation="xla"),  # the cudnn call's math
}
CASES = {
    "H4K1": lambda: self_case(4, 1),
    "H4K2": lambda: self_case(4, 2),
    "H4K4-T64": lambda: self_case(4, 4, t=64),  # T a multiple of the block
    "cache-H4K2": cache_case,
}


def value_and_grads(fn, qkv, mask_args, block_size=BLOCK):
    """(out, (dq, dk, dv)) of `sum(fn(q, k, v) * w)` for a fixed random w."""
    w = jnp.asarray(np.random.RandomState(9).randn(*qkv[0].shape), jnp.float32)

    def loss(q, k, v):
        out = fn(q, k, v, **mask_args, block_size=block_size)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)
    return out, grads


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_values_and_gradients_match_materialized(impl, case):
    qkv, mask_args = CASES[case]()
    ref_out, ref_grads = value_and_grads(ATTENTION_IMPLS.get("materialized"), qkv, mask_args)
    out, grads = value_and_grads(IMPLS[impl], qkv, mask_args)
    assert out.shape == qkv[0].shape and out.dtype == jnp.float32
    assert max_diff(out, ref_out) <= TOL
    for name, g, ref in zip("qkv", grads, ref_grads, strict=True):
        assert g.shape == ref.shape and max_diff(g, ref) <= TOL, name
        assert float(jnp.abs(ref).max()) > 0.1, name  # a real gradient, not zeros on both sides


def test_blockwise_one_block_and_a_block_larger_than_the_sequence():
    qkv, mask_args = self_case(4, 2)
    ref_out, ref_grads = value_and_grads(ATTENTION_IMPLS.get("materialized"), qkv, mask_args)
    for block in (7, 512):  # ragged blocks (45 = 6*7 + 3) / one block clamped to T
        out, grads = value_and_grads(ATTENTION_IMPLS.get("blockwise"), qkv, mask_args, block_size=block)
        assert max_diff(out, ref_out) <= TOL
        assert max(max_diff(g, r) for g, r in zip(grads, ref_grads, strict=True)) <= TOL


def test_decode_step_one_query_over_the_cache():
    qkv, mask_args = cache_case(t=1, index=30)
    ref_out, ref_grads = value_and_grads(ATTENTION_IMPLS.get("materialized"), qkv, mask_args)
    out, grads = value_and_grads(ATTENTION_IMPLS.get("blockwise"), qkv, mask_args)
    assert max_diff(out, ref_out) <= TOL
    assert max(max_diff(g, r) for g, r in zip(grads, ref_grads, strict=True)) <= TOL


def block_lists(qs, ks, qseg, kseg, bq, bk):
    """[[key blocks of query block i]], [[query blocks of key block j]] as lists."""
    needed = _needed_blocks(qs, ks, qseg, kseg, bq, bk)
    (k_order, k_count), (q_order, q_count) = _block_lists(needed), _block_lists(needed.T)
    keys = [k_order[i, : k_count[i]].tolist() for i in range(needed.shape[0])]
    return keys, [q_order[j, : q_count[j]].tolist() for j in range(needed.shape[1])]


def test_block_lists_skip_what_the_causal_mask_rules_out():
    slots, one = jnp.arange(64, dtype=jnp.int32), jnp.ones((1, 64), jnp.int32)
    keys, queries = block_lists(slots, slots, one, one, 16, 16)
    assert keys == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert queries == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [3]]
    # KV cache: 13 queries at slots 20..32 read key blocks [0,16) [16,32) [32,48), never [48,64).
    qs = 20 + jnp.arange(13, dtype=jnp.int32)
    keys, queries = block_lists(qs, slots, one[:, :13], one, 13, 16)
    assert keys == [[0, 1, 2]] and queries == [[0], [0], [0], []]


def test_block_lists_skip_the_other_sequences_of_a_packed_row():
    """A shared prompt (segment 1, 16 tokens) and three 16-token completions continuing it, then a
    32-token sequence (segment 2): each completion's block reads the prompt's and its own, not its
    siblings'; the last sequence reads only its own two blocks. Two rows: the union of their needs."""
    branch = lambda b: 1 | (b << BRANCH_SHIFT)  # noqa: E731
    row = np.repeat([1, branch(1), branch(2), branch(3), 2], [16, 16, 16, 16, 32]).astype(np.int32)
    slots = jnp.arange(96, dtype=jnp.int32)
    seg = jnp.asarray(row[None])
    keys, queries = block_lists(slots, slots, seg, seg, 16, 16)
    assert keys == [[0], [0, 1], [0, 2], [0, 3], [4], [4, 5]]
    assert queries == [[0, 1, 2, 3], [1], [2], [3], [4, 5], [5]]
    other = np.repeat([3, 4], [48, 48]).astype(np.int32)  # a second row: two 48-token sequences
    keys, _ = block_lists(slots, slots, *(jnp.asarray(np.stack([row, other])),) * 2, 16, 16)
    assert keys == [[0], [0, 1], [0, 1, 2], [0, 3], [3, 4], [3, 4, 5]]


def test_blockwise_never_reads_the_blocks_of_other_sequences():
    """NaN in the keys and values of one packed sequence: the materialized reference turns NaN everywhere
    (0 * NaN in probs @ v), blockwise keeps every other sequence's outputs and gradients finite and
    equal to those on clean inputs."""
    t, bs = 64, 16
    seg = jnp.asarray(np.repeat([1, 2, 3], [16, 16, 32]).astype(np.int32)[None])
    slots = jnp.arange(t, dtype=jnp.int32)
    rng = np.random.RandomState(3)
    q, k, v = (jnp.asarray(rng.randn(1, t, n, 8), jnp.float32) for n in (4, 2, 2))
    dirty = [x.at[:, 16:32].set(jnp.nan) for x in (k, v)]  # segment 2's block
    mask_args = dict(q_slots=slots, k_slots=slots, q_segments=seg, k_segments=seg)
    fn = ATTENTION_IMPLS.get("blockwise")
    assert np.isnan(np.asarray(ATTENTION_IMPLS.get("materialized")(q, *dirty, **mask_args))[:, 32:]).any()
    out, clean = fn(q, *dirty, **mask_args, block_size=bs), fn(q, k, v, **mask_args, block_size=bs)
    others = np.r_[0:16, 32:64]
    assert np.array_equal(np.asarray(out)[:, others], np.asarray(clean)[:, others])
    _, grads = value_and_grads(fn, (q, *dirty), mask_args, block_size=bs)
    _, ref = value_and_grads(fn, (q, k, v), mask_args, block_size=bs)
    for g, r in zip(grads, ref, strict=True):
        assert np.array_equal(np.asarray(g)[:, others], np.asarray(r)[:, others])


def test_blockwise_never_reads_skipped_key_blocks():
    """NaN in the cache blocks past the last one any query can see: the materialized reference turns
    NaN (0 * NaN in probs @ v), blockwise does not read them and equals the reference on a clean cache."""
    (q, k, v), mask_args = cache_case(t=13, s=64, index=20)  # queries end at slot 32: blocks 48.. unread
    dirty = [x.at[:, 48:].set(jnp.nan) for x in (k, v)]
    fn = ATTENTION_IMPLS.get("blockwise")
    out = fn(q, *dirty, **mask_args, block_size=BLOCK)
    assert np.isnan(np.asarray(ATTENTION_IMPLS.get("materialized")(q, *dirty, **mask_args))).any()
    ref = ATTENTION_IMPLS.get("materialized")(q, k, v, **mask_args)
    assert max_diff(out, ref) <= TOL
    # The backward skips them too: finite gradients, zero for the unread keys, the clean ones elsewhere.
    _, grads = value_and_grads(fn, (q, *dirty), mask_args)
    _, clean = value_and_grads(fn, (q, k, v), mask_args)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert not np.asarray(grads[1][:, 48:]).any() and not np.asarray(grads[2][:, 48:]).any()
    assert max(max_diff(g, c) for g, c in zip(grads, clean, strict=True)) == 0.0


# bf16 inputs vs the float32 reference on the same (rounded) inputs, measured on H4K2: max |d| 0.0076 for
# blockwise, 0.0101 for sdpa_xla and for the materialized bf16 path itself (bf16 probabilities, output).
BF16_TOL = 0.03


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_runs_and_is_close_to_float32(impl):
    (q, k, v), mask_args = self_case(4, 2, dtype=jnp.bfloat16)
    out = IMPLS[impl](q, k, v, **mask_args, block_size=BLOCK)
    assert out.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = ATTENTION_IMPLS.get("materialized")(*f32, **mask_args)
    assert max_diff(out, ref) <= BF16_TOL
    grads = value_and_grads(IMPLS[impl], (q, k, v), mask_args)[1]
    assert all(g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


MESHES = {
    "auto": lambda: sharding.make_mesh(data=2, fsdp=2, tensor=2),  # the trainer's mesh
    "explicit": lambda: jax.make_mesh((2, 2, 2), sharding.MESH_AXES),  # jax's default axis types
}


@pytest.mark.parametrize("mesh_kind", MESHES)
@pytest.mark.parametrize("impl", IMPLS)
def test_sharded_batch_and_heads_equal_one_device_without_gathers(impl, mesh_kind):
    """Batch over ("data", "fsdp"), heads over "tensor" (8 simulated devices) == one device; the compiled
    step moves no activations between devices (no all-gather / all-to-all; the scalar loss all-reduces)."""
    (q, k, v), mask_args = self_case(4, 2, t=40)
    qkv = [jnp.concatenate([x, x[::-1]]) for x in (q, k, v)]  # B=6 -> pad to 8 rows below
    qkv = [jnp.concatenate([x, x[:2]]) for x in qkv]
    segs = {
        n: jnp.concatenate([mask_args[n], mask_args[n][::-1], mask_args[n][:2]])
        for n in ("q_segments", "k_segments")
    }
    mask_args = {**mask_args, **segs}
    ref_out, ref_grads = value_and_grads(IMPLS[impl], qkv, mask_args)

    mesh = MESHES[mesh_kind]()
    heads = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
    rows = NamedSharding(mesh, P(("data", "fsdp"), None))
    w = jnp.asarray(np.random.RandomState(9).randn(*qkv[0].shape), jnp.float32)

    def loss(q, k, v, segs, w):
        out = IMPLS[impl](q, k, v, **{**mask_args, **segs}, block_size=BLOCK)
        return jnp.sum(out * w), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    args = [jax.device_put(x, heads) for x in qkv] + [jax.device_put(segs, rows), jax.device_put(w, heads)]
    (_, out), grads = step(*args)
    assert out.sharding.is_equivalent_to(heads, 4) and grads[1].sharding.is_equivalent_to(heads, 4)
    assert max_diff(out, ref_out) <= TOL
    assert max(max_diff(g, r) for g, r in zip(grads, ref_grads, strict=True)) <= TOL
    hlo = step.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def attention_temp_bytes(name: str, b, t, h, kv, hd, dtype, block_size=512) -> int:
    """Compiled temp bytes of jitted fwd+bwd (grads of q, k, v) of one attention call, from shapes."""
    fn = ATTENTION_IMPLS.get(name)
    slots = jnp.arange(t, dtype=jnp.int32)

    def grads(q, k, v, seg, cot):
        args = dict(q_slots=slots, k_slots=slots, q_segments=seg, k_segments=seg, block_size=block_size)
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **args), q, k, v)
        return vjp(cot)

    q = jax.ShapeDtypeStruct((b, t, h, hd), dtype)
    k = jax.ShapeDtypeStruct((b, t, kv, hd), dtype)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    compiled = jax.jit(grads).lower(q, k, k, seg, q).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_temp_memory_grows_linearly_materialized_quadratically():
    shape = dict(b=1, h=2, kv=1, hd=16, dtype=jnp.float32)
    ratio = {
        name: attention_temp_bytes(name, t=4096, **shape) / attention_temp_bytes(name, t=2048, **shape)
        for name in ("materialized", "blockwise")
    }
    assert ratio["materialized"] >= 3.5 and ratio["blockwise"] <= 2.5, ratio


def test_splash_fails_clearly_off_tpu():
    qkv, mask_args = self_case(4, 2)
    with pytest.raises(NotImplementedError, match="needs a TPU.*'cpu'"):
        ATTENTION_IMPLS.get("splash")(*qkv, **mask_args)


def test_cudnn_rejects_float32_with_the_way_out():
    qkv, mask_args = self_case(4, 2)
    with pytest.raises(ValueError, match="bfloat16/float16.*blockwise"):
        ATTENTION_IMPLS.get("cudnn")(*qkv, **mask_args)


def test_auto_resolves_by_backend_and_dtype(monkeypatch):
    assert set(ATTENTION_IMPLS.names()) == {"blockwise", "cudnn", "materialized", "splash"}
    assert resolve_attention_impl("auto") == "blockwise"  # the tests run on CPU
    for backend, dtype, expected in [
        ("gpu", "bfloat16", "cudnn"),
        ("gpu", "float32", "blockwise"),
        ("tpu", "float32", "splash"),
        ("cpu", "bfloat16", "blockwise"),
    ]:
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert resolve_attention_impl("auto", dtype) == expected, backend
        assert resolve_attention_impl("materialized", dtype) == "materialized"
    with pytest.raises(KeyError, match="valid names: blockwise, cudnn, materialized, splash"):
        resolve_attention_impl("flash")


# cuDNN (bf16) vs the float32 reference on the same rounded inputs: bounded like BF16_TOL.
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["H4K2", "cache-H4K2"])
def test_cudnn_on_gpu_matches_materialized(case):
    qkv, mask_args = CASES[case]()
    qkv16 = [x.astype(jnp.bfloat16) for x in qkv]
    ref_out, ref_grads = value_and_grads(
        ATTENTION_IMPLS.get("materialized"), [x.astype(jnp.float32) for x in qkv16], mask_args
    )
    out, grads = value_and_grads(ATTENTION_IMPLS.get("cudnn"), qkv16, mask_args)
    assert max_diff(out, ref_out) <= BF16_TOL
    for g, ref in zip(grads, ref_grads, strict=True):
        assert max_diff(g, ref) <= BF16_TOL * max(1.0, float(jnp.abs(ref).max()))
