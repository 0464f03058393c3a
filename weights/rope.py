"""Rotary position embedding: the frequencies a Rope config stands for.

The frequencies are constants of the layer (a function of the config only),
so the contract computes them once, in float64, for every implementation;
each implementation then forms the angles (position x frequency), their cos
and sin and the rotation with its own framework's ops, in its compute dtype.
tests/test_rope.py checks these rules against transformers' own
`modeling_rope_utils` where it is installed, and against the formulas
written out independently where it is not.

Pair i of the rotary_dim/2 pairs turns at inv_freq[i] = theta^(-2i/rotary_dim)
radians per position, then:
- linear: inv_freq / factor (the same as positions / factor).
- llama3 (Llama 3.1's rope_scaling): wavelengths 2 pi / inv_freq longer than
  original_max_position_embeddings / low_freq_factor are divided by factor,
  shorter than original_max_position_embeddings / high_freq_factor kept, and
  in between interpolated with smooth = (original / wavelength -
  low_freq_factor) / (high_freq_factor - low_freq_factor). With equal
  factors (Llama 4 Scout: 1 and 1) there is no band between: a step, kept
  up to original / low_freq_factor inclusive and divided past it (Meta's
  apply_scaling and transformers' _compute_llama3_parameters agree
  everywhere but at a wavelength of exactly that length, where Meta's
  asserts and transformers divides 0 by 0; no frequency theta^(-2i/R) hits it).
- yarn (Peng et al. 2023; gpt-oss, Qwen, DeepSeek configs): pair i blends
  inv_freq / factor (interpolation) with inv_freq (extrapolation) by a
  linear ramp over the pair index between the dimensions where a frequency
  turns beta_fast and beta_slow times over original_max_position_embeddings
  (rounded outwards when truncate); cos and sin are multiplied by
  attention_factor.
- longrope (Phi-3.5, Phi-4-mini): inv_freq / short_factor[i] for a call
  whose largest position + 1 is at most original_max_position_embeddings,
  inv_freq / long_factor[i] past it (the call's choice: rope_tables'
  max_position); cos and sin are multiplied by attention_factor.
- proportional (Gemma 4): the head's first partial_rotary_factor * R/2 pairs
  turn at theta^(-2i/R) / factor, the rest not at all (frequency 0: cos 1,
  sin 0), so the pairs stay half-split over the whole head.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .config import Rope


def inverse_frequencies(rope: Rope, *, long: bool = False) -> np.ndarray:
    """(rotary_dim/2,) float64 radians per position of each rotating pair (longrope: the short table, or
    the long one with long=True)."""
    R = rope.rotary_dim
    base = rope.theta ** (-np.arange(0, R, 2, dtype=np.float64) / R)  # (R/2,)
    scaling = rope.scaling
    if scaling is None:
        return base
    if scaling.type == "linear":
        return base / scaling.factor
    if scaling.type == "longrope":
        return base / np.asarray(scaling.long_factor if long else scaling.short_factor, dtype=np.float64)
    if scaling.type == "proportional":
        turning = int(scaling.partial_rotary_factor * R // 2)  # transformers: int(partial_rotary_factor * H // 2)
        return np.where(np.arange(R // 2) < turning, base, 0.0) / scaling.factor
    if scaling.type == "llama3":
        original = scaling.original_max_position_embeddings
        low_wavelength = original / scaling.low_freq_factor
        high_wavelength = original / scaling.high_freq_factor
        wavelength = 2 * math.pi / base
        scaled = np.where(wavelength > low_wavelength, base / scaling.factor, base)
        if scaling.high_freq_factor == scaling.low_freq_factor:  # no band between: a step (Llama 4 Scout's 1, 1)
            return scaled
        smooth = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor
                                                                    - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return np.where(medium, blended, scaled)
    # yarn
    original = scaling.original_max_position_embeddings

    def dimension_of(rotations: float) -> float:  # the (fractional) dimension turning `rotations` times over original
        return R * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001  # as transformers: a ramp of zero width would divide by zero
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency; 0: divide it by factor
    return base / scaling.factor * (1.0 - extrapolation) + base * extrapolation


def attention_factor(rope: Rope) -> float:
    """What cos and sin are multiplied by: yarn's and longrope's attention_factor, else 1."""
    scaling = rope.scaling
    return scaling.attention_factor if scaling is not None and scaling.type in ("yarn", "longrope") else 1.0


def uses_long_table(rope: Rope, max_position: int | None) -> bool:
    """longrope: does a call whose largest position (queries' and new keys') is max_position take the long
    table? True iff max_position + 1 > original_max_position_embeddings (transformers' longrope update:
    seq_len = max(position_ids) + 1). Always False for the other rules."""
    scaling = rope.scaling
    return (scaling is not None and scaling.type == "longrope" and max_position is not None
            and max_position + 1 > scaling.original_max_position_embeddings)


def rope_tables(rope: Rope, max_position: int | None = None) -> tuple[np.ndarray, float]:
    """A Rope config's rotary frequencies (float64, a fresh array) and attention factor, computed once per
    (hashable) Rope. The mirrors form angles, cos and sin from them in their own ops. max_position: the
    call's largest position, which picks longrope's table (uses_long_table); None: the short one."""
    inv_freq, factor = _tables(rope, uses_long_table(rope, max_position))
    return inv_freq.copy(), factor


@functools.lru_cache(maxsize=64)
def _tables(rope: Rope, long: bool) -> tuple[np.ndarray, float]:
    return inverse_frequencies(rope, long=long), attention_factor(rope)


def mrope_axes(rope: Rope) -> np.ndarray | None:
    """Multimodal RoPE: (rotary_dim/2,) int64, the position axis (0 temporal, 1 height, 2 width) that turns
    each rotating pair; None without rope.mrope_section. Contiguous sections (Qwen2-VL, Qwen2.5-VL:
    transformers' recomposition_frequencies splits the pairs by mrope_section and takes axis i % 3 of
    chunk i): pairs [0, t) by t, [t, t + h) by h, the rest by w. Interleaved (Qwen3-VL's
    recomposition_frequencies): pair i by h where i % 3 == 1 and i < 3 h, by w where i % 3 == 2 and
    i < 3 w, else by t. The config has checked that the sections count rotary_dim/2 pairs."""
    if rope.mrope_section is None:
        return None
    return _axes(rope.mrope_section, rope.mrope_interleaved).copy()


@functools.lru_cache(maxsize=64)
def _axes(section: tuple[int, int, int], interleaved: bool) -> np.ndarray:
    pairs = np.arange(sum(section))
    if not interleaved:
        return np.repeat(np.arange(3, dtype=np.int64), section)  # (R/2,)
    axes = np.zeros(len(pairs), dtype=np.int64)
    for axis in (1, 2):
        axes[(pairs % 3 == axis) & (pairs < 3 * section[axis])] = axis
    return axes  # (R/2,)
