"""A query row with no allowed key on the chunked paths (chunk_size=), every
mirror against the float64 NumPy stages, for each masked_row policy.

The chunked paths skip the key blocks that causality (or a window) hides from
a whole query block; a row whose every key is hidden so has all its key
blocks skipped and must still follow docs/spec.md's masked-row policy:
"zero" context 0, "uniform" the mean of V over all S keys, "nan" NaN.

The call: bottom_right causal with T = 8 queries and S = 4 keys, so query i
sees keys j <= i - 4: rows 0..3 see none. Batch 0 is finite. Batch 1 holds a
NaN in the value of key 2, which rows 0..5 cannot see: the stages spread it
to every row (0 x NaN), but the chunked paths never read a key block hidden
from a whole query block (docs/spec.md, "Choices where the issues were
silent", the NaN bullet), so there it reaches only the rows that read key
2's block: those that give key 2 a nonzero (or NaN) weight. With blocks of 1
and 2 (both aligned with T and S, in every mirror) those are exactly the rows
whose weight on key 2 is not 0. So the expected output is the float64 stages'
of the finite call, NaN on those rows: a "zero" empty row stays the finite
0-context row, a "uniform" or "nan" empty row, whose weights over every key
include key 2's, is NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

import impl_numpy
import weights
from conformance.suite.tolerance import assert_close

B, T, S, D = 2, 8, 4, 8
POISONED = (1, 2)  # (batch, key): the value input that holds a NaN
CALL = dict(is_causal=True, causal_alignment="bottom_right")
MIRRORS = ["numpy", pytest.param("tf", marks=pytest.mark.tf), pytest.param("jax", marks=pytest.mark.jax)]


def _config(masked_row: str) -> weights.AttentionConfig:
    return weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=D, head_dim=4, masked_row=masked_row)


def _inputs():
    """query (B, T, D), key (B, S, D), the finite value (B, S, D) and the value with the NaN."""
    rng = np.random.default_rng(27)
    query, key, value = (rng.standard_normal((B, L, D)) for L in (T, S, S))
    poisoned = value.copy()
    poisoned[POISONED[0], POISONED[1], 0] = np.nan  # one feature: the value projection spreads it over V
    return query, key, value, poisoned


def _expected(config, tensors, query, key, value) -> np.ndarray:
    """The float64 stages' output (B, T, O) of the finite call, NaN on the rows
    of the poisoned batch that give the poisoned key a weight other than 0."""
    out, w = impl_numpy.multi_head_attention(config, tensors, query, key, value, return_weights=True, trace=[],
                                             **CALL)  # w (B, N, T, S)
    b, j = POISONED
    reads = (w[b, :, :, j] != 0).any(axis=0)  # (T,): NaN != 0 too, so a "nan" empty row reads it
    out = out.copy()
    out[b, reads] = np.nan
    return out


def _chunked(mirror: str, config, tensors, query, key, value, chunk_size: int) -> np.ndarray:
    """The mirror's chunked call on float64 inputs -> output (B, T, O) as NumPy."""
    options = dict(CALL, chunk_size=chunk_size)
    if mirror == "numpy":
        return impl_numpy.multi_head_attention(config, tensors, query, key, value, **options)
    if mirror == "tf":
        tf = pytest.importorskip("tensorflow", reason="TensorFlow not installed: pip install '.[tf]'")
        import impl_tf

        as_tf = {name: tf.constant(t) for name, t in tensors.items()}
        out = impl_tf.multi_head_attention(config, as_tf, tf.constant(query), tf.constant(key), tf.constant(value),
                                           **options)
        return np.asarray(out)
    pytest.importorskip("jax", reason="JAX not installed: pip install '.[jax]'")
    import impl_jax
    import impl_jax.adapter  # noqa: F401  (switches x64 on: a float64 call needs it)

    return np.asarray(impl_jax.apply(config, tensors, query, key, value, **options))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN x 0 in a mirror's blocks
@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("chunk_size", [1, 2])
@pytest.mark.parametrize("mirror", MIRRORS)
def test_rows_whose_key_blocks_are_all_skipped_follow_masked_row(mirror, chunk_size, masked_row):
    config = _config(masked_row)
    tensors = weights.init(config, seed=27, dtype="float64")
    query, key, value, poisoned = _inputs()
    want = _expected(config, tensors, query, key, value)
    got = _chunked(mirror, config, tensors, query, key, poisoned, chunk_size)
    label = f"{mirror} chunk_size={chunk_size} masked_row={masked_row}"
    nan_rows, want_rows = np.isnan(got).any(axis=-1), np.isnan(want).any(axis=-1)  # (B, T)
    assert np.array_equal(nan_rows, want_rows), (
        f"{label}: NaN rows {nan_rows.astype(int).tolist()}, expected {want_rows.astype(int).tolist()} "
        f"(rows 0..3 have no key; row i sees keys 0..i-4)")
    assert_close(f"{label} output", got, want, config=config, dtype="float64", quantity="output", B=B, T=T, S=S)
