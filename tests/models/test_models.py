"""The decoder equals transformers (torch CPU, float32): plain, padded, packed, KV-cache, remat, bf16.

Blockwise attention (blocks of 8 tokens, so T=24 spans three query and key blocks) everywhere, and the
materialized reference on a subset of the variants."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import nn
from rljax.models.tiny import build_tiny_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VARIANTS = [(f, tied) for f in ("qwen2", "qwen3", "llama") for tied in (True, False)]
IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in VARIANTS]
TOL = 1e-5  # the bound for float32 logits vs transformers
B, T = 3, 24  # one shape for most tests so each config compiles once
BLOCK = 8  # blockwise attention block: T and the cache lengths span several blocks, some ragged
# (variant, attention implementation): blockwise for every variant, the materialized reference for half.
IMPL_CASES = [(v, "blockwise") for v in VARIANTS] + [(v, "materialized") for v in VARIANTS[::2]]
IMPL_IDS = [f"{f}-{'tied' if t else 'untied'}-{impl}" for (f, t), impl in IMPL_CASES]

fwd = jax.jit(models.forward, static_argnums=0)
hid = jax.jit(models.hidden_states, static_argnums=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(family, tied) -> (ModelConfig, params, transformers model), built once for the module."""
    out = {}
    for family, tied in VARIANTS:
        path = tmp_path_factory.mktemp(f"{family}_{tied}")
        build_tiny_checkpoint(path, family, tie_word_embeddings=tied, seed=len(out))
        config, params = models.load_hf_checkpoint(path)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[family, tied] = (config, params, ref)
    return out


def with_impl(config, impl: str):
    return dataclasses.replace(config, attention_impl=impl, attention_block_size=BLOCK)


def hf_logits(ref, ids, **kw) -> np.ndarray:
    with torch.no_grad():
        kw = {k: torch.as_tensor(np.asarray(v)) for k, v in kw.items()}
        return ref(torch.as_tensor(np.asarray(ids)), **kw).logits.numpy()


def rand_ids(seed: int, shape=(B, T)) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 512, shape).astype(np.int32)


def test_loaded_config_picks_attention_by_backend(tiny):
    config = tiny[VARIANTS[0]][0]
    assert (
        config.attention_impl == "auto"
        and models.resolve_attention_impl(config.attention_impl) == "blockwise"
    )


@pytest.mark.parametrize("variant,impl", IMPL_CASES, ids=IMPL_IDS)
def test_logits_and_hidden_match_transformers(tiny, variant, impl):
    config, params, ref = tiny[variant]
    assert config.family == variant[0] and config.tie_word_embeddings == variant[1]
    config = with_impl(config, impl)
    ids = rand_ids(1)
    with torch.no_grad():
        out = ref(torch.as_tensor(ids), output_hidden_states=True)
    logits = np.asarray(fwd(config, params, ids))
    assert logits.shape == (B, T, 512) and logits.dtype == np.float32
    assert np.abs(logits - out.logits.numpy()).max() <= TOL
    assert np.abs(logits).max() > 1.0  # far from uniform: a wrong mapping cannot hide in the noise
    hidden = np.asarray(hid(config, params, ids))
    assert hidden.shape == (B, T, config.hidden_size) and hidden.dtype == np.float32
    assert np.abs(hidden - out.hidden_states[-1].numpy()).max() <= TOL


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("variant,impl", IMPL_CASES, ids=IMPL_IDS)
def test_padded_batch_matches_each_row_alone(tiny, variant, impl, side):
    config, params, ref = tiny[variant]
    config = with_impl(config, impl)
    lengths = [T, 17, 9]
    ids, seg = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    rows = [rand_ids(10 + i, (1, n))[0] for i, n in enumerate(lengths)]
    for i, row in enumerate(rows):
        sl = slice(T - len(row), T) if side == "left" else slice(0, len(row))
        ids[i, sl], seg[i, sl] = row, 1
    logits = np.asarray(fwd(config, params, ids, segment_ids=seg))
    assert np.isfinite(logits).all()  # padding rows attend to padding: finite, never NaN
    for i, row in enumerate(rows):
        sl = slice(T - len(row), T) if side == "left" else slice(0, len(row))
        assert np.abs(logits[i, sl] - hf_logits(ref, row[None])[0]).max() <= TOL
    # transformers on the same padded batch (its mask + explicit restarted positions) agrees too.
    pos = np.maximum(np.cumsum(seg, axis=1) - 1, 0)
    ref_batch = hf_logits(ref, ids, attention_mask=seg, position_ids=pos)
    assert np.abs(np.where(seg[..., None] == 1, logits - ref_batch, 0.0)).max() <= TOL


