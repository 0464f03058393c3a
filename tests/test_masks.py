"""Mask builders and converters from every foreign convention."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl_numpy import causal_mask, combine, padding_mask, to_allowed

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again


@given(T=st.integers(1, 9), S=st.integers(1, 9))
def test_causal_alignments(T, S):
    for alignment, offset in (("top_left", 0), ("bottom_right", S - T)):
        m = causal_mask(T, S, alignment)
        assert m.shape == (T, S) and m.dtype == bool
        for i, j in itertools.product(range(T), range(S)):
            assert m[i, j] == (j <= i + offset), (alignment, T, S, i, j)
    if T == S:
        np.testing.assert_array_equal(causal_mask(T, S, "top_left"), causal_mask(T, S, "bottom_right"))
    # The last query sees every key under bottom_right (decoding with a cache).
    if T <= S:
        assert causal_mask(T, S, "bottom_right")[-1].all()


def test_padding_mask():
    m = padding_mask(np.array([3, 0, 5]), 5)
    assert m.shape == (3, 1, 1, 5)
    np.testing.assert_array_equal(m[:, 0, 0], [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=5\]: got \[6\]"):
        padding_mask(np.array([6]), 5)


def test_combine_is_and_over_broadcast_ranks():
    a = causal_mask(3, 3)
    b = padding_mask(np.array([2, 3]), 3)
    c = combine(a, None, b)
    assert c.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(c[0, 0], a & np.array([1, 1, 0], bool))
    assert combine(None) is None


def test_torch_conventions_are_inverted():
    attn = np.triu(np.ones((3, 3), bool), k=1)  # torch: True = masked (future)
    np.testing.assert_array_equal(to_allowed("torch-mha-attn-mask", attn), causal_mask(3, 3))
    per_head = np.stack([attn] * 4)  # (B*N, T, S) with B=2, N=2
    assert to_allowed("torch-mha-attn-mask", per_head, num_heads=2).shape == (2, 2, 3, 3)
    with pytest.raises(ValueError, match="pass num_heads"):
        to_allowed("torch-mha-attn-mask", per_head)
    kpm = np.array([[False, False, True]])  # True = padding
    np.testing.assert_array_equal(to_allowed("torch-key-padding-mask", kpm), padding_mask(np.array([2]), 3))


@pytest.mark.parametrize("convention", ["sdpa-bool", "keras", "flax", "onnx-bool", "zero-is-masked"])
def test_allowed_conventions_pass_through(convention):
    m = np.array([[1, 0], [1, 1]])
    np.testing.assert_array_equal(to_allowed(convention, m), m.astype(bool))


def test_one_is_masked_and_additive():
    look_ahead = 1 - np.tril(np.ones((3, 3)))  # seed 003's mask: 1 = masked
    np.testing.assert_array_equal(to_allowed("one-is-masked", look_ahead), causal_mask(3, 3))
    for fill in (-np.inf, -1e9, -1e4):
        additive = np.where(causal_mask(3, 3), 0.0, fill)
        np.testing.assert_array_equal(to_allowed("additive", additive), causal_mask(3, 3))
    with pytest.raises(ValueError, match="it is a bias, pass it as bias="):
        to_allowed("additive", np.array([[0.0, -0.5]]))
    with pytest.raises(ValueError, match="mask must be bool or 0/1"):
        to_allowed("keras", np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="convention must be one of"):
        to_allowed("pytorch", np.ones(2))
