"""The chunked paths skip the key blocks that local chunks hide, as they skip the ones a window hides.

Local chunks (config.local_chunk = C, Llama 4's chunked attention) let query i see key j only where
floor(pos_q(i) / C) == floor(pos_k(j) / C). A key block in no chunk that a row of the query block is in is
hidden from the whole query block: impl_numpy's core, impl_tf's (in an eager call, where the positions are
values) and impl_jax's (lax.switch, on traced positions) never read it.

Seen as in test_chunked_masked_rows.py: a NaN in one key's value reaches every row of the stages (0 x NaN
in the attend matmul), and on a chunked path exactly the rows of the query blocks that read the key block
holding it. So the rows of every query block whose chunks of positions miss that key block's stay finite
and equal the float64 stages of the finite call; the rows that share the poisoned key's chunk are NaN (the
NaN is live). Masking alone, without the skip, leaves every row NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

import impl_numpy
import weights
from conformance.suite.tolerance import assert_close

B, T, D, BLOCK, CHUNK = 2, 16, 8, 4, 4
POISONED_KEY = 1
MIRRORS = ["numpy", pytest.param("tf", marks=pytest.mark.tf), pytest.param("jax", marks=pytest.mark.jax)]
POSITIONS = {
    "default": None,  # 0..T-1: the chunks are the blocks
    "shifted": np.arange(2, T + 2),  # every row at i + 2: the chunks straddle the blocks
    "per_row": np.stack([np.arange(T), np.arange(T) + 3]),  # (B, T): a block's chunks are both rows'
}


def _chunked(mirror: str, config, tensors, x, value, positions, **extra) -> np.ndarray:
    options = dict(chunk_size=BLOCK, is_causal=False, **extra)
    if positions is not None:  # the keys at the queries' positions (a self-attention call's)
        options.update(positions=positions, key_positions=positions)
    if mirror == "numpy":
        return impl_numpy.multi_head_attention(config, tensors, x, x, value, **options)
    if mirror == "tf":
        tf = pytest.importorskip("tensorflow", reason="TensorFlow not installed: pip install '.[tf]'")
        import impl_tf

        as_tf = {name: tf.constant(t) for name, t in tensors.items()}
        options = {k: tf.constant(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
        return np.asarray(impl_tf.multi_head_attention(config, as_tf, tf.constant(x), tf.constant(x),
                                                       tf.constant(value), **options))
    pytest.importorskip("jax", reason="JAX not installed: pip install '.[jax]'")
    import impl_jax
    import impl_jax.adapter  # noqa: F401  (switches x64 on: a float64 call needs it)

    return np.asarray(impl_jax.apply(config, tensors, x, x, value, **options))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 0 * NaN in the reference
@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("mirror", MIRRORS)
def test_chunked_skips_the_key_blocks_local_chunks_hide(mirror, positions):
    config = weights.AttentionConfig(num_heads=2, query_dim=D, head_dim=4, local_chunk=CHUNK)
    tensors = weights.init(config, seed=5, dtype="float64")
    x = np.random.default_rng(29).standard_normal((B, T, D))
    poisoned = x.copy()
    poisoned[:, POISONED_KEY] = np.nan
    given = POSITIONS[positions]
    pos = np.broadcast_to(np.arange(T) if given is None else given, (B, T))
    got = _chunked(mirror, config, tensors, x, poisoned, given)
    want = impl_numpy.multi_head_attention(config, tensors, x, x, x, trace=[],
                                           **({} if given is None else {"positions": given, "key_positions": given}))
    key_block = pos[:, :BLOCK] // CHUNK  # the chunks of the key block that holds the NaN
    for t0 in range(0, T, BLOCK):
        rows = pos[:, t0:t0 + BLOCK] // CHUNK
        skipped = key_block.max() < rows.min() or key_block.min() > rows.max()
        if skipped:
            assert np.isfinite(got[:, t0:t0 + BLOCK]).all(), f"{mirror}: query block {t0} read the hidden NaN block"
            assert_close(f"{mirror} {positions}: query block {t0}", got[:, t0:t0 + BLOCK], want[:, t0:t0 + BLOCK],
                         config=config, dtype="float64", quantity="output", B=B, T=T, S=T)
    sees = pos // CHUNK == (pos[:, POISONED_KEY] // CHUNK)[:, None]  # (B, T): rows in the poisoned key's chunk
    assert np.isnan(got[sees]).all(), f"{mirror}: the rows that see the NaN key are not NaN"
    skipped_rows = sum(key_block.max() < (pos[:, t:t + BLOCK] // CHUNK).min() for t in range(0, T, BLOCK))
    assert skipped_rows >= 2, "the call should hide the poisoned key block from at least two query blocks"


@pytest.mark.parametrize("mirror", MIRRORS)
def test_local_chunks_alone_with_a_mask(mirror):
    """Chunks the only structure (no causal mask, no window, S a multiple of the block) and a bool mask: the
    chunked path equals the float64 stages (JAX's key loop once built its causal-edge branch here, with
    nothing to AND into the mask: the 1000-case sweep's random_961000 and 17 more)."""
    config = weights.AttentionConfig(num_heads=2, query_dim=D, head_dim=4, local_chunk=CHUNK)
    tensors = weights.init(config, seed=6, dtype="float64")
    x = np.random.default_rng(30).standard_normal((B, T, D))
    mask = np.random.default_rng(31).random((B, 1, T, T)) < 0.8
    got = _chunked(mirror, config, tensors, x, x, None, mask=mask)
    want = impl_numpy.multi_head_attention(config, tensors, x, x, x, mask=mask, trace=[])
    assert_close(f"{mirror}: chunks and a mask", got, want, config=config, dtype="float64", quantity="output",
                 B=B, T=T, S=T)
