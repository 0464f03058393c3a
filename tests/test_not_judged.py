"""Comparisons that cannot fail are reported "not judged", never a pass (issue 38, item 2).

A comparison whose allowance is not well below the quantity's own size is no check: a result of zero passes it.
conformance.suite.tolerance.not_judged_reason says so (an all-zero result would score a margin under 2), and
`mha check`, `mha verify`, their JSON and JUnit report such a comparison as not judged. The grid is built so that
rounding opens no gate: the QKV clip's pre-clip values stay clear of +-c by more than 16-bit rounding."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.suite import verify as V
from conformance.suite.cases import CASES, DTYPE_NAMES
from conformance.suite.compare import STATUS_FAIL, case_policy, expected_for, run_case
from conformance.suite.tolerance import JUDGED_ZERO_MARGIN, allowance_of, compare, max_finite_abs, structural_zero
from impl_numpy import adapter as reference
from weights import AttentionConfig

pytestmark = pytest.mark.reference

KEY_SIDE = ("key", "key.kernel", "key.bias")


class ZeroKeyGradients:
    """impl_numpy with every key-side gradient returned as zeros: a backward bug the forward pass never shows."""

    def devices(self):
        return ["cpu"]

    def forward(self, config, tensors, inputs, options, **kwargs):
        return reference.forward(config, tensors, inputs, options, **kwargs)

    def vjp(self, config, tensors, inputs, options, d_output, **kwargs):
        out = reference.vjp(config, tensors, inputs, options, d_output, **kwargs)
        out["grads"] = {k: np.zeros_like(v) if k in KEY_SIDE else v for k, v in out["grads"].items()}
        return out

    def __call__(self, config, tensors, inputs, options):  # the `mha verify` interface
        config = AttentionConfig.from_dict(config)
        options = dict(options)
        cotangent = options.pop("cotangent")
        result = dict(reference.forward(config, tensors, inputs, options))
        result["grads"] = self.vjp(config, tensors, inputs, options, cotangent.astype(result["output"].dtype))["grads"]
        return result


def _quantities(case, dtype):
    """(name, quantity, reference, scale floor) of every comparison mha check makes for the case."""
    exp = expected_for(case, dtype)
    out = [("output", "output", exp["output"], 0.0)]
    if case.return_weights:
        out.append(("weights", "weights", exp["weights"], 0.0))
    if case.return_cache or case.P:
        out += [(name, "output", exp[name], 0.0) for name in ("present_key", "present_value") if name in exp]
    out += [(f"grad {g}", "grad", v, 0.0) for g, v in exp["grads"].items()]  # elementwise: case_policy
    return out


def cannot_fail(names, dtypes=DTYPE_NAMES):
    """Every comparison of these cases whose allowance exceeds half its magnitude somewhere it matters (an all-zero
    result scores a margin under 2), each with whether compare() reports it not judged."""
    found = []
    for name in names:
        for dtype in dtypes:
            for q, quantity, ref, floor in _quantities(CASES[name], dtype):
                tol = case_policy(CASES[name], dtype, q, quantity, ref, scale_floor=floor)
                r = np.abs(np.nan_to_num(np.asarray(ref, np.float64)))
                zero_margin = float((r / allowance_of(tol, ref)).max()) if r.size else np.inf
                result = compare(q, ref, ref, tol)
                # zero up to the float64 reference's rounding of its terms (the key bias gradient): judged by design
                zero = structural_zero(tol, ref)
                if zero_margin < JUDGED_ZERO_MARGIN or not result.judged:
                    found.append((name, dtype, q, zero_margin, result.judged, zero))
    return found


def _report(found):
    zero = [f for f in found if f[5]]
    listed = [f for f in found if not f[5]]
    assert all(f[4] for f in zero), zero
    assert not any(f[4] for f in listed), [f for f in listed if f[4]]
    return listed


def test_the_grid_comparisons_that_cannot_fail_are_reported_not_judged_qkv_clip_and_long():
    listed = _report(cannot_fail(["qkv_clip", "long_alibi_256"]))
    print(f"{len(listed)} comparisons not judged: " + "; ".join(f"{n}.{d} {q} ({m:.2g})" for n, d, q, m, *_ in listed))


@pytest.mark.slow
def test_every_grid_comparison_that_cannot_fail_is_reported_not_judged():
    listed = _report(cannot_fail(list(CASES)))
    by_dtype = {d: sum(f[1] == d for f in listed) for d in DTYPE_NAMES}
    print(f"{len(listed)} comparisons of the grid not judged, by dtype: {by_dtype}")


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.config.qkv_clip is not None])
def test_no_clip_gate_flips_in_16_bits(name):
    """The 16-bit references' own gradient error stays a few percent of each gradient (a flipped gate made it
    47% of the bfloat16 key gradients at c 0.5)."""
    for dtype in ("float16", "bfloat16"):
        exp = expected_for(CASES[name], dtype)
        for g, ref in exp["grads"].items():
            size = max_finite_abs(ref)
            if size > 1e-9 * max_finite_abs(exp["magnitudes"][g]):
                assert exp["same_precision"][f"grad {g}"] <= 0.05 * size, (dtype, g, exp["same_precision"][f"grad {g}"] / size)


def test_zeroed_key_gradients_fail_mha_check_and_mha_verify():
    """mha check and mha verify fail a port whose key-side gradients are zero, in every dtype with the QKV clip:
    each gradient element is allowed the noise of its own terms (impl_numpy.backward's gradient magnitudes), not
    of the largest term of the tensor, so in bfloat16 too the allowance falls below the key gradients (issue 38:
    it was 1.4x max|grad| while clip gates flipped, then still above them, and zero passed as "not judged"). In
    bfloat16 grad key and key.kernel fail at margins 1.9 and 1.6: still reported not judged as well (an allowance
    above half the gradient), never a pass."""
    case = CASES["qkv_clip"]
    adapter = ZeroKeyGradients()
    for dtype in ("float32", "float16", "bfloat16"):
        result = run_case(case, "zero-key-grads", dtype=dtype, adapter=adapter)
        key_side = [c for c in result.comparisons if c.name.removeprefix("grad ") in KEY_SIDE]
        assert key_side and all(not c.ok or not c.judged for c in key_side), [c.describe() for c in key_side]
        assert result.status == STATUS_FAIL, result.worst.describe()
        assert not all(c.ok for c in key_side if c.name != "grad key.bias"), [c.describe() for c in key_side]
        verified = V.verify(adapter, only=["qkv_clip"], dtypes=[dtype])
        assert len(verified) == 1
        vector_key_side = [c for c in verified[0].comparisons if c.name.removeprefix("grad ") in KEY_SIDE]
        assert vector_key_side and all(not c.ok or not c.judged for c in vector_key_side)
        assert verified[0].status == "fail", dtype
        record = verified[0].to_json()
        assert {c["status"] for c in record["comparisons"] if c["name"].removeprefix("grad ") in KEY_SIDE} <= \
            {"fail", "not judged"}
