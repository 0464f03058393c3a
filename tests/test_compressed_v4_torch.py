"""impl_torch/compressed.py (DeepSeek V4's layer in PyTorch) against the NumPy reference, the three kinds: a causal
prefill and the same rows through the cache token by token (present_* fed back as past_*), batch 2, float64 and
float32; the trace's stage names are the reference's. About half a second."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import KINDS, T, _layer, _x

from impl_numpy.compressed import compressed_attention as reference

torch = pytest.importorskip("torch")
from impl_torch.compressed import compressed_attention  # noqa: E402

pytestmark = pytest.mark.torch

# float64: the same sums in other orders (a few ulps of the output's size). float32: the reference in float64
# against torch in float32: every stage rounds to float32 (24 bits), through softmaxes of logits of size ~1;
# 256 float32 ulps of the output's size (measured 3.2e-7 relative at most, 2-core AMD EPYC VM, 2026-11-29: a margin
# of ~100). csa's selection is the same in both dtypes: its smallest gap at the top-k boundary is 0.014 (scores
# of size 0.7), no near-tie that float32's roundings could turn.
BOUND = {torch.float64: 1e-12, torch.float32: 256 * float(np.finfo(np.float32).eps)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_torch_reproduces_the_reference_prefill_and_decode(kind, dtype):
    config, t = _layer(kind)
    x = _x()
    trace, torch_trace = [], []
    want = reference(config, t, x, np.arange(T), trace=trace)
    got = compressed_attention(config, t, torch.as_tensor(x, dtype=dtype), np.arange(T), trace=torch_trace)
    assert [e.stage for e in torch_trace] == [e.stage for e in trace]
    if kind == "csa":
        chosen = {e.stage: e.value for e in trace}["indexer.selection"]
        np.testing.assert_array_equal({e.stage: e.value for e in torch_trace}["indexer.selection"].numpy(), chosen)
    scale = np.abs(want).max()
    assert np.abs(got.double().numpy() - want).max() <= BOUND[dtype] * scale
    past, rows = None, []
    for s in range(T):
        out, past = compressed_attention(config, t, torch.as_tensor(x[:, s:s + 1], dtype=dtype), np.array([s]), past,
                                         return_cache=True)
        rows.append(out.double().numpy())
    assert np.abs(np.concatenate(rows, axis=1) - want).max() <= BOUND[dtype] * scale


def test_torch_refuses_what_the_reference_refuses():
    config, t = _layer("hca")
    with pytest.raises(ValueError, match=r"positions must start at 0 without a cache"):
        compressed_attention(config, t, torch.zeros(2, 2, 32, dtype=torch.float64), np.array([3, 4]))


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode"])
def test_the_torch_column_passes_the_grid_cases(name):
    """`mha check`'s judgement (run_case through the adapter, float32) of the grid's V4 cases: the forward and
    every gradient (the layer's input, every tensor, the cache) by the backend's own autodiff."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "torch", dtype="float32")
    grads = {c.name for c in result.comparisons if c.name.startswith("grad ")}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"grad query", "grad sinks", "grad compressor.gate.kernel"} <= grads, sorted(grads)


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode", "v4_sliding_prefill"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_torch_column_passes_the_grid_cases_in_16_bits(name, dtype):
    """run_case's judgement in float16 and bfloat16 (the stages in float32, stored in 16 bits where the reference
    stores them): the output within 3x the 16-bit reference's own error, and every gradient against the 16-bit
    reference's (impl_numpy.compressed_backward in the dtype); those whose allowance is not well below their
    size are reported not judged, the output projection's gradient is judged."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "torch", dtype=dtype)
    judged = {c.name for c in result.comparisons if c.judged}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"output", "grad output.kernel"} <= judged, sorted(judged)
