"""impl_mlx/compressed.py (DeepSeek V4's layer in MLX) against the NumPy reference, the three kinds, batch 2: a
causal prefill and the same rows through the cache token by token (present_* fed back as past_*), float64 (the
CPU device) and float32; the trace's stage names are the reference's. In float16 and bfloat16: run_case on the
three grid cases and each traced stage's dtype the reference's (about 0.1 s more, 2-core AMD EPYC VM,
2026-11-29)."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import IN_PLACE_CUTS, KINDS, T, _layer, _x, stage_dtypes

from impl_numpy.compressed import cache_buffers, logical_cache
from impl_numpy.compressed import compressed_attention as reference

mx = pytest.importorskip("mlx.core")
from impl_mlx.compressed import compressed_attention  # noqa: E402

pytestmark = pytest.mark.mlx

# float64: MLX's float64 matmuls, sqrt and (through functional.exp / cos_sin) exp, cos and sin are
# float64-accurate, so the same sums in other orders: 1e-12 of the output's size. float32: every stage rounded to
# float32 against the float64 reference, 256 float32 ulps of the output's size (the csa selection is the same:
# its smallest gap at the top-k boundary is 0.014, scores of size 0.7).
BOUND = {"float64": 1e-12, "float32": 256 * float(np.finfo(np.float32).eps)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", list(BOUND))
def test_mlx_reproduces_the_reference_prefill_and_decode(kind, dtype):
    config, t = _layer(kind)
    x = _x()
    mx_dtype = {"float64": mx.float64, "float32": mx.float32}[dtype]
    trace, mlx_trace = [], []
    want = reference(config, t, x, np.arange(T), trace=trace)
    got = compressed_attention(config, t, mx.array(x.astype(dtype), dtype=mx_dtype), np.arange(T), trace=mlx_trace)
    assert [e.stage for e in mlx_trace] == [e.stage for e in trace]
    if kind == "csa":
        chosen = {e.stage: e.value for e in trace}["indexer.selection"]
        np.testing.assert_array_equal(np.array({e.stage: e.value for e in mlx_trace}["indexer.selection"]), chosen)
    scale = np.abs(want).max()
    assert np.abs(np.array(got).astype(np.float64) - want).max() <= BOUND[dtype] * scale
    past, rows = None, []
    for s in range(T):
        out, past = compressed_attention(config, t, mx.array(x[:, s:s + 1].astype(dtype), dtype=mx_dtype),
                                         np.array([s]), past, return_cache=True)
        rows.append(np.array(out).astype(np.float64))
    assert np.abs(np.concatenate(rows, axis=1) - want).max() <= BOUND[dtype] * scale


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode"])
def test_the_mlx_column_passes_the_grid_cases(name):
    """`mha check`'s judgement (run_case through the adapter, float32) of the grid's V4 cases: the forward and
    every gradient (the layer's input, every tensor, the cache) by the backend's own autodiff."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "mlx", dtype="float32")
    grads = {c.name for c in result.comparisons if c.name.startswith("grad ")}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"grad query", "grad sinks", "grad compressor.gate.kernel"} <= grads, sorted(grads)


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode", "v4_sliding_prefill"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_mlx_column_passes_the_grid_cases_in_16_bits(name, dtype):
    """run_case's judgement in float16 and bfloat16 (the stages in float32, stored in 16 bits where the reference
    stores them): the output within 3x the 16-bit reference's own error, and every gradient against the 16-bit
    reference's (impl_numpy.compressed_backward in the dtype); those whose allowance is not well below their
    size are reported not judged, the output projection's gradient is judged."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "mlx", dtype=dtype)
    judged = {c.name for c in result.comparisons if c.judged}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"output", "grad output.kernel"} <= judged, sorted(judged)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_mlx_mirror_stores_each_stage_where_the_reference_does_in_16_bits(dtype):
    """Each traced stage in the dtype the reference's 16-bit run stores it in (the storage dtype; the index
    scores float32, the selection int64): a stage kept in float32 where the reference rounds, or rounded where
    it keeps float32, shows here, where the 16-bit bar cannot see it (docs/spec-frontier.md, "What 16 bits
    cannot catch")."""
    assert stage_dtypes("mlx", dtype) == stage_dtypes("numpy", dtype)


@pytest.mark.parametrize("kind", list(KINDS))
def test_mlx_in_place_is_the_copying_reference(kind):
    """The in-place cache in MLX (slice assignment onto the caller's mx.arrays), float64 on the CPU device, batch
    2, over IN_PLACE_CUTS: each call's output and the buffers read back as a cache against the copying float64
    reference's, within BOUND (the cache's rows: BOUND of their size)."""
    config, t = _layer(kind)
    x = _x()
    buffers = {n: mx.array(a, dtype=mx.float64) for n, a in cache_buffers(config, 2, T).items()}
    past = None
    for a, b in zip(IN_PLACE_CUTS, IN_PLACE_CUTS[1:]):
        want, past = reference(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
        got, present = compressed_attention(config, t, mx.array(x[:, a:b], dtype=mx.float64), np.arange(a, b),
                                            buffers, return_cache=True, in_place=True)
        assert present is buffers
        assert np.abs(np.array(got) - want).max() <= BOUND["float64"] * np.abs(want).max()
        held = logical_cache(config, {n: np.array(v) for n, v in buffers.items()}, b)
        for name, rows in past.items():
            assert np.abs(held[name] - rows).max(initial=0) <= BOUND["float64"] * (1 + np.abs(rows).max(initial=0))
