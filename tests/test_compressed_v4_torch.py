"""impl_torch/compressed.py (DeepSeek V4's layer in PyTorch) against the NumPy reference, the three kinds: a causal
prefill and the same rows through the cache token by token (present_* fed back as past_*), batch 2, float64 and
float32; the trace's stage names are the reference's. About half a second. In float16 and bfloat16: run_case on
the three grid cases, each traced stage's dtype the reference's, and two precision bugs caught by the latter
(about 0.2-2 s more: 0.2 s in a process that has run the float32 grid tests, 2 s alone; 2-core AMD EPYC VM,
2026-11-29)."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import IN_PLACE_CUTS, KINDS, T, _layer, _x, source_mutant, stage_dtypes

from impl_numpy.compressed import cache_buffers, logical_cache
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


@pytest.mark.parametrize("kind,dtype", [(kind, torch.float64) for kind in KINDS] + [("csa", torch.float32)],
                         ids=[*KINDS, "csa-float32"])
def test_torch_in_place_is_the_copying_reference(kind, dtype):
    """The in-place cache in torch (buffers written by index assignment), batch 2, over IN_PLACE_CUTS (a prefill,
    windows closing inside calls, then token by token across boundaries): each call's output and the buffers read
    as a cache against the copying float64 reference's, within BOUND (the cache's rows: BOUND of their size)."""
    config, t = _layer(kind)
    x = _x()
    buffers = {n: torch.from_numpy(a).to(dtype) for n, a in cache_buffers(config, 2, T).items()}
    past = None
    for a, b in zip(IN_PLACE_CUTS, IN_PLACE_CUTS[1:]):
        want, past = reference(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
        with torch.no_grad():
            got, present = compressed_attention(config, t, torch.as_tensor(x[:, a:b], dtype=dtype), np.arange(a, b),
                                                buffers, return_cache=True, in_place=True)
        assert present is buffers
        assert np.abs(got.double().numpy() - want).max() <= BOUND[dtype] * np.abs(want).max()
        held = logical_cache(config, {n: v.double().numpy() for n, v in buffers.items()}, b)
        for name, rows in past.items():
            assert np.abs(held[name] - rows).max(initial=0) <= BOUND[dtype] * (1 + np.abs(rows).max(initial=0)), name


def test_torch_in_place_refuses_buffers_it_cannot_write():
    config, t = _layer("hca")
    buffers = {n: torch.from_numpy(a) for n, a in cache_buffers(config, 2, 8).items()}
    x = torch.zeros(2, 1, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"past\['entries'\] with in_place is written in place: it must be a torch "
                                         r"tensor of the storage dtype torch.float64 on cpu: got a ndarray"):
        compressed_attention(config, t, x, np.array([0]), {**buffers, "entries": buffers["entries"].numpy()},
                             in_place=True)
    with pytest.raises(ValueError, match=r"in_place writes the cache's buffers, for inference only.*got x"):
        compressed_attention(config, t, x.requires_grad_(), np.array([0]), buffers, in_place=True)


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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_torch_mirror_stores_each_stage_where_the_reference_does_in_16_bits(dtype):
    """Each traced stage in the dtype the reference's 16-bit run stores it in (the storage dtype; the index
    scores float32, the selection int64): a stage kept in float32 where the reference rounds, or rounded where
    it keeps float32, shows here, where the 16-bit bar cannot see it (docs/spec-frontier.md, "What 16 bits
    cannot catch")."""
    assert stage_dtypes("torch", dtype) == stage_dtypes("numpy", dtype)


# Two precision bugs of the torch mirror, one line each of impl_torch/compressed.py (the source with the line
# replaced): the 16-bit bar passes both (margins 0.26-0.32, as the correct mirror's; docs/spec-frontier.md), the
# stored dtypes do not.
PRECISION_MUTANTS = {
    # kept in float32 where the reference rounds: the gate weights enter the pool unrounded
    "gate_weights_kept_float32": ("torch.softmax(slots_gate, dim=2).to(x.dtype))", "torch.softmax(slots_gate, dim=2))"),
    # rounded where the reference keeps float32: the index scores stored in 16 bits (a rounding cast back to
    # float32 at once would keep float32's dtype: this check sees where a mirror stores, not every rounding)
    "index_scores_stored_16": (".sum(dim=2)  # compute dtype", ".sum(dim=2).to(x.dtype)"),
}


@pytest.mark.parametrize("bug", list(PRECISION_MUTANTS))
def test_a_precision_bug_changes_the_stored_dtypes(bug, monkeypatch):
    import impl_torch.adapter
    import impl_torch.compressed

    mutant = source_mutant(impl_torch.compressed, *PRECISION_MUTANTS[bug], "_v4_mutant")
    monkeypatch.setattr(impl_torch.adapter, "compressed_attention", mutant.compressed_attention)
    got, want = stage_dtypes("torch", "bfloat16"), stage_dtypes("numpy", "bfloat16")
    assert got != want, f"{bug}: every stage stored as the reference stores it"
