"""The lightning indexer in the attention call (config.indexer; docs/sparse-attention.md "In the call"): the
NumPy reference attends to the selection impl_numpy.indexer makes, on every path, a decode step from the
returned caches equals the prefill's last query, the refusals, and the suite's judging of a port's selection
(conformance.suite.compare.judge_selection): an admissible selection of its own is judged against the float64
reference attending to it, an inadmissible one fails naming the query and the keys, and the two porting bugs
of tests/mutants.py's INDEXER_MUTANTS fail their grid case. The mirrors run the grid's indexer cases in their
own grid tests (tests/test_torch.py, test_tf.py, test_jax.py, test_mlx.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from mutants import INDEXER_MUTANTS, TRACED_INDEXER_MUTANTS, MutantAdapter, TracedIndexerMutant

import impl_numpy
import impl_numpy.adapter as numpy_adapter
from conformance.suite import compare, selection
from conformance.suite.cases import CASES, make_inputs, make_tensors
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, run_case
from impl_numpy.indexer import lightning_indexer

pytestmark = pytest.mark.reference

INDEXER_CASES = [name for name, case in CASES.items() if case.config.indexer is not None]


def _dense(config, tensors):
    return (dataclasses.replace(config, indexer=None),
            {n: t for n, t in tensors.items() if not n.startswith("indexer.")})


@pytest.mark.parametrize("name", INDEXER_CASES)
def test_every_path_attends_to_the_indexers_selection(name):
    """The call's output on the stages, the fused core, the chunked core (and the in-place cache) equals the
    same layer without the indexer given the selection lightning_indexer makes on its own (the index mask:
    causal bottom-right, as these cases' alignment), and differs from dense attention: keys are dropped."""
    case = CASES[name]
    tensors, inputs = make_tensors(case), make_inputs(case)
    index = lightning_indexer(case.config, tensors, inputs["query"], inputs["key"],
                              past_index_keys=inputs.get("past_index_keys"), is_causal=True)
    config, plain = _dense(case.config, tensors)
    kw = dict(is_causal=True, causal_alignment=case.causal_alignment, past_key=inputs.get("past_key"),
              past_value=inputs.get("past_value"))
    want = impl_numpy.multi_head_attention(config, plain, inputs["query"], inputs["key"], inputs["value"],
                                           topk_indices=index["topk_indices"], **kw)
    dense = impl_numpy.multi_head_attention(config, plain, inputs["query"], inputs["key"], inputs["value"], **kw)
    assert np.abs(dense - want).max() > 1e-3  # the selection matters in every case
    for extra in ({"return_weights": True}, {}, {"chunk_size": 2}):
        got = impl_numpy.multi_head_attention(case.config, tensors, inputs["query"], inputs["key"], inputs["value"],
                                              past_index_keys=inputs.get("past_index_keys"), **kw, **extra)
        got = got[0] if isinstance(got, tuple) else got
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)  # float64, one algorithm: round-off
    answer = numpy_adapter.forward(case.config, tensors, inputs, case.options("float64") | {"return_cache": True})
    np.testing.assert_array_equal(answer["selection"], index["topk_indices"])
    np.testing.assert_allclose(answer["present_index_keys"], index["present_index_keys"], rtol=1e-12, atol=1e-12)
    if case.P:
        placed = numpy_adapter.forward(case.config, tensors, inputs, numpy_adapter.path_options(
            "in_place", case.config, inputs, case.options("float64")))
        np.testing.assert_allclose(placed["output"], want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(placed["present_index_keys"], index["present_index_keys"], rtol=1e-12, atol=1e-12)


def test_decode_from_the_returned_caches_is_the_prefills_last_query():
    """A DSA (MLA) layer: prefill 8 tokens, then decode the 9th from present_key/present_value/present_index_keys;
    its output is the 9-token prefill's last row (the same keys visible, the same selection)."""
    case = CASES["indexer_dsa_prefill"]
    tensors, x = make_tensors(case), make_inputs(case)["query"]  # (2, 9, D)
    full = impl_numpy.multi_head_attention(case.config, tensors, x, is_causal=True)
    _, pk, pv, pik = impl_numpy.multi_head_attention(case.config, tensors, x[:, :8], is_causal=True,
                                                     return_cache=True)
    step, sel = impl_numpy.multi_head_attention(case.config, tensors, x[:, 8:], x[:, 8:], x[:, 8:], past_key=pk,
                                                past_value=pv, past_index_keys=pik, is_causal=True,
                                                causal_alignment="bottom_right", return_selection=True)
    np.testing.assert_allclose(step[:, 0], full[:, -1], rtol=1e-10, atol=1e-12)
    assert (sel >= 0).sum(-1).tolist() == [[3], [3]]  # k = 3 of 9 keys


def test_refusals():
    case = CASES["indexer_dsa_decode"]
    tensors, inputs = make_tensors(case), make_inputs(case)
    kw = dict(past_key=inputs["past_key"], past_value=inputs["past_value"], is_causal=True,
              causal_alignment="bottom_right")
    with pytest.raises(ValueError, match="past_index_keys is missing: a call with a cache of P=8"):
        impl_numpy.multi_head_attention(case.config, tensors, inputs["query"], inputs["key"], inputs["value"], **kw)
    with pytest.raises(ValueError, match=r"topk_indices is given but config.indexer selects the keys itself"):
        impl_numpy.multi_head_attention(case.config, tensors, inputs["query"], inputs["key"], inputs["value"],
                                        past_index_keys=inputs["past_index_keys"],
                                        topk_indices=np.zeros((2, 1, 2), np.int64), **kw)
    with pytest.raises(ValueError, match=r"past_index_keys must have shape \(B, P, J\) = \(2, 8, 8\)"):
        impl_numpy.multi_head_attention(case.config, tensors, inputs["query"], inputs["key"], inputs["value"],
                                        past_index_keys=inputs["past_index_keys"][:, :3], **kw)
    config, plain = _dense(case.config, tensors)
    with pytest.raises(ValueError, match="past_index_keys is given but config.indexer is null"):
        impl_numpy.multi_head_attention(config, plain, inputs["query"], inputs["key"], inputs["value"],
                                        past_index_keys=inputs["past_index_keys"], **kw)
    with pytest.raises(ValueError, match="return_selection needs config.indexer"):
        impl_numpy.multi_head_attention(config, plain, inputs["query"], inputs["key"], inputs["value"],
                                        return_selection=True, **kw)


def test_the_indexers_tensors_get_zero_gradients():
    case = CASES["indexer_m3_blocks"]
    tensors, inputs = make_tensors(case), make_inputs(case)
    d_out = np.random.default_rng(0).standard_normal((case.B, case.T, case.config.out_dim))
    grads = numpy_adapter.vjp(case.config, tensors, inputs, case.options("float64"), d_out)["grads"]
    index = [n for n in grads if n.startswith("indexer.")]
    assert index and all(not grads[n].any() for n in index)
    assert np.abs(grads["query.kernel"]).max() > 0


class _OwnSelection:
    """The NumPy reference as a port that keeps another key than the reference for one query of the case (its
    k-th key swapped for the best dropped visible key) and attends to its own selection (`honest`), or claims
    the reference's selection while attending to its own (a lie the output comparison must catch)."""

    def __init__(self, case, honest=True):
        tensors, inputs = make_tensors(case), make_inputs(case)
        index = lightning_indexer(case.config, tensors, inputs["query"], is_causal=True, return_scores=True)
        sel = index["topk_indices"].copy()  # (B, T, k)
        s = index["index_scores"][:, 0]  # (B, T, S)
        b, t = 0, case.T - 1
        dropped = [j for j in np.argsort(-s[b, t]) if j not in sel[b, t] and np.isfinite(s[b, t, j])]
        self.reference, self.swapped = index["topk_indices"], (int(sel[b, t, -1]), int(dropped[0]))
        sel[b, t, -1] = dropped[0]
        self.selection, self.honest = sel, honest

    def forward(self, config, tensors, inputs, options, **_):
        plain_config, plain = _dense(config, tensors)
        out = numpy_adapter.forward(plain_config, plain, {**inputs, "topk_indices": self.selection},
                                    options | {"return_weights": options.get("return_weights")})
        out["selection"] = self.selection if self.honest else self.reference
        return out


def test_an_admissible_selection_is_judged_with_its_own_keys(monkeypatch):
    """With the score allowance widened (every swap admissible), a port attending to its own selection passes:
    its output is judged against the float64 reference attending to that selection. The same port claiming
    the reference's selection fails on its output; without the widening the swap fails, naming the query and
    the keys."""
    case = CASES["indexer_dsa_prefill"]
    port = _OwnSelection(case)
    monkeypatch.setattr(selection, "score_allowance", lambda dtype, m, **kw: np.full(np.shape(m), 1e9))
    compare.clear_cache()
    passed = run_case(case, "own", dtype="float32", adapter=port, gradients=False)
    assert passed.status == STATUS_PASS, passed.worst.describe()
    chosen = [c for c in passed.comparisons if c.name == "selection"][0]
    assert "1 admissible swaps" in chosen.tolerance.reason
    lied = run_case(case, "own", dtype="float32", adapter=_OwnSelection(case, honest=False), gradients=False)
    assert lied.status == STATUS_FAIL and {"output", "weights"} <= {c.name for c in lied.comparisons if not c.ok}
    monkeypatch.undo()
    failed = run_case(case, "own", dtype="float32", adapter=port, gradients=False)
    assert failed.status == STATUS_FAIL
    reason = [c for c in failed.comparisons if c.name == "selection"][0].tolerance.reason
    kept, dropped = port.swapped
    assert f"query [0, 0, {case.T - 1}]" in reason and f"({dropped}," in reason and f"({kept}," in reason
    compare.clear_cache()


def test_the_port_without_bugs_passes_the_indexer_cases():
    results = [run_case(CASES[name], "mutant", dtype=dtype, adapter=MutantAdapter(None), gradients=False)
               for name in INDEXER_CASES for dtype in ("float64", "float32", "bfloat16")]
    bad = [f"{r.case}/{r.dtype}: {r.worst.describe() if r.worst else r.message}" for r in results
           if r.status != STATUS_PASS]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("bug", list(INDEXER_MUTANTS))
def test_indexer_mutant_fails_its_case(bug):
    what, name = INDEXER_MUTANTS[bug]
    result = run_case(CASES[name], "mutant", dtype="float32", adapter=MutantAdapter(bug), gradients=False)
    assert result.status == STATUS_FAIL, f"{bug} ({what}) passed {name}"
    print(f"{bug}: {name} float32 fails, margin {result.margin:.3g} ({result.worst.name})")


@pytest.mark.parametrize("bug", list(TRACED_INDEXER_MUTANTS))
def test_an_indexer_bug_is_named_at_the_indexers_first_differing_stage(bug):
    """A port whose indexer differs fails its case and the failure names the indexer's stage where it starts
    (compare.localise over the call's trace, the indexer's stages first), not the attention's output: the RoPE
    pairing at indexer.query.rope, the ReLU at indexer.scores, a clear swap at indexer.selection with the query
    and both keys. float32: in bfloat16 this case's score allowance (3x the bfloat16 reference's own score error
    on the row) admits the swap (docs/conformance.md, "Top-k selections")."""
    what, name, stage = TRACED_INDEXER_MUTANTS[bug]
    result = run_case(CASES[name], "mutant", dtype="float32", adapter=TracedIndexerMutant(bug), gradients=False)
    assert result.status == STATUS_FAIL, f"{bug} ({what}) passed {name}"
    assert result.divergence is not None and result.divergence.stage == stage, (
        f"{bug}: {result.divergence.describe() if result.divergence else 'no divergence'}, expected {stage}")
    if stage == "indexer.selection":
        assert "query [0, 0, 8]" in result.divergence.describe(), result.divergence.describe()
    print(f"{bug}: {result.divergence.describe()[:160]}")


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_the_reference_as_a_port_has_no_divergent_indexer_stage(dtype):
    """compare.localise on the NumPy reference itself (in `dtype`) over every indexer case: no stage, the
    indexer's included, is beyond its tolerance, so a divergence named there is the port's."""
    for name in INDEXER_CASES:
        divergence = compare.localise(CASES[name], dtype, numpy_adapter, device="cpu", precision="highest")
        assert divergence is None, f"{name} {dtype}: {divergence.describe()}"


def test_the_grid_cases_have_no_near_tie_at_the_kth_place():
    """The shipped vectors' expected.selection is compared exactly on regeneration (tests/test_vectors.py): in
    every indexer case and every dtype's vector (the float64 reference on the inputs and weights rounded to that
    dtype) the k-th kept score (or block score) and the best dropped one differ by more than 1e-6 of the
    scores' size, a million times a float64 rounding, so no machine's BLAS picks other keys. (The near-tie case,
    indexer_ties_near, is near for 16-bit arithmetic, ~1e-4, not for float64's.)"""
    for name in INDEXER_CASES:
        case = CASES[name]
        smallest = {}
        for dtype in ("float64", "float32", "float16", "bfloat16"):
            exp = compare.expected_for(case, dtype)
            tensors = {n: t.astype(np.float64) for n, t in exp["tensors"].items()}
            inputs = {n: (x.astype(np.float64) if x.dtype.kind == "f" else x) for n, x in exp["inputs"].items()}
            index = lightning_indexer(case.config, tensors, inputs["query"], inputs["key"],
                                      past_index_keys=inputs.get("past_index_keys"), is_causal=True,
                                      return_scores=True)
            s = index["block_scores"] if "block_scores" in index else index["index_scores"]
            s = np.sort(np.where(np.isfinite(s), s, np.nan), axis=-1)[..., ::-1]  # NaN (masked, +inf local) first
            k = case.config.indexer.topk
            gaps = []
            for row in np.ndindex(*s.shape[:-1]):
                finite = s[row][~np.isnan(s[row])]
                kept = k - int(np.isinf(index.get("block_scores", index["index_scores"])[row]).sum() -
                               np.isneginf(index.get("block_scores", index["index_scores"])[row]).sum())
                if 0 < kept < len(finite):
                    gaps.append(abs(finite[kept - 1] - finite[kept]) / max(np.abs(finite).max(), 1e-300))
            smallest[dtype] = min(gaps)
        assert min(smallest.values()) > 1e-6, (name, smallest)
        print(f"{name}: smallest relative gap at the k-th place " + ", ".join(f"{d} {g:.3g}" for d, g in smallest.items()))
