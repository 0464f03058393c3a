"""The chunked path never holds a (T, S) array, and agrees with the plain path."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import weights
from impl_numpy import multi_head_attention


def peak_bytes(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run_long(T, chunk, causal=True, dtype="float32"):
    config = weights.AttentionConfig(num_heads=4, query_dim=64, head_dim=16)
    tensors = weights.init(config, seed=0, dtype=dtype)
    x = np.random.default_rng(0).standard_normal((1, T, 64)).astype(dtype)
    out, peak = peak_bytes(lambda: multi_head_attention(config, tensors, x, is_causal=causal, chunk_size=chunk))
    block = config.num_heads * chunk * chunk * np.dtype(dtype).itemsize  # one (B, N, chunk, chunk) temporary
    ts = config.num_heads * T * T * np.dtype(dtype).itemsize  # the weights the plain path would hold
    return config, tensors, x, out, peak, block, ts


@pytest.mark.parametrize("causal", [False, True])
def test_peak_memory_is_blocks_not_t_by_s(causal):
    _, _, x, out, peak, block, ts = run_long(2048, 256, causal)
    # Inputs/outputs/projections plus a handful of block temporaries; the
    # plain path's (B, N, T, S) weights alone would be `ts` = 64 MiB.
    budget = 6 * (x.nbytes + out.nbytes) + 8 * block
    assert peak < budget, f"peak {peak / 2**20:.1f} MiB > budget {budget / 2**20:.1f} MiB (T x S would be {ts / 2**20:.0f} MiB)"


@pytest.mark.slow
def test_16384_runs_in_bounded_memory():
    _, _, x, out, peak, block, ts = run_long(16384, 512, True)
    print(f"T=S=16384 chunked: peak {peak / 2**20:.1f} MiB; inputs+outputs {(x.nbytes + out.nbytes) / 2**20:.1f} MiB; "
          f"(B, N, T, S) float32 weights would be {ts / 2**20:.0f} MiB")
    assert peak < 6 * (x.nbytes + out.nbytes) + 8 * block


def test_chunked_matches_plain_at_moderate_length_float64():
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=16, head_dim=8, masked_row="uniform")
    tensors = weights.init(config, seed=1, dtype="float64")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 300, 16))
    mask = rng.random((2, 1, 300, 300)) < 0.5
    mask[0, 0, 7] = False  # a fully masked row
    for alignment in ("top_left", "bottom_right"):
        plain = multi_head_attention(config, tensors, x, mask=mask, is_causal=True, causal_alignment=alignment)
        for chunk in (1, 64, 299, 1000):
            chunked = multi_head_attention(config, tensors, x, mask=mask, is_causal=True, causal_alignment=alignment,
                                           chunk_size=chunk)
            err = np.abs(chunked - plain).max()
            assert err <= 1e-13, f"{alignment} chunk {chunk}: max abs difference {err:.3g}"