@pytest.mark.parametrize("variant,impl", IMPL_CASES, ids=IMPL_IDS)
def test_packed_segments_match_their_own_forward(tiny, variant, impl):
    config, params, ref = tiny[variant]
    config = with_impl(config, impl)
    packings = [[10, 8, 6], [24], [5, 12, 3]]  # the last row ends in 4 padding tokens (segment 0)
    ids, seg = rand_ids(2), np.zeros((B, T), np.int32)
    for i, lens in enumerate(packings):
        seg[i, : sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
    logits = np.asarray(fwd(config, params, ids, segment_ids=seg))
    for i, lens in enumerate(packings):
        start = 0
        for n in lens:
            piece = ids[i, start : start + n]
            assert np.abs(logits[i, start : start + n] - hf_logits(ref, piece[None])[0]).max() <= TOL
            start += n
    # Explicit positions equal the defaults derived from the segment ids.
    pos = np.asarray(models.layers.positions_from_segments(jnp.asarray(seg)))
    assert pos[0].tolist() == [*range(10), *range(8), *range(6)]
    np.testing.assert_array_equal(
        np.asarray(fwd(config, params, ids, positions=pos, segment_ids=seg)), logits
    )


# Two variants cover the cache path (q/k/v bias + tied; q/k norm + lm_head); RoPE is shared with forward.
@pytest.mark.parametrize("impl", ["blockwise", "materialized"])
@pytest.mark.parametrize("variant", [("qwen2", True), ("qwen3", False)], ids=str)
def test_greedy_decode_with_cache_equals_repeated_full_forward(tiny, variant, impl):
    config, params, _ = tiny[variant]
    config = with_impl(config, impl)
    prompt_len, steps = 7, 8
    lengths = [7, 4]  # left-padded prompts
    prompt, pseg = np.zeros((2, prompt_len), np.int32), np.zeros((2, prompt_len), np.int32)
    for i, n in enumerate(lengths):
        prompt[i, prompt_len - n :], pseg[i, prompt_len - n :] = rand_ids(20 + i, (1, n))[0], 1
    cache = models.init_cache(config, 2, prompt_len + steps)
    logits, cache = jax.jit(models.prefill, static_argnums=0)(config, params, cache, prompt, segment_ids=pseg)
    np.testing.assert_allclose(logits, fwd(config, params, prompt, segment_ids=pseg), atol=TOL, rtol=0)
    step = jax.jit(models.decode_step, static_argnums=0)
    cached_tokens, last = [], logits[:, -1]
    for _ in range(steps):
        tok = jnp.argmax(last, axis=-1).astype(jnp.int32)
        cached_tokens.append(np.asarray(tok))
        last, cache = step(config, params, cache, tok)
    # Reference: a full forward over a fixed buffer (trailing slots are padding, invisible causally).
    buf, bseg = np.zeros((2, prompt_len + steps), np.int32), np.zeros((2, prompt_len + steps), np.int32)
    buf[:, :prompt_len], bseg[:, :prompt_len] = prompt, pseg
    full_tokens = []
    for i in range(steps):
        full = np.asarray(fwd(config, params, buf, segment_ids=bseg))[:, prompt_len + i - 1]
        full_tokens.append(full.argmax(-1))
        buf[:, prompt_len + i], bseg[:, prompt_len + i] = full_tokens[-1], 1
    np.testing.assert_array_equal(np.stack(cached_tokens), np.stack(full_tokens))
    assert len(set(np.stack(full_tokens).ravel().tolist())) > 1  # not a degenerate constant output
    # Logits of the final cached step equal the full forward at that position.
    final = np.asarray(fwd(config, params, buf, segment_ids=bseg))[:, -1]
    np.testing.assert_allclose(last, final, atol=TOL, rtol=0)


def test_remat_gives_identical_logits_and_gradients(tiny):
    config, params, _ = tiny["qwen3", False]
    config = with_impl(config, "blockwise")
    remat = dataclasses.replace(config, remat="full")
    ids = rand_ids(3)

    def loss(cfg, p):
        return jnp.mean(jax.nn.log_softmax(models.forward(cfg, p, ids))[..., 0])

    g0 = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)(config, params)
    g1 = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)(remat, params)
    np.testing.assert_array_equal(fwd(remat, params, ids), fwd(config, params, ids))
    # Remat changes XLA's fusion order, so gradients agree to float32 rounding relative to each leaf's
    # scale (element-wise relative error is ill-conditioned where large terms cancel).
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * np.abs(np.asarray(a)).max()
    assert float(jnp.abs(g0["layers"]["q_norm"]["scale"]).max()) > 0


