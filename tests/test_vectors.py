"""The shipped vectors: deterministic, reproducible on another machine, unique, verifiable."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conformance.suite.cases import CASES, DTYPE_NAMES
from conformance.suite.vectors import DEFAULT_DIR, Vector, generate, load_all
from weights import read_safetensors

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again


def test_vectors_regenerate_byte_identically_on_one_machine(tmp_path):
    first, second = generate(tmp_path / "a"), generate(tmp_path / "b")
    differ = [p.name for p, q in zip(sorted(first), sorted(second)) if p.read_bytes() != q.read_bytes()]
    assert not differ, f"two generations on one machine differ: {differ[:5]}"


# OpenBLAS picks its GEMM kernel by CPU (Haswell/AVX2, SkylakeX/AVX-512, ...), and the
# kernels sum in different orders: the float64 expected values, and the tolerances
# measured from the low-precision NumPy runs, can differ in their last bits from the
# machine that generated the shipped files. Everything else must be identical.
_EXPECTED_DIGITS = 1e-13   # float64 eps is 2.2e-16: a few hundred ulps at the tensor's scale
_NUMBER = re.compile(r"[-+]?\d+(\.\d*)?(e[-+]?\d+)?")


def test_shipped_vectors_match_a_regeneration_here(tmp_path):
    written = sorted(generate(tmp_path))
    shipped = sorted(DEFAULT_DIR.glob("*.safetensors"))
    assert [p.name for p in written] == [p.name for p in shipped], "shipped vector set differs from the case grid"
    hint = "(run `mha vectors generate --overwrite`)"
    for new, old in zip(written, shipped):
        meta_new, arrays_new = read_safetensors(new)
        meta_old, arrays_old = read_safetensors(old)
        assert set(arrays_new) == set(arrays_old), f"{new.name}: tensor names differ {hint}"
        assert {k: v for k, v in meta_new.items() if k != "tolerance"} == \
            {k: v for k, v in meta_old.items() if k != "tolerance"}, f"{new.name}: metadata differs {hint}"
        tol_new, tol_old = json.loads(meta_new["tolerance"]), json.loads(meta_old["tolerance"])
        assert set(tol_new) == set(tol_old), f"{new.name}: tolerance quantities differ {hint}"
        for q in tol_new:
            for field in ("rtol", "atol"):
                assert tol_new[q][field] == pytest.approx(tol_old[q][field], rel=1e-6), f"{new.name}: {q} {field} {hint}"
            assert _NUMBER.sub("#", tol_new[q]["reason"]) == _NUMBER.sub("#", tol_old[q]["reason"]), f"{new.name}: {q} {hint}"
        for name, a in arrays_new.items():
            b = arrays_old[name]
            assert a.dtype == b.dtype and a.shape == b.shape, f"{new.name}: {name} {hint}"
            if not name.startswith("expected."):
                assert a.tobytes() == b.tobytes(), f"{new.name}: {name} is not byte-identical {hint}"
                continue
            finite = np.isfinite(b)
            assert np.array_equal(a[~finite], b[~finite], equal_nan=True), f"{new.name}: {name} non-finite entries {hint}"
            scale = max(1.0, float(np.abs(b[finite]).max(initial=0.0)))
            worst = float(np.abs(a[finite] - b[finite]).max(initial=0.0))
            assert worst <= _EXPECTED_DIGITS * scale, f"{new.name}: {name} differs by {worst:.3g} {hint}"


def test_one_vector_per_case_and_dtype_with_everything_inside():
    vectors = load_all()
    assert len({v.name for v in vectors}) == len(vectors) == len(CASES) * len(DTYPE_NAMES)
    for v in vectors:
        case = CASES[v.name.rsplit(".", 1)[0]]
        assert v.config == case.config
        assert set(v.tensors) == set(case.config.tensor_shapes())
        assert {"query", "key", "value"} <= set(v.inputs)
        assert v.cotangent.shape == (case.B, case.T, case.config.out_dim)
        assert ("weights" in v.expected) == case.return_weights
        assert ("present_key" in v.expected) == ("present_value" in v.expected) == case.return_cache
        assert v.options.get("return_cache", False) == case.return_cache
        grads = {k for k in v.expected if k.startswith("grad.")}
        cache = ["past_key", "past_value"] if case.P else []
        assert grads == {f"grad.{n}" for n in ["query", "key", "value", *cache, *case.config.tensor_shapes()]}
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
