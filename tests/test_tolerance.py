"""The 16-bit floor of the tolerance policy: one step of the dtype passes, two do not."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conformance.suite.tolerance import UNIT_ROUNDOFF, compare, tolerance

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
