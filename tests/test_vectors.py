"""The shipped vectors: deterministic, reproducible on another machine, unique, verifiable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conformance.suite.cases import CASES, DTYPE_NAMES
from conformance.suite.compare import expected_for
from conformance.suite.tolerance import REFERENCE_FACTOR, UNIT_ROUNDOFF, max_finite_abs
from conformance.suite.vectors import DEFAULT_DIR, Vector, generate, load_all
from impl_numpy.compressed import cache_names
from weights import read_safetensors

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again


def test_vectors_regenerate_byte_identically_on_one_machine(tmp_path):
    first, second = generate(tmp_path / "a"), generate(tmp_path / "b")
    differ = [p.name for p, q in zip(sorted(first), sorted(second)) if p.read_bytes() != q.read_bytes()]
    assert not differ, f"two generations on one machine differ: {differ[:5]}"


# Every number the generator computes (expected.*, allowance.*, each tolerance's rtol and atol) comes out of
# float64 sums whose order the machine decides: OpenBLAS's GEMM kernel (Haswell on AVX2, SkylakeX on AVX-512,
# ...), NumPy's SIMD loops (exp, tanh: AVX2 or AVX-512 code) and the thread count. A regeneration on another
# machine lands ulps from the shipped numbers, so those are compared within ULPS float64 ulps of the scale
# each is judged at (below). What the generator does not compute must be byte-identical: the metadata but
# the tolerances' numbers, and every stored weight, input and cotangent (seeded draws rounded to the dtype,
# masks, positions; ALiBi's slopes are exp2 of exact exponents), which no kernel touches.
#
# ULPS: a float64 sum of n terms is within n*u*sum|terms| of exact in any order (Higham, "Accuracy and
# Stability of Numerical Algorithms", 2nd ed., sec. 3.1, u = 2**-53), so two orders differ by less than 2n
# ulps of the terms' size; the grid's longest chain of reductions (tolerance.py's L without RoPE's angle term)
# is 69 terms, 138 ulps, and the norms and RoPE add a few: 256 covers it. The scales:
# - expected.<q>: (1 + z) * max(max|expected|, max|terms|), the scale tolerance.py measures an error at (it
#   follows the size of the terms summed, impl_numpy's magnitudes, a gradient's from its backward pass on
#   |values|; 1 + z its growth after the logits, z the largest logit magnitude);
# - allowance.<q> (rtol * (1 + z) * magnitude: products and sums of nonnegative terms, with no cancellation)
#   and rtol (SAFETY * u * sqrt(L), L from the shapes): each element itself;
# - atol: itself (float32, float64: rtol * (1 + z) * a scale); in a 16-bit file plus REFERENCE_FACTOR x the
#   expected values' bound (atol is REFERENCE_FACTOR x the 16-bit reference's distance from the float64 one,
#   small beside the values it is the difference of) and REFERENCE_FACTOR x one 16-bit step (2u) at the
#   expected scale: a float32 value on a 16-bit rounding boundary may round the other way under another kernel.
# Measured (2-core AMD EPYC VM with AVX-512, 2026-11-29), regenerating with OpenBLAS forced to Haswell,
# Sandybridge or Prescott and NumPy's loops to AVX2 (docs/testing.md): at most 0.5 ulps of that scale
# (expected), 6 ulps (allowance and atol), rtol identical; the 16-bit references' forward results
# byte-identical.
ULPS = 256
_NUMBER = re.compile(r"[-+]?\d+(\.\d*)?(e[-+]?\d+)?")  # a tolerance's reason states its computed numbers


def _scales(case, dtype) -> dict[str, float]:
    """quantity (a tolerance's key) -> (1 + z) * max(max|expected|, max|terms|), from the regeneration here."""
    exp = expected_for(case, dtype)
    terms = exp["forward_magnitudes"]
    z = max_finite_abs(terms["alibi"] if "alibi" in terms else terms["logits"])  # as compare.case_policy
    # a V4 case (config.compressed) has no elementwise magnitudes and no weights: its output's own size
    forward = {"output": (exp["output"], terms.get("output", exp["output"]))}
    if exp["weights"] is not None:
        forward["weights"] = (exp["weights"], terms["softmax"])
    forward.update({name: (exp[name], terms.get(name, exp[name])) for name in
                    ("present_key", "present_value", "present_index_keys") if name in exp})
    if case.config.compressed is not None:  # V4's present cache (cache_names): its own size (its bar has no z; the
        # (1 + z) below makes the drift bound the looser for it)
        forward.update({name: (exp[name], exp[name]) for name in exp if name.startswith("present_")})
    grads = {f"grad {name}": (g, exp["magnitudes"][name]) for name, g in exp["grads"].items()}
    return {q: (1 + z) * max(max_finite_abs(value), max_finite_abs(magnitude))
            for q, (value, magnitude) in (forward | grads).items()}


def _over_bound(new, old, bound) -> float:
    """max |new - old| / bound, NaN and infinities matching in place (else inf)."""
    new, old = np.asarray(new, np.float64), np.asarray(old, np.float64)
    same = (new == old) | (np.isnan(new) & np.isnan(old))
    finite = np.isfinite(new) & np.isfinite(old)
    if not (same | finite).all():
        return np.inf
    differ = ~same
    if not differ.any():
        return 0.0
    with np.errstate(divide="ignore"):
        return float((np.abs(new - old)[differ] / np.broadcast_to(bound, new.shape)[differ]).max())


def regeneration_drift(written, shipped_dir=DEFAULT_DIR) -> tuple[list[str], dict[str, tuple[float, str]]]:
    """Compare regenerated vector files with the shipped ones: (what differs beyond the rules above, the
    worst ratio to its bound by kind: expected, allowance, rtol, atol)."""
    problems, worst = [], {}

    def note(kind, ratio, where):
        if ratio > 1:
            problems.append(f"{where}: moved {ratio:.3g}x its bound (ULPS = {ULPS} ulps of its scale)")
        if ratio >= worst.get(kind, (0.0, ""))[0]:
            worst[kind] = (ratio, where)

    for new in written:
        old = Path(shipped_dir) / new.name
        meta_new, arrays_new = read_safetensors(new)
        meta_old, arrays_old = read_safetensors(old)
        case, dtype = CASES[meta_new["case"]], meta_new["dtype"]
        if set(arrays_new) != set(arrays_old):
            problems.append(f"{new.name}: tensor names differ: {sorted(set(arrays_new) ^ set(arrays_old))}")
            continue
        if {k: v for k, v in meta_new.items() if k != "tolerance"} != {k: v for k, v in meta_old.items() if k != "tolerance"}:
            problems.append(f"{new.name}: metadata differs")
            continue
        tol_new, tol_old = json.loads(meta_new["tolerance"]), json.loads(meta_old["tolerance"])
        if set(tol_new) != set(tol_old):
            problems.append(f"{new.name}: tolerance quantities differ")
            continue
        scales = _scales(case, dtype)
        step16 = 2 * UNIT_ROUNDOFF[dtype] if dtype in ("float16", "bfloat16") else 0.0
        for q, t in tol_new.items():
            if _NUMBER.sub("#", t["reason"]) != _NUMBER.sub("#", tol_old[q]["reason"]):
                problems.append(f"{new.name}: {q}'s tolerance reason differs")
            note("rtol", _over_bound(t["rtol"], tol_old[q]["rtol"], ULPS * np.spacing(tol_old[q]["rtol"])),
                 f"{new.name}: {q} rtol")
            # atol = rtol * (1 + z) * max|reference|: where the reference is rounding noise (grad key.bias, zero
            # in exact arithmetic: a softmax does not see a bias added to every key), max|reference| moves with
            # the BLAS kernel by as much as the expected values may (ULPS spacings of the quantity's scale, which
            # holds the (1 + z)), so the atol may move by rtol times that (OPENBLAS_CORETYPE=Haswell on an
            # AVX-512 machine moved causal_square's from 3.1e-30 to 2.1e-30)
            atol_bound = ULPS * np.spacing(tol_old[q]["atol"]) + tol_old[q]["rtol"] * ULPS * np.spacing(scales[q])
            if step16:  # REFERENCE_FACTOR x the 16-bit reference's error: it moves with the float64 reference
                atol_bound += REFERENCE_FACTOR * (ULPS * np.spacing(scales[q]) + step16 * scales[q])
            note("atol", _over_bound(t["atol"], tol_old[q]["atol"], atol_bound), f"{new.name}: {q} atol")
        for name, a in arrays_new.items():
            b = arrays_old[name]
            where = f"{new.name}: {name}"
            if a.dtype != b.dtype or a.shape != b.shape:
                problems.append(f"{where}: {b.dtype}{b.shape} became {a.dtype}{a.shape}")
            elif name == "expected.selection":  # integers: the indexer's top-k of float64 scores (the grid's
                # k-th and next scores stand apart by far more than a float64 rounding: tests/test_indexer_call.py)
                if not np.array_equal(a, b):
                    problems.append(f"{where}: the selection changed")
            elif name.startswith("expected."):
                q = name[len("expected."):].replace("grad.", "grad ", 1)
                note("expected", _over_bound(a, b, ULPS * np.spacing(scales[q])), where)
            elif name.startswith("allowance."):
                note("allowance", _over_bound(a, b, ULPS * np.spacing(np.abs(b))), where)
            elif case.config.compressed is not None and name.startswith("inputs.past_"):
                # DeepSeek V4's decode cache is the reference's own prefill of the tokens before it
                # (cases._compressed_inputs), computed by NumPy's BLAS: it moves with the kernel as an expected
                # value does, and stored in less than float64 its rounding may flip by one step of its dtype
                # (OPENBLAS_CORETYPE=Haswell on an AVX-512 machine moved v4_hca_decode.float64's past_key)
                old64 = np.asarray(b, np.float64)
                own_step = 0.0 if dtype == "float64" else 2 * UNIT_ROUNDOFF[dtype] * np.abs(old64)
                note("expected", _over_bound(a, b, ULPS * np.spacing(np.max(np.abs(old64), initial=0.0)) + own_step),
                     where)
            elif a.tobytes() != b.tobytes():
                problems.append(f"{where} is not byte-identical (not computed: no kernel may change it)")
    return problems, worst


def test_shipped_vectors_match_a_regeneration_here(tmp_path):
    written = sorted(generate(tmp_path))
    shipped = sorted(DEFAULT_DIR.glob("*.safetensors"))
    assert [p.name for p in written] == [p.name for p in shipped], "shipped vector set differs from the case grid"
    problems, worst = regeneration_drift(written)
    print({kind: f"{ratio:.3g} of its bound ({where})" for kind, (ratio, where) in worst.items()})
    assert not problems, f"{len(problems)} differences (run `mha vectors generate --overwrite`): {problems[:5]}"


def test_regeneration_drift_sees_a_stale_vector(tmp_path):
    """The ulp bounds are not vacuous: an expected value, an allowance and an atol moved by what a changed
    reference or policy moves them (1e-9 relative), and a weight moved by one ulp, are each reported."""
    from conformance.io import write_arrays

    name = "causal_top_left.float32.safetensors"
    written = generate(tmp_path / "new", cases=["causal_top_left"], dtypes=["float32"])
    meta, arrays = read_safetensors(DEFAULT_DIR / name)
    tol = json.loads(meta["tolerance"])
    tol["output"]["atol"] *= 1 + 1e-9
    arrays["expected.output"] = arrays["expected.output"] * (1 + 1e-9)
    arrays["allowance.output"] = arrays["allowance.output"] * (1 + 1e-9)
    arrays["weights.query.kernel"] = np.nextafter(arrays["weights.query.kernel"], np.inf)
    (tmp_path / "old").mkdir()
    write_arrays(tmp_path / "old" / name, arrays, metadata=meta | {"tolerance": json.dumps(tol, sort_keys=True)})
    problems, _ = regeneration_drift(written, tmp_path / "old")
    for what in ("output atol", "expected.output", "allowance.output", "weights.query.kernel is not byte"):
        assert any(what in p for p in problems), (what, problems)


def test_one_vector_per_case_and_dtype_with_everything_inside():
    vectors = load_all()
    assert len({v.name for v in vectors}) == len(vectors) == len(CASES) * len(DTYPE_NAMES)
    for v in vectors:
        case = CASES[v.name.rsplit(".", 1)[0]]
        assert v.config == case.config
        assert set(v.tensors) == set(case.config.tensor_shapes())
        if case.config.compressed is not None:  # DeepSeek V4 (issue 41): x, its positions, its cache; the gradients
            # of x, every tensor and the cache (impl_numpy.compressed_backward)
            past = {f"past_{name}" for name in cache_names(case.config)} if case.P else set()
            assert set(v.inputs) == {"query", "positions", *past}, (v.name, sorted(v.inputs))
            grads = {"query", *case.config.tensor_shapes(), *past}
            assert {k for k in v.expected if k.startswith("grad.")} == {f"grad.{n}" for n in grads}, v.name
            assert "weights" not in v.expected and v.cotangent.shape == (case.B, case.T, case.config.out_dim)
            # the present cache, every array of it (verify judges each), and csa's selection
            present = {f"present_{name}" for name in cache_names(case.config)} if case.return_cache else set()
            assert {k for k in v.expected if k.startswith("present_")} == present, v.name
            assert ("selection" in v.expected) == (case.config.compressed.kind == "csa"), v.name
            assert set(v.tolerance) == {"output", *present, *(f"grad {n}" for n in grads)}, v.name
            assert v.tensors["query.kernel"].dtype.name == v.dtype
            continue
        # a kv_shared layer (issue 42) takes no key or value: its keys and values are the cache
        assert ({"query", "past_key", "past_value"} if case.config.kv_shared else {"query", "key", "value"}) <= set(
            v.inputs) and not (case.config.kv_shared and {"key", "value"} & set(v.inputs))
        assert v.cotangent.shape == (case.B, case.T, case.config.out_dim)
        assert ("weights" in v.expected) == case.return_weights
        assert ("present_key" in v.expected) == ("present_value" in v.expected) == case.return_cache
        assert v.options.get("return_cache", False) == case.return_cache
        grads = {k for k in v.expected if k.startswith("grad.")}
        cache = ["past_key", "past_value"] if case.P else []
        qkv = ["query"] if case.config.kv_shared else ["query", "key", "value"]
        assert grads == {f"grad.{n}" for n in [*qkv, *cache, *case.config.tensor_shapes()]}
        for name in ("positions", "key_positions", "segment_ids"):
            assert name not in v.inputs or v.inputs[name].dtype == np.int64, (v.name, name)
        assert set(v.tolerance) >= {"output"} and all(t["rtol"] > 0 and t["atol"] > 0 for t in v.tolerance.values())
        assert v.tensors["query.kernel"].dtype.name == v.dtype


def test_expected_values_are_float64_answers_for_the_rounded_inputs():
    """Spot-check one low-precision vector against the per-head loop formulation."""
    from formulations import per_head_loop

    v = Vector(DEFAULT_DIR / "mask_bts.bfloat16.safetensors")
    t64 = {k: a.astype(np.float64) for k, a in v.tensors.items()}
    i64 = {k: (a.astype(np.float64) if a.dtype != bool else a) for k, a in v.inputs.items()}
    out, w = per_head_loop(v.config, t64, i64["query"], i64["key"], i64["value"], mask=i64["mask"], return_weights=True)
    np.testing.assert_allclose(v.expected["output"], out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(v.expected["weights"], w, rtol=1e-12, atol=1e-13)
    assert json.loads(json.dumps(v.options)) == CASES["mask_bts"].options("bfloat16")