# bf16 compute over float32 master params vs float32 compute, measured on these tiny models (logits
# ~|5|, 2 layers, 72 tokens): max |dlogp| 0.074-0.160, mean 0.0117-0.0131 over the six variants with
# materialized attention, 0.075-0.142 and 0.0113-0.0127 with blockwise attention (blocks of 8). The
# bounds leave headroom over that; a broken forward or a wrong mapping moves log-probs by ~1 or more.
BF16_MAX_DLOGP, BF16_MEAN_DLOGP = 0.25, 0.025


@pytest.mark.parametrize("variant", VARIANTS[::2], ids=IDS[::2])
def test_bf16_compute_matches_fp32_within_tolerance(tiny, variant):
    config, params, _ = tiny[variant]
    config = with_impl(config, "blockwise")
    bf16 = dataclasses.replace(config, compute_dtype="bfloat16")
    ids = rand_ids(4)
    lp32 = jax.nn.log_softmax(fwd(config, params, ids))
    lp16 = jax.nn.log_softmax(fwd(bf16, params, ids))
    assert lp16.dtype == jnp.float32 and params["embed"]["embedding"].dtype == jnp.float32
    diff = np.abs(np.asarray(lp16 - lp32))
    assert diff.max() <= BF16_MAX_DLOGP and diff.mean() <= BF16_MEAN_DLOGP, (diff.max(), diff.mean())
    assert diff.max() > 1e-4  # bf16 really ran (not silently float32)
    h16 = hid(bf16, params, ids)
    assert h16.dtype == jnp.float32


def test_unrolled_layers_equal_the_scanned_stack_forward_and_backward(tiny):
    config, params, _ = tiny[VARIANTS[0]]
    ids = rand_ids(7)

    def loss(p, c):
        return models.hidden_states(c, p, ids).sum()

    scanned = dataclasses.replace(config, unroll_layers=1)
    assert nn.layer_unroll(scanned) == 1 and nn.layer_unroll(config) == config.num_layers  # auto: shallow
    out = [jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, c) for c in (scanned, config)]
    np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[0][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_unroll_keeps_one_compiled_body_for_deep_stacks(tiny):
    config = tiny[VARIANTS[0]][0]
    deep = dataclasses.replace(config, num_layers=nn.AUTO_UNROLL_MAX_LAYERS + 1)
    assert nn.layer_unroll(deep) == 1
    assert nn.layer_unroll(dataclasses.replace(deep, unroll_layers=3)) == 3
    assert nn.layer_unroll(dataclasses.replace(config, unroll_layers=99)) == config.num_layers
