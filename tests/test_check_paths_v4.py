"""DeepSeek V4's block-wise path (compressed_attention's chunk_size=: attend_blockwise) is a judged path of
`mha check --paths all`: the `chunked` rows of the V4 grid cases run each backend's block-wise path (a spy on its
attend_blockwise), are judged against the float64 reference (torch and MLX: forward and gradients by their autodiff
through the blocks; NumPy: forward only, its backward being the stages' VJP), and a bug planted in one backend's
block-wise path fails its chunked row while its stages row passes. A plain check (DEFAULT_PATH_KINDS, no
"chunked") has no such row. JAX's rows (a jitted program per case) are run by `mha check --paths all`, not here."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from conformance.suite import backends, check
from conformance.suite.cases import CASES
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, path_options, run_case

V4_CASES = ("v4_csa_prefill", "v4_hca_decode", "v4_sliding_prefill")


def _adapter(backend_id):
    try:
        return backends.load(backend_id)
    except backends.BackendUnavailable as err:
        pytest.skip(str(err))


@pytest.mark.reference
def test_only_the_chunked_kind_brings_the_v4_chunked_rows():
    """The chunked path's options on a V4 case: the case's own plus the conformance block size (2 on the grid's V4
    cases: several query and key blocks); a plain check's path kinds never select it; a backend without the
    path (COMPRESSED_CHUNKED unset) has no V4 chunked row."""
    numpy = _adapter("numpy")
    for name in V4_CASES:
        options = path_options(numpy, "chunked", CASES[name], "float32")
        assert options == CASES[name].options("float32") | {
            "chunk_size": 2, "forward_only": numpy.COMPRESSED_CHUNKED_FORWARD_ONLY}, options
    assert "chunked" not in check.paths_of(numpy, check.DEFAULT_PATH_KINDS)
    results, _ = check.run_check(["numpy"], dtypes=["float32"], case_names=list(V4_CASES), jobs=1, progress=False,
                                 compile_cache=None)
    assert sorted(r.path for r in results) == ["in_place", "stages", "stages", "stages"]  # hca_decode has a cache

    class Without:  # an adapter with the V4 layer but no block-wise path
        PATHS = ("stages", "in_place")

    assert path_options(Without(), "chunked", CASES["v4_hca_decode"], "float32") is None


def _spy_and_plant(backend_id, monkeypatch, *, plant: bool):
    """Count the backend's attend_blockwise calls; with plant, the sink left out of its running sum (a port that
    starts the online softmax at -inf, 0: every row's weights then sum to 1 without the sink's share)."""
    module = importlib.import_module(f"impl_{backend_id}.compressed")
    original, calls = module.attend_blockwise, []

    def spy(config, q, window_keys, key_pos, positions, entries, selection, sinks, chunk_size):
        calls.append(chunk_size)
        return original(config, q, window_keys, key_pos, positions, entries, selection, None if plant else sinks,
                        chunk_size)

    monkeypatch.setattr(module, "attend_blockwise", spy)
    return calls


BACKENDS = [pytest.param("numpy", marks=pytest.mark.reference, id="numpy"),
            pytest.param("torch", marks=pytest.mark.torch, id="torch"),
            pytest.param("mlx", marks=pytest.mark.mlx, id="mlx")]


@pytest.mark.parametrize("backend_id", BACKENDS)
def test_a_v4_chunked_row_runs_the_blockwise_path_and_a_bug_there_fails_it(backend_id, monkeypatch):
    """v4_hca_decode (a cache: the window's keys straddle the cache's and the call's; entries in blocks of 2) on the
    chunked path: the block-wise path runs (chunk_size 2) and passes, its gradients judged where the backend
    differentiates it; with the sink dropped from the block-wise path alone the chunked row fails and the stages
    row, which never calls it, still passes."""
    adapter = _adapter(backend_id)
    case = CASES["v4_hca_decode"]
    calls = _spy_and_plant(backend_id, monkeypatch, plant=False)
    ran = run_case(case, backend_id, dtype="float32", adapter=adapter, path="chunked")
    assert ran.status == STATUS_PASS and ran.path == "chunked", ran.message
    assert calls and set(calls) == {2}, calls
    grads = [c for c in ran.comparisons if c.name.startswith("grad ")]
    if backend_id == "numpy":
        assert not grads and ran.message.startswith("forward only: impl_numpy's DeepSeek V4 backward")
    else:
        assert {"grad query", "grad sinks", "grad past_key", "grad compressor.gate.kernel"} <= {
            c.name for c in grads}, sorted(c.name for c in grads)
    _spy_and_plant(backend_id, monkeypatch, plant=True)
    planted = run_case(case, backend_id, dtype="float32", adapter=adapter, path="chunked")
    assert planted.status == STATUS_FAIL, (planted.status, planted.message)
    assert not planted.worst.ok and planted.worst.margin > 10, planted.worst.describe()
    assert "the difference is the chunked path's own" in planted.message, planted.message  # localise: the stages agree
    stages = run_case(case, backend_id, dtype="float32", adapter=adapter, path="stages")
    assert stages.status == STATUS_PASS, stages.message


@pytest.mark.torch
def test_torch_has_no_chunked_row_for_any_other_layer():
    """torch's one chunked path is V4's block-wise one: check.paths_of adds it, and an ordinary case gets no row
    on it (None, not an error or an 'unsupported' row)."""
    adapter = _adapter("torch")
    assert "chunked" not in adapter.PATHS and check.paths_of(adapter, ("chunked",)) == ["chunked"]
    assert run_case(CASES["decode_cache"], "torch", dtype="float32", adapter=adapter, path="chunked") is None
    assert np.isfinite(run_case(CASES["v4_sliding_prefill"], "torch", dtype="float32", adapter=adapter,
                                path="chunked").margin)


@pytest.mark.reference
def test_a_backend_that_refuses_a_v4_path_reports_its_reason():
    """An adapter whose backend cannot run a V4 path (Keras on jax and torch: COMPRESSED_REFUSED) gets the row as
    unsupported with the reason, on the cases that would have it (in_place: a case with a cache), and no row where
    the case has none; without the refusal, no row at all."""
    import types

    refusing = types.SimpleNamespace(COMPRESSED_REFUSED={"chunked": "no blocks here", "in_place": "no writes here"})
    for name in V4_CASES:
        with pytest.raises(NotImplementedError, match="no blocks here"):
            path_options(refusing, "chunked", CASES[name], "float32")
    with pytest.raises(NotImplementedError, match="no writes here"):
        path_options(refusing, "in_place", CASES["v4_hca_decode"], "float32")
    assert path_options(refusing, "in_place", CASES["v4_csa_prefill"], "float32") is None  # no cache: no row
    assert path_options(types.SimpleNamespace(), "chunked", CASES["v4_csa_prefill"], "float32") is None
