"""impl_jax/compressed.py (DeepSeek V4's layer in JAX) against the NumPy reference, the three kinds, batch 2: a
causal prefill in float64 (x64 mode, which impl_jax.adapter switches on) and float32, the trace's stage names
the reference's; and (slow) a prefill then one token at a time through the cache (present_* fed back as
past_*), float64. In float16 and bfloat16: run_case on the three grid cases (3.4 s) and each traced stage's
dtype the reference's (eager: 6.5 s), slow as the file (2-core AMD EPYC VM, 2026-11-29)."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import IN_PLACE_CUTS, KINDS, T, _layer, _x, stage_dtypes

from impl_numpy.compressed import cache_buffers, logical_cache
from impl_numpy.compressed import compressed_attention as reference

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import impl_jax.adapter  # noqa: E402, F401  (switches x64 on)
from impl_jax.compressed import compressed_attention  # noqa: E402

# slow: eager JAX compiles each op for each new shape, 2-7 s a prefill test and ~10 s a decode test on the 2-core
# VM (2026-11-29); the jax env has no room left in tox's budget, so `tox -e full` runs them.
pytestmark = [pytest.mark.jax, pytest.mark.slow]

# As tests/test_compressed_v4_torch.py: float64, the same sums in other orders; float32, every stage rounded to
# float32 against the float64 reference, 256 float32 ulps of the output's size (the selection is the same: its
# smallest gap at the top-k boundary is 0.014).
BOUND = {"float64": 1e-12, "float32": 256 * float(np.finfo(np.float32).eps)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_jax_reproduces_the_reference_prefill(kind, dtype):
    config, t = _layer(kind)
    x = _x()
    trace, jax_trace = [], []
    want = reference(config, t, x, np.arange(T), trace=trace)
    got = compressed_attention(config, t, jnp.asarray(x, dtype), np.arange(T), trace=jax_trace)
    assert [e.stage for e in jax_trace] == [e.stage for e in trace]
    if kind == "csa":
        chosen = {e.stage: e.value for e in trace}["indexer.selection"]
        np.testing.assert_array_equal(np.asarray({e.stage: e.value for e in jax_trace}["indexer.selection"]), chosen)
    assert np.abs(np.asarray(got, np.float64) - want).max() <= BOUND[dtype] * np.abs(want).max()


@pytest.mark.parametrize("kind", list(KINDS))
def test_jax_reproduces_the_reference_decode(kind):
    """A prefill of 13, then one token at a time to 20 (csa's windows close at 15 and 19, hca's at 15)."""
    config, t = _layer(kind)
    x = _x()
    want = reference(config, t, x, np.arange(T))
    out, past = compressed_attention(config, t, jnp.asarray(x[:, :13]), np.arange(13), return_cache=True)
    rows = [np.asarray(out)]
    for s in range(13, T):
        out, past = compressed_attention(config, t, jnp.asarray(x[:, s:s + 1]), np.array([s]), past,
                                         return_cache=True)
        rows.append(np.asarray(out))
    assert np.abs(np.concatenate(rows, axis=1) - want).max() <= BOUND["float64"] * np.abs(want).max()


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode"])
def test_the_jax_column_passes_the_grid_cases(name):
    """`mha check`'s judgement (run_case through the adapter, float32) of the grid's V4 cases: the forward and
    every gradient (the layer's input, every tensor, the cache) by the backend's own autodiff."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "jax", dtype="float32")
    grads = {c.name for c in result.comparisons if c.name.startswith("grad ")}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"grad query", "grad sinks", "grad compressor.gate.kernel"} <= grads, sorted(grads)


