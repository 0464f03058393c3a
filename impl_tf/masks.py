"""Mask builders in keras.ops, equal to impl_numpy/masks.py's (bool, True = may attend).

Foreign conventions are converted by impl_numpy.masks.to_allowed on NumPy
arrays; only the builders a model needs at run time live here.
"""

from __future__ import annotations

import numpy as np

from weights.contract import CAUSAL_ALIGNMENTS

from ._keras import keras, tf

ops = keras.ops


def causal_mask(T, S, alignment: str = "top_left"):
    """(T, S) bool. top_left: key j visible to query i iff j <= i.
    bottom_right: iff j <= i + S - T (the last query sees every key, as in
    decoding with a cache). T and S may be traced scalars."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    offset = 0 if alignment == "top_left" else S - T
    return ops.arange(S)[None, :] <= ops.arange(T)[:, None] + offset  # (T, S)


def padding_mask(lengths, S: int):
    """(B, 1, 1, S) bool: key j of batch b is visible iff j < lengths[b]."""
    if not tf.is_tensor(lengths):
        lengths = np.asarray(lengths)  # NumPy's reading of lists, as the reference
    dtype = keras.backend.standardize_dtype(lengths.dtype)
    if len(lengths.shape) != 1 or not dtype.startswith(("int", "uint")):
        raise ValueError(f"lengths must be a 1-D integer array: got dtype {dtype} shape {tuple(lengths.shape)}")
    if not tf.is_tensor(lengths) or tf.executing_eagerly():
        values = np.asarray(ops.convert_to_numpy(lengths))
        if (values < 0).any() or (values > S).any():
            raise ValueError(f"lengths must lie in [0, S={S}]: got {values.tolist()}")
    lengths = ops.convert_to_tensor(lengths)
    return (ops.arange(S, dtype=dtype)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
