"""Mask builders in keras.ops, equal to impl_numpy/masks.py's (bool, True = may attend).

Foreign conventions are converted by impl_numpy.masks.to_allowed on NumPy
arrays; only the builders a model needs at run time live here.
"""

from __future__ import annotations

import numpy as np

from weights.contract import CAUSAL_ALIGNMENTS

from ._keras import keras
from .backend import is_symbolic

ops = keras.ops


def causal_mask(T, S, alignment: str = "top_left"):
    """(T, S) bool. top_left: key j visible to query i iff j <= i.
    bottom_right: iff j <= i + S - T (the last query sees every key, as in
    decoding with a cache). T and S may be traced scalars."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    offset = 0 if alignment == "top_left" else S - T
    return ops.arange(S)[None, :] <= ops.arange(T)[:, None] + offset  # (T, S)


def window_mask(T, S, left: int, right: int, alignment: str = "top_left"):
    """(T, S) bool: key j visible to query i iff p_i - left <= j <= p_i + right,
    p_i = i (top_left) or i + S - T (bottom_right), a bound of -1 unbounded.
    T and S may be traced scalars."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    aligned = ops.arange(T)[:, None] + (0 if alignment == "top_left" else S - T)  # (T, 1): p_i
    j = ops.arange(S)[None, :]  # (1, S)
    visible = ops.ones((T, S), dtype="bool")
    if left >= 0:
        visible = ops.logical_and(visible, j >= aligned - left)
    if right >= 0:
        visible = ops.logical_and(visible, j <= aligned + right)
    return visible  # (T, S)


def chunk_mask(positions, key_positions, chunk: int):
    """(B|1, 1, T, S) bool: key j visible to query i iff floor(pos_q(i) / chunk) == floor(pos_k(j) / chunk):
    absolute chunks of `chunk` positions (Llama 4's chunked local attention, attention_chunk_size).
    positions (B|1, T), key_positions (B|1, S): integers, divided with floor as NumPy's //."""
    q_chunk = ops.floor_divide(ops.convert_to_tensor(positions), chunk)  # (B|1, T)
    k_chunk = ops.floor_divide(ops.convert_to_tensor(key_positions), chunk)  # (B|1, S)
    return ops.equal(q_chunk[:, :, None], ops.cast(k_chunk, q_chunk.dtype)[:, None, :])[:, None]  # (B|1, 1, T, S)


def segment_mask(segment_ids, key_segment_ids):
    """(B|1, 1, T, S) bool: key j visible to query i iff their segment ids are
    equal (packed sequences). Ids are (T,) or (B, T) and (S,) or (B, S)."""
    q_ids = ops.convert_to_tensor(segment_ids)
    k_ids = ops.convert_to_tensor(key_segment_ids)
    q_ids = q_ids[None] if len(q_ids.shape) == 1 else q_ids  # (B|1, T)
    k_ids = k_ids[None] if len(k_ids.shape) == 1 else k_ids  # (B|1, S)
    return ops.equal(q_ids[:, :, None], ops.cast(k_ids, q_ids.dtype)[:, None, :])[:, None]  # (B|1, 1, T, S)


def padding_mask(lengths, S: int):
    """(B, 1, 1, S) bool: key j of batch b is visible iff j < lengths[b]."""
    if not ops.is_tensor(lengths):
        lengths = np.asarray(lengths)  # NumPy's reading of lists, as the reference
    dtype = keras.backend.standardize_dtype(lengths.dtype)
    if len(lengths.shape) != 1 or not dtype.startswith(("int", "uint")):
        raise ValueError(f"lengths must be a 1-D integer array: got dtype {dtype} shape {tuple(lengths.shape)}")
    if not is_symbolic(lengths):
        values = np.asarray(ops.convert_to_numpy(lengths))
        if (values < 0).any() or (values > S).any():
            raise ValueError(f"lengths must lie in [0, S={S}]: got {values.tolist()}")
    lengths = ops.convert_to_tensor(lengths)
    return (ops.arange(S, dtype=dtype)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
