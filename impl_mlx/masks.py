"""Mask builders in MLX: mirrors impl_numpy/masks.py (bool, True = may attend).

Same names, arguments, results and error words as the reference; foreign
conventions are converted with impl_numpy's converters (NumPy, before the
call), so they are not repeated here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from weights.contract import CAUSAL_ALIGNMENTS


def causal_mask(T: int, S: int, alignment: str = "top_left") -> mx.array:
    """(T, S) bool. top_left: key j visible to query i iff j <= i.
    bottom_right: iff j <= i + S - T (the last query sees every key, as in
    decoding with a cache; MLX's own mask="causal" is this one)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    offset = 0 if alignment == "top_left" else S - T
    return mx.arange(S)[None, :] <= mx.arange(T)[:, None] + offset  # (T, S)


def window_mask(T: int, S: int, left: int, right: int, alignment: str = "top_left") -> mx.array:
    """(T, S) bool: key j visible to query i iff p_i - left <= j <= p_i + right,
    p_i = i (top_left) or i + S - T (bottom_right), a bound of -1 unbounded."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    aligned = mx.arange(T)[:, None] + (0 if alignment == "top_left" else S - T)  # (T, 1): p_i
    j = mx.arange(S)[None, :]  # (1, S)
    visible = mx.ones((T, S), dtype=mx.bool_)
    if left >= 0:
        visible = visible & (j >= aligned - left)
    if right >= 0:
        visible = visible & (j <= aligned + right)
    return visible  # (T, S)


def chunk_mask(positions, key_positions, chunk: int) -> mx.array:
    """(B|1, 1, T, S) bool: key j visible to query i iff floor(pos_q(i) / chunk) == floor(pos_k(j) / chunk):
    absolute chunks of `chunk` positions (Llama 4's chunked local attention, attention_chunk_size)."""
    q_chunk = mx.floor_divide(mx.array(positions), chunk)  # (B|1, T)
    k_chunk = mx.floor_divide(mx.array(key_positions), chunk)  # (B|1, S)
    return (q_chunk[:, :, None] == k_chunk[:, None, :])[:, None]  # (B|1, 1, T, S)


def segment_mask(segment_ids, key_segment_ids) -> mx.array:
    """(B|1, 1, T, S) bool: key j visible to query i iff their segment ids are
    equal (packed sequences). Ids are (T,) or (B, T) and (S,) or (B, S)."""
    q_ids = mx.array(segment_ids)
    k_ids = mx.array(key_segment_ids)
    q_ids = q_ids[None] if q_ids.ndim == 1 else q_ids  # (B|1, T)
    k_ids = k_ids[None] if k_ids.ndim == 1 else k_ids  # (B|1, S)
    return (q_ids[:, :, None] == k_ids[:, None, :])[:, None]  # (B|1, 1, T, S)


def padding_mask(lengths, S: int) -> mx.array:
    """(B, 1, 1, S) bool: key j of batch b is visible iff j < lengths[b]."""
    values = np.asarray(lengths)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise ValueError(f"lengths must be a 1-D integer array: got dtype {values.dtype} shape {values.shape}")
    if (values < 0).any() or (values > S).any():
        raise ValueError(f"lengths must lie in [0, S={S}]: got {values.tolist()}")
    return (mx.arange(S)[None, :] < mx.array(values)[:, None])[:, None, None, :]  # (B, 1, 1, S)
