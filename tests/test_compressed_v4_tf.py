"""impl_tf/compressed.py (DeepSeek V4's layer in keras.ops) on Keras's TensorFlow backend against the NumPy
reference, the three kinds, batch 2: a causal prefill in float64 and float32; the trace's stage names are the
reference's. (The same rows through the cache, present_* fed back as past_*, copying and in place, and the
block-wise path: tests/test_compressed_v4_keras_paths.py; Keras's jax and torch backends:
tests/test_keras_backends.py, float32 prefill and decode.) In float16 and bfloat16: run_case on the three grid cases and each
traced stage's dtype the reference's (about 0.4-0.8 s more, 2-core AMD EPYC VM, 2026-11-29)."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import KINDS, T, _layer, _x, stage_dtypes

from impl_numpy.compressed import compressed_attention as reference

pytest.importorskip("tensorflow")
from impl_tf._keras import keras  # noqa: E402
from impl_tf.compressed import compressed_attention  # noqa: E402

pytestmark = pytest.mark.tf

# float64: the same sums in other orders, 1e-12 of the output's size. float32: every stage rounded to float32
# against the float64 reference, 256 float32 ulps of the output's size (the csa selection is the same: its
# smallest gap at the top-k boundary is 0.014, scores of size 0.7).
BOUND = {"float64": 1e-12, "float32": 256 * float(np.finfo(np.float32).eps)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", list(BOUND))
def test_keras_reproduces_the_reference_prefill(kind, dtype):
    ops = keras.ops
    config, t = _layer(kind)
    x = _x()
    trace, keras_trace = [], []
    want = reference(config, t, x, np.arange(T), trace=trace)
    got = compressed_attention(config, t, x.astype(dtype), np.arange(T), trace=keras_trace)
    assert [e.stage for e in keras_trace] == [e.stage for e in trace]
    if kind == "csa":
        chosen = {e.stage: e.value for e in trace}["indexer.selection"]
        np.testing.assert_array_equal(ops.convert_to_numpy({e.stage: e.value for e in keras_trace}["indexer.selection"]),
                                      chosen)
    scale = np.abs(want).max()
    assert np.abs(ops.convert_to_numpy(got).astype(np.float64) - want).max() <= BOUND[dtype] * scale


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode"])
def test_the_tf_column_passes_the_grid_cases(name):
    """`mha check`'s judgement (run_case through the adapter, float32) of the grid's V4 cases: the forward and
    every gradient (the layer's input, every tensor, the cache) by the backend's own autodiff."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "tf", dtype="float32")
    grads = {c.name for c in result.comparisons if c.name.startswith("grad ")}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"grad query", "grad sinks", "grad compressor.gate.kernel"} <= grads, sorted(grads)


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode", "v4_sliding_prefill"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tf_column_passes_the_grid_cases_in_16_bits(name, dtype):
    """run_case's judgement in float16 and bfloat16 (the stages in float32, stored in 16 bits where the reference
    stores them): the output within 3x the 16-bit reference's own error, and every gradient against the 16-bit
    reference's (impl_numpy.compressed_backward in the dtype); those whose allowance is not well below their
    size are reported not judged, the output projection's gradient is judged."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "tf", dtype=dtype)
    judged = {c.name for c in result.comparisons if c.judged}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"output", "grad output.kernel"} <= judged, sorted(judged)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tf_mirror_stores_each_stage_where_the_reference_does_in_16_bits(dtype):
    """Each traced stage in the dtype the reference's 16-bit run stores it in (the storage dtype; the index
    scores float32, the selection int64): a stage kept in float32 where the reference rounds, or rounded where
    it keeps float32, shows here, where the 16-bit bar cannot see it (docs/spec-frontier.md, "What 16 bits
    cannot catch")."""
    assert stage_dtypes("tf", dtype) == stage_dtypes("numpy", dtype)
