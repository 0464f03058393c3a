"""weights.alibi's slope rules against transformers' own (BLOOM's build_alibi_tensor, MPT's
build_mpt_alibi_tensor), and against the formulas written out here where transformers is not installed.

The transformers tests are unmarked, as tests/test_rope.py: transformers comes with the `hf` extra, which
only tox's `all` env installs, and `all` runs the unmarked tests; elsewhere they skip."""

from __future__ import annotations

import numpy as np
import pytest

from weights.alibi import bloom_slopes, mpt_slopes

HEAD_COUNTS = [*range(1, 49), 64, 80, 96, 100, 128]
# transformers computes the slopes in float32 (BLOOM raises a float32 base to integer powers, so its
# rounding grows with the power: at most 6.8e-7 relative up to 128 heads): agreement to that, relative.
FLOAT32_RTOL = 2e-6


def _transformers_bloom(num_heads):
    """BLOOM's slopes from build_alibi_tensor: with an all-ones mask it returns slope * key position
    (positions 0, 1, 2), so position 1 holds the slope itself (times 1: exact)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 3, dtype=torch.long), num_heads, torch.float32)  # (N, 1, 3)
    assert tuple(alibi.shape) == (num_heads, 1, 3)
    assert torch.equal(alibi[:, 0, 0], torch.zeros(num_heads)) and torch.equal(alibi[:, 0, 2], 2 * alibi[:, 0, 1])
    return alibi[:, 0, 1].double().numpy()


def _transformers_mpt(num_heads, alibi_bias_max=8):
    """MPT's slopes from build_mpt_alibi_tensor: it returns slope * (key position - last position), the
    positions -2, -1, 0 for a length of 3, so position 1 holds minus the slope (times -1: exact)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    alibi = build_mpt_alibi_tensor(num_heads, 3, alibi_bias_max)  # (N, 1, 3)
    assert tuple(alibi.shape) == (num_heads, 1, 3)
    assert torch.equal(alibi[:, 0, 2], torch.zeros(num_heads)) and torch.equal(alibi[:, 0, 0], 2 * alibi[:, 0, 1])
    return -alibi[:, 0, 1].double().numpy()


@pytest.mark.parametrize("num_heads", HEAD_COUNTS)
def test_bloom_matches_transformers(num_heads):
    got = bloom_slopes(num_heads)
    assert got.shape == (num_heads,) and got.dtype == np.float64
    np.testing.assert_allclose(got, _transformers_bloom(num_heads), rtol=FLOAT32_RTOL, atol=0)


@pytest.mark.parametrize("alibi_bias_max", [8, 4, 16, 6.5])
@pytest.mark.parametrize("num_heads", HEAD_COUNTS)
def test_mpt_matches_transformers(num_heads, alibi_bias_max):
    got = mpt_slopes(num_heads, alibi_bias_max)
    assert got.shape == (num_heads,) and got.dtype == np.float64
    np.testing.assert_allclose(got, _transformers_mpt(num_heads, alibi_bias_max), rtol=FLOAT32_RTOL, atol=0)


def test_transformers_rules_agree_at_bias_max_8():
    """transformers' own two functions, neither through weights.alibi: the same slopes (to float32 rounding)
    at MPT's default alibi_bias_max, powers of two or not, as the module docstring says."""
    for n in HEAD_COUNTS:
        np.testing.assert_allclose(_transformers_mpt(n), _transformers_bloom(n), rtol=FLOAT32_RTOL, atol=0)


# NumPy only: these run everywhere.

def test_powers_of_two_agree_with_the_formula():
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        expected = np.array([2.0 ** (-8 * i / n) for i in range(1, n + 1)])
        np.testing.assert_allclose(bloom_slopes(n), expected, rtol=1e-15, atol=0)
        np.testing.assert_allclose(mpt_slopes(n), expected, rtol=1e-15, atol=0)
        np.testing.assert_allclose(mpt_slopes(n, alibi_bias_max=8), expected, rtol=1e-15, atol=0)


