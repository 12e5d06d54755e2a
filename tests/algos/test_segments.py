"""Per-sequence totals over packed rows equal the per-row totals of the same sequences unpacked."""

import jax
import jax.numpy as jnp
import numpy as np

from rljax.algos._segments import num_sequences, sequence_totals


def test_sequence_totals_by_hand():
    x = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0, 0.5]])
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(sequence_totals(x, seg), [[3.0, 3.0, 12.0, 12.0, 12.0, 0.5]])
    np.testing.assert_array_equal(sequence_totals(x), [[15.5] * 6])


def test_sequence_totals_match_rows_and_jit():
    rng = np.random.default_rng(0)
    lengths = [5, 9, 3, 7]
    rows = [rng.normal(size=n).astype(np.float32) for n in lengths]
    packed = np.zeros((1, 32), np.float32)
    seg = np.zeros((1, 32), np.int32)
    offset = 0
    for s, r in enumerate(rows, start=1):
        packed[0, offset : offset + len(r)] = r
        seg[0, offset : offset + len(r)] = s
        offset += len(r)
    totals = jax.jit(sequence_totals)(packed, seg)
    for s, r in enumerate(rows, start=1):
        np.testing.assert_allclose(np.asarray(totals)[seg == s], r.sum(), rtol=1e-6)


def test_num_sequences_counts_segments_with_loss_tokens():
    mask = jnp.array([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 0, 0, 0, 0]])
    assert float(num_sequences(mask, seg)) == 3.0
    assert float(num_sequences(mask)) == 2.0
