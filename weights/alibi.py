"""ALiBi (Press et al. 2021, "Train Short, Test Long"): the per-head slopes.

ALiBi gives every query head n a slope m_n and adds -m_n * |pos_q - pos_k|
to that head's scaled logits (q.k * scale) before the softmax. Where and how
the contract applies that bias comes in a later change; this module gives
only the slopes, in float64, as the model families that use ALiBi define
them. tests/test_alibi.py checks them against transformers' own functions
where it is installed (those compute in float32), and against the formulas
written out where it is not.

- bloom_slopes: BLOOM (transformers, models/bloom/modeling_bloom.py,
  `build_alibi_tensor` through `_get_alibi_slopes`; the same rule as the
  ALiBi paper's reference code). With P the largest power of two <= N, head
  k (1..P) gets 2^(-8k/P). For N not a power of two, the N - P heads left
  over take the odd-numbered slopes of the rule for 2P heads, in order:
  2^(-8(2j-1)/(2P)) for j = 1..N-P.
- mpt_slopes: MPT (transformers, models/mpt/modeling_mpt.py,
  `build_mpt_alibi_tensor`, from MosaicML's attention.py). With P the
  smallest power of two >= N and b = alibi_bias_max, head i (1..P) gets
  2^(-i b / P). For N not a power of two, the P slopes are reordered as the
  even-numbered ones (i = 2, 4, ..., P) followed by the odd-numbered ones
  (i = 1, 3, ...), and the first N kept.

Measured (these functions, and tests/test_alibi.py): with MPT's default
b = 8 the two rules are the same rule for every head count, powers of two or
not. For 6, 12 and 40 heads (and every N in 1..128) bloom_slopes(N) and
mpt_slopes(N) are bitwise equal in float64: both orders put the 2^(-8k/P)
slopes of the largest power of two first and then the odd-numbered slopes of
the next one. transformers' two float32 functions differ only in rounding
(BLOOM raises a rounded base to integer powers): not at all for 6 heads, in
2 of 12 heads by at most 8.4e-8 relative (one float32 step) for 12, in 34
of 40 heads by at most 5.0e-7 relative for 40. The rules differ only when
b != 8 (MPT configs may set alibi_bias_max; BLOOM has no such setting), for
any head count: mpt_slopes(6, 16)[0] is 2^-4, bloom_slopes(6)[0] is 2^-2.
What does differ from both, for a head count that is not a power of two, is
the power-of-two formula applied to N as it stands (2^(-8k/N), k = 1..N):
for 6 heads it gives 2^(-4/3) where both rules give 2^-2 for the first head,
the porting bug these functions exist to avoid.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def _shown(value: object) -> str:
    text = " ".join(repr(value).split())  # one line, whatever the value's repr
    return text if len(text) <= 40 else text[:37] + "..."


def _check_num_heads(num_heads: object) -> int:
    # bool is an int subclass; True as a head count is always a mistake.
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer: got {_shown(num_heads)}")
    return int(num_heads)


def bloom_slopes(num_heads: int) -> np.ndarray:
    """(num_heads,) float64: BLOOM's ALiBi slope of each head, in head order."""
    N = _check_num_heads(num_heads)
    P = 1 << (N.bit_length() - 1)  # largest power of two <= N
    slopes = np.exp2(-8.0 * np.arange(1, P + 1, dtype=np.float64) / P)
    if N == P:
        return slopes
    # the odd-numbered slopes of the 2P-head rule: exponents -8(2j-1)/(2P) = -4(2j-1)/P, j = 1..N-P
    extra = np.exp2(-4.0 * np.arange(1, 2 * (N - P), 2, dtype=np.float64) / P)
    return np.concatenate([slopes, extra])


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8) -> np.ndarray:
    """(num_heads,) float64: MPT's ALiBi slope of each head, in head order."""
    N = _check_num_heads(num_heads)
    bad = isinstance(alibi_bias_max, bool) or not isinstance(alibi_bias_max, numbers.Real)
    try:
        bad = bad or not math.isfinite(float(alibi_bias_max)) or float(alibi_bias_max) <= 0
    except OverflowError:  # an int beyond float range
        bad = True
    if bad:
        raise ValueError(f"alibi_bias_max must be a finite number > 0: got {_shown(alibi_bias_max)}")
    P = 1 << (N - 1).bit_length()  # smallest power of two >= N
    slopes = np.exp2(-np.arange(1, P + 1, dtype=np.float64) * (float(alibi_bias_max) / P))
    if N == P:
        return slopes
    # slopes[1::2] holds i = 2, 4, ..., P (0-based index i - 1); slopes[::2] holds i = 1, 3, ...
    return np.concatenate([slopes[1::2], slopes[::2]])[:N]