def test_the_jax_column_judges_its_in_place_cache_on_the_grid_case():
    """A plain `mha check` runs v4_hca_decode on JAX's in_place path (COMPRESSED_IN_PLACE): the case's cache
    handed over in buffers, donated to the jitted call and written there, read back as the present cache."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES["v4_hca_decode"], "jax", dtype="float32", path="in_place")
    judged = {c.name for c in result.comparisons if c.judged}
    assert result.status == "pass", (result.status, result.message)
    assert {"output", "present_key", "present_entries", "present_window_kv"} <= judged, sorted(judged)


@pytest.mark.parametrize("name", ["v4_csa_prefill", "v4_hca_decode", "v4_sliding_prefill"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_jax_column_passes_the_grid_cases_in_16_bits(name, dtype):
    """run_case's judgement in float16 and bfloat16 (the stages in float32, stored in 16 bits where the reference
    stores them): the output within 3x the 16-bit reference's own error, and every gradient against the 16-bit
    reference's (impl_numpy.compressed_backward in the dtype); those whose allowance is not well below their
    size are reported not judged, the output projection's gradient is judged."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[name], "jax", dtype=dtype)
    judged = {c.name for c in result.comparisons if c.judged}
    assert result.status == "pass" and not result.message, (result.status, result.message)
    assert {"output", "grad output.kernel"} <= judged, sorted(judged)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_jax_mirror_stores_each_stage_where_the_reference_does_in_16_bits(dtype):
    """Each traced stage in the dtype the reference's 16-bit run stores it in (the storage dtype; the index
    scores float32, the selection int64): a stage kept in float32 where the reference rounds, or rounded where
    it keeps float32, shows here, where the 16-bit bar cannot see it (docs/spec-frontier.md, "What 16 bits
    cannot catch")."""
    assert stage_dtypes("jax", dtype) == stage_dtypes("numpy", dtype)


@pytest.mark.parametrize("kind,jit", [(kind, {}) for kind in KINDS] + [("hca", None)],
                         ids=[*KINDS, "hca-eager"])
def test_jax_in_place_is_the_copying_reference(kind, jit):
    """The in-place cache in JAX (each write an .at[].set; with jit the buffers donated, so the given ones are
    deleted), float64, batch 2, over IN_PLACE_CUTS (eager: its first four calls; eager JAX compiles every op of
    every new shape, 19 s for all 20): each call's output and the returned buffers read as a cache against the
    copying float64 reference's, within BOUND (the cache's rows: BOUND of their size)."""
    cuts = IN_PLACE_CUTS if jit is not None else IN_PLACE_CUTS[:5]
    config, t = _layer(kind)
    x = _x()
    buffers = {n: jnp.asarray(a) for n, a in cache_buffers(config, 2, T).items()}
    past = None
    for a, b in zip(cuts, cuts[1:]):
        want, past = reference(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
        given = buffers
        got, buffers = compressed_attention(config, t, jnp.asarray(x[:, a:b]), np.arange(a, b), buffers,
                                            return_cache=True, in_place=True, jit=jit)
        assert given["key"].is_deleted() == (jit is not None)  # donated under jit: written in place
        assert np.abs(np.asarray(got) - want).max() <= BOUND["float64"] * np.abs(want).max()
        held = logical_cache(config, {n: np.asarray(v) for n, v in buffers.items()}, b)
        for name, rows in past.items():
            assert np.abs(held[name] - rows).max(initial=0) <= BOUND["float64"] * (1 + np.abs(rows).max(initial=0))


def test_jax_in_place_needs_the_buffers_returned():
    config, t = _layer("hca")
    buffers = {n: jnp.asarray(a) for n, a in cache_buffers(config, 2, 8).items()}
    with pytest.raises(ValueError, match=r"return_cache must be True with in_place in JAX .*: got False"):
        compressed_attention(config, t, jnp.zeros((2, 1, 32)), np.array([0]), buffers, in_place=True)
    with pytest.raises(ValueError, match=r"past\['entries'\] with in_place is written in place: it must be a jax "
                                         r"array of the storage dtype float64: got a ndarray"):
        compressed_attention(config, t, jnp.zeros((2, 1, 32)), np.array([0]), {**buffers, "entries": np.zeros(
            (2, 1, 16))}, in_place=True, return_cache=True)
