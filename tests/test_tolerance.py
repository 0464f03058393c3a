"""The 16-bit floor of the tolerance policy: one step of the dtype passes, two do not."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conformance.suite.tolerance import UNIT_ROUNDOFF, compare, tolerance

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_16_bit_step_passes_two_fail(dtype):
    # A reference that the 16-bit run got almost exactly: its error alone
    # would allow far less than one step of the dtype.
    storage = DTYPES[dtype]
    reference = np.linspace(0.1, 0.9, 9)
    stored = reference.astype(storage).astype(np.float64)
    eps = float(ml_dtypes.finfo(storage).eps)  # one step at 1.0: 2u
    step = 2.0 ** np.floor(np.log2(stored)) * eps  # one step at each value
    assert np.all((stored + step).astype(storage).astype(np.float64) == stored + step)  # representable
    tol = tolerance(dtype, length=20, reference_scale=1.0, same_precision_error=1e-9)
    assert tol.rtol >= 2 * UNIT_ROUNDOFF[dtype]
    one = compare("output", stored + step, stored, tol)
    assert one.ok, one.describe()
    two = compare("output", stored + 2 * step, stored, tol)
    assert not two.ok, two.describe()


def test_a_nan_passes_only_where_the_same_dtype_reference_has_one():
    """Tolerance.nan_allowed (set by compare.case_policy where the 16-bit reference is NaN and float64's is
    not): a NaN there passes, a NaN anywhere else fails, and a finite value there is judged as ever."""
    import dataclasses

    reference = np.array([0.0, 0.5, 1.0])
    tol = dataclasses.replace(tolerance("bfloat16", length=20, reference_scale=1.0, same_precision_error=1e-3),
                              nan_allowed=np.array([True, False, False]))
    assert compare("grad", np.array([np.nan, 0.5, 1.0]), reference, tol).ok
    assert not compare("grad", np.array([0.0, np.nan, 1.0]), reference, tol).ok
    assert compare("grad", reference, reference, tol).ok
    assert not compare("grad", np.array([0.5, 0.5, 1.0]), reference, tol).ok
    plain = dataclasses.replace(tol, nan_allowed=None)
    assert not compare("grad", np.array([np.nan, 0.5, 1.0]), reference, plain).ok


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_clip_gate_rounding_opens_lets_the_16_bit_nan_through():
    """A masked_row "nan" row's NaN gradient passes the QKV clip where |v| <= c. A value just above c in
    float64 lands on the rounded bound in bfloat16, inside the clip there: the bfloat16 reference's value
    gradient is NaN where float64's is 0, and the policy takes the dtype's own NaN (compare._nan_only_in)."""
    from conformance.suite.compare import _nan_only_in

    c = 0.2
    bound = float(np.asarray(c, ml_dtypes.bfloat16))
    x64 = np.array([bound + bound * 2.0**-12, 0.1])  # just outside in float64; bfloat16 rounds it to the bound
    x16 = x64.astype(ml_dtypes.bfloat16).astype(np.float64)
    upstream = np.nan  # the gradient reaching the clip from a NaN row
    grad64 = np.where(np.abs(x64) <= c, upstream, 0.0)
    grad16 = np.where(np.abs(x16) <= bound, upstream, 0.0)
    assert not np.isnan(grad64[0]) and np.isnan(grad16[0])
    np.testing.assert_array_equal(_nan_only_in(grad16, grad64), [True, False])
    assert _nan_only_in(grad64, grad64) is None


def _output_from_logits(case, exp, logits):
    """The reference's output from the mask stage on (softmax, attend, merge_heads, output), in float64."""
    from impl_numpy import functional as F

    trace = dict(exp["trace"])
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    w = w / w.sum(axis=-1, keepdims=True)
    ctx = F.merge_heads(F.attend(w, trace["value.split_heads"]))
    tensors = {k: v.astype(np.float64) for k, v in exp["tensors"].items()}
    return F.output(ctx, tensors["output.kernel"], tensors.get("output.bias"))


@pytest.mark.parametrize("signs", ["random", "all_up", "alternating"])
def test_logit_error_bound_covers_a_logit_rounding(signs):
    """impl_numpy.magnitudes' logit error is a bound: every logit moved by rho * its magnitude (any signs) moves
    the output by at most rho * logit_error (first order in rho), on the T 256 ALiBi case whose largest
    |logit| + |bias| (on keys of negligible weight) is far above the bound's weighted one."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import expected_for

    case = CASES["long_alibi_256"]
    exp = expected_for(case, "float64")
    logits = dict(exp["trace"])["mask"]
    m = np.where(np.isfinite(logits), exp["forward_magnitudes"]["mask"], 0.0)
    rng = np.random.default_rng(38)
    s = {"random": rng.choice([-1.0, 1.0], size=m.shape), "all_up": np.ones(m.shape),
         "alternating": np.where(np.arange(m.shape[-1]) % 2 == 0, 1.0, -1.0) * np.ones(m.shape)}[signs]
    rho = 1e-7
    base = _output_from_logits(case, exp, logits)
    np.testing.assert_allclose(base, exp["output"], rtol=1e-12, atol=1e-12)  # the recomputation is the reference's
    moved = _output_from_logits(case, exp, logits + rho * m * s)
    bound = rho * exp["logit_errors"]["output"]
    ratio = float((np.abs(moved - base) / bound).max())
    print(f"{signs}: |d output| / (rho * logit error) <= {ratio:.3g}")
    assert ratio <= 1.0 + 1e-3, ratio
    z_all = float(np.abs(exp["forward_magnitudes"]["alibi"]).max())
    z_eff = float(exp["logit_errors"]["output"].max() / exp["forward_magnitudes"]["output"].max())
    print(f"z over every key {z_all:.3g}, weighted z_eff {z_eff:.3g}")
    assert z_eff < z_all / 4, (z_eff, z_all)  # the point: the weighted bound is far below the largest logit's