def test_eight_heads():
    expected = np.array([1 / 2**k for k in range(1, 9)])  # 1/2, 1/4, ..., 1/256
    assert np.array_equal(bloom_slopes(8), expected)
    assert np.array_equal(mpt_slopes(8), expected)


def test_six_heads_written_out():
    """6 heads: BLOOM takes 2^(-8k/4) for k = 1..4 (largest power of two 4), then the odd-numbered
    slopes 2^(-8j/8), j = 1, 3, of the 8-head rule. MPT takes 2^(-i b/8), i = 1..8 (next power of two 8),
    even-numbered first, then odd-numbered, the first 6."""
    bloom = [2.0 ** (-8 * k / 4) for k in range(1, 5)] + [2.0 ** (-8 * j / 8) for j in (1, 3)]
    assert np.array_equal(bloom_slopes(6), np.array(bloom))
    for b in (8, 16, 3):
        mpt = [2.0 ** (-i * b / 8) for i in (2, 4, 6, 8, 1, 3)]
        np.testing.assert_allclose(mpt_slopes(6, b), np.array(mpt), rtol=1e-15, atol=0)


def test_rules_agree_at_bias_max_8_for_every_head_count():
    """The measured fact in the module docstring: at alibi_bias_max = 8 the rules coincide, bitwise, for
    head counts that are not powers of two too (6, 12, 40 among them)."""
    for n in range(1, 257):
        assert np.array_equal(bloom_slopes(n), mpt_slopes(n)), n


def test_rules_differ_when_bias_max_is_not_8():
    for n in (6, 8, 12, 40):
        mpt = mpt_slopes(n, alibi_bias_max=16)
        assert not np.allclose(mpt, bloom_slopes(n), rtol=1e-3, atol=0), n
        np.testing.assert_allclose(mpt, bloom_slopes(n) ** 2, rtol=1e-14, atol=0)  # 2^(-16x) = (2^(-8x))^2
    assert mpt_slopes(6, 16)[0] == 2.0**-4 and bloom_slopes(6)[0] == 2.0**-2


def test_mutant_power_of_two_rule_on_six_heads():
    """The porting bug: the power-of-two formula applied to a head count that is not one."""
    mutant = np.array([2.0 ** (-8 * i / 6) for i in range(1, 7)])
    relative = np.abs(mutant - bloom_slopes(6)) / bloom_slopes(6)
    assert relative.max() > 1e-3, relative  # far beyond round-off (about 1e-16)
    assert not np.allclose(np.sort(mutant), np.sort(bloom_slopes(6)), rtol=1e-3, atol=0)  # not a reordering


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "8", None, np.float64(4.0), [8]])
def test_num_heads_errors(value):
    for rule in (bloom_slopes, mpt_slopes):
        with pytest.raises(ValueError) as caught:
            rule(value)
        message = str(caught.value)
        assert "\n" not in message and message.startswith("num_heads must be a positive integer: got "), message
        assert repr(value) in message


def test_num_heads_accepts_numpy_integers():
    assert np.array_equal(bloom_slopes(np.int64(6)), bloom_slopes(6))
    assert np.array_equal(mpt_slopes(np.int32(6)), mpt_slopes(6))


@pytest.mark.parametrize("value", [0, -8, 0.0, float("nan"), float("inf"), True, "8", None, 10**400])
def test_alibi_bias_max_errors(value):
    with pytest.raises(ValueError) as caught:
        mpt_slopes(8, value)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("alibi_bias_max must be a finite number > 0: got "), message


def test_long_values_shown_on_one_line():
    with pytest.raises(ValueError) as caught:
        mpt_slopes(np.arange(30).reshape(3, 10))
    message = str(caught.value)
    assert "\n" not in message and message.endswith("...") and len(message) < 100, message
