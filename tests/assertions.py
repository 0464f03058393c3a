"""Bit-exact and ulp comparisons the test files share (one copy: the mirrors' suites, the layout and
conversion tests, the JAX program tests)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import weights


def bits(x) -> np.ndarray:
    """An array's bytes, for bit-exact comparisons (NaN == NaN, -0 != 0)."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.uint8)


def assert_bit_equal(label, got, want) -> None:
    """One array: the same dtype, the same shape and the same bytes."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{label}: {got.dtype}{got.shape} != {want.dtype}{want.shape}")
    differ = bits(got) != bits(want)
    if differ.any():
        a, b = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
        worst = int(np.nanargmax(np.where(np.isnan(a - b), np.inf, np.abs(a - b))))
        raise AssertionError(f"{label}: {int(differ.sum())} bytes differ in {int((a != b).sum())} of {a.size} "
                             f"elements; e.g. at flat index {worst}: {a[worst]!r} != {b[worst]!r}")


def assert_bit_exact(a: dict, b: dict, what: str) -> None:
    """Two name -> array mappings: the same names, and each array bit for bit (assert_bit_equal)."""
    assert set(a) == set(b), f"{what}: names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        assert_bit_equal(f"{what}: {name}", a[name], b[name])


def ulps_between(actual, expected, dtype) -> np.ndarray:
    """|actual - expected| in units in the last place of `dtype` at their magnitude."""
    fi = ml_dtypes.finfo(weights.dtype_from_name(dtype))
    a, r = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    mag = np.maximum(np.abs(a), np.abs(r))
    binade = 2.0 ** np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    ulp = np.maximum(binade * float(fi.eps), float(fi.smallest_subnormal))
    return np.abs(a - r) / ulp
