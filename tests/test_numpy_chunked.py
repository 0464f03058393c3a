"""The chunked path (and the fused fast path built on its core) never holds a
(T, S) array, skips the key blocks a causal mask hides, and agrees with the
stage-by-stage path."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import weights
from impl_numpy import multi_head_attention
from impl_numpy.chunked import QUERY_ROWS
from impl_numpy.functional import FUSED_BLOCK


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
        plain = multi_head_attention(config, tensors, x, mask=mask, is_causal=True, causal_alignment=alignment,
                                     trace=[])  # the stages (a trace turns the fused fast path off)
        for chunk in (1, 64, 299, 1000, None):  # None: the plain call's fused fast path
            chunked = multi_head_attention(config, tensors, x, mask=mask, is_causal=True, causal_alignment=alignment,
                                           chunk_size=chunk)
            err = np.abs(chunked - plain).max()
            assert err <= 1e-13, f"{alignment} chunk {chunk}: max abs difference {err:.3g}"


@pytest.mark.parametrize("alignment, T, S", [("top_left", 300, 300), ("bottom_right", 200, 330), ("bottom_right", 330, 200)])
@pytest.mark.parametrize("dtype, chunk", [("float32", 64), ("float32", None), ("float16", 64), ("bfloat16", 96)])
def test_blocks_meet_the_tolerance_policy(alignment, T, S, dtype, chunk):
    """float32 and 16-bit through several query and key blocks (GQA, a mask,
    causal), against the float64 stages, judged by the project's tolerance
    policy (16-bit: against 3x the stages' own error in that dtype)."""
    from conformance.tolerance import assert_close

    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=16, head_dim=8)
    tensors = weights.init(config, seed=5, dtype=dtype)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, T, 16)).astype(tensors["query.kernel"].dtype)
    kv = rng.standard_normal((2, S, 16)).astype(q.dtype)
    mask = rng.random((2, 1, T, S)) < 0.8
    options = dict(mask=mask, is_causal=True, causal_alignment=alignment)
    t64 = {name: t.astype(np.float64) for name, t in tensors.items()}
    trace = []
    expected = multi_head_attention(config, t64, q.astype(np.float64), kv.astype(np.float64), trace=trace, **options)
    same_precision = None
    if dtype != "float32":
        own = multi_head_attention(config, tensors, q, kv, trace=[], **options).astype(np.float64)
        same_precision = float(np.abs(own - expected).max())
    actual = multi_head_attention(config, tensors, q, kv, chunk_size=chunk, **options)
    assert actual.dtype == q.dtype
    assert_close(f"{dtype} chunk_size={chunk}", actual, expected, config=config, dtype=dtype, quantity="output",
                 B=2, T=T, S=S, logits=dict((e.stage, e.value) for e in trace)["logits"], same_precision_error=same_precision)


@pytest.mark.parametrize("chunk", [32, None])
def test_hidden_key_blocks_are_never_read(chunk):
    """A NaN in the last token's key and value: every row that reads its block
    gets NaN (0 * NaN in the attend matmul), so rows stay finite exactly where
    the key block holding it was skipped as hidden by the causal mask."""
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float64")
    T = 600
    x = np.random.default_rng(0).standard_normal((1, T, 8))
    kv = x.copy()
    kv[0, -1] = np.nan
    out = multi_head_attention(config, tensors, x, kv, is_causal=True, chunk_size=chunk)
    rows = min(FUSED_BLOCK if chunk is None else chunk, QUERY_ROWS)  # the query block size
    first_reading_row = (T - 1) // rows * rows  # only the last query block reaches key T-1
    finite_rows = np.isfinite(out[0]).all(axis=-1)
    assert finite_rows[:first_reading_row].all() and not finite_rows[first_reading_row:].any(), (
        f"finite rows {np.flatnonzero(finite_rows)[[0, -1]]}, expected 0..{first_reading_row - 1}")


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("mask_heads, bias_heads", [(1, None), (4, 4), (None, 1)])
@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
def test_heads_on_threads_equal_the_stages(threads, mask_heads, bias_heads, masked_row, monkeypatch):
    """Large calls split their kv heads across threads (forced here on a small
    one): masks, bias and dropout with a full or a broadcast head axis, GQA,
    fully masked rows, causal; against the float64 stages."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES", 0)
    monkeypatch.setattr(chunked, "THREADS", threads)
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2 if threads == 2 else 4, query_dim=16, head_dim=8,
                                     masked_row=masked_row, dropout=0.25)
    tensors = weights.init(config, seed=3, dtype="float64")
    rng = np.random.default_rng(4)
    B, T, S = 2, 70, 90
    q, kv = rng.standard_normal((B, T, 16)), rng.standard_normal((B, S, 16))
    options = dict(is_causal=True, causal_alignment="bottom_right", training=True,
                   dropout_mask=rng.random((B, 4, T, S)) < 0.75)
    if mask_heads:
        options["mask"] = rng.random((B, mask_heads, T, S)) < 0.7
        options["mask"][:, :, 3] = False  # fully masked rows
    if bias_heads:
        options["bias"] = rng.standard_normal((B, bias_heads, T, S))
    staged = multi_head_attention(config, tensors, q, kv, trace=[], **options)
    for chunk in (16, None):
        threaded = multi_head_attention(config, tensors, q, kv, chunk_size=chunk, **options)
        both_nan = np.isnan(threaded) & np.isnan(staged)
        assert np.array_equal(np.isnan(threaded), np.isnan(staged)), f"chunk {chunk}: NaN rows differ"
        err = np.abs(np.where(both_nan, 0, threaded - staged)).max()
        assert err <= 1e-13, f"chunk {chunk}, {threads} threads: max abs difference {err:.3g}"


def test_threaded_call_restores_blas_threads_and_raises_a_threads_error(monkeypatch):
    from threadpoolctl import threadpool_info

    from impl_numpy import chunked

    def blas_threads():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    before = blas_threads()
    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES", 0)
    monkeypatch.setattr(chunked, "THREADS", 2)
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float32")
    x = np.random.default_rng(0).standard_normal((1, 40, 8)).astype(np.float32)
    seen = []
    real_core = chunked._core

    def core_seeing_blas(*args, **kwargs):
        seen.append(blas_threads())
        return real_core(*args, **kwargs)

    monkeypatch.setattr(chunked, "_core", core_seeing_blas)
    multi_head_attention(config, tensors, x)
    assert len(seen) == 2 and all(all(n == 1 for n in s) for s in seen), f"BLAS threads inside the threads: {seen}"
    assert blas_threads() == before

    def failing_core(*args, **kwargs):
        raise RuntimeError("a thread's failure")

    monkeypatch.setattr(chunked, "_core", failing_core)
    with pytest.raises(RuntimeError, match="a thread's failure"):
        multi_head_attention(config, tensors, x)
    assert blas_threads() == before
