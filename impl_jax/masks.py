"""Mask builders in JAX: mirrors impl_numpy/masks.py (bool, True = may attend).

Same names, arguments, results and error words as the reference; foreign
conventions are converted with impl_numpy's converters (NumPy, before the
call), so they are not repeated here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from weights.contract import CAUSAL_ALIGNMENTS


def causal_mask(T: int, S: int, alignment: str = "top_left") -> jax.Array:
    """(T, S) bool. top_left: key j visible to query i iff j <= i.
    bottom_right: iff j <= i + S - T (the last query sees every key, as in
    decoding with a cache). T and S are Python ints (static under jit)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    offset = 0 if alignment == "top_left" else S - T
    return jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + offset  # (T, S)


def window_mask(T: int, S: int, left: int, right: int, alignment: str = "top_left") -> jax.Array:
    """(T, S) bool: key j visible to query i iff p_i - left <= j <= p_i + right,
    p_i = i (top_left) or i + S - T (bottom_right), a bound of -1 unbounded.
    ONNX Attention's left_window_size / right_window_size (opset 25) and
    flash-attention's window_size=(left, right). T, S, left, right are Python
    ints (static under jit)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    aligned = jnp.arange(T)[:, None] + (0 if alignment == "top_left" else S - T)  # (T, 1): p_i
    j = jnp.arange(S)[None, :]  # (1, S)
    visible = jnp.ones((T, S), dtype=bool)
    if left >= 0:
        visible = visible & (j >= aligned - left)
    if right >= 0:
        visible = visible & (j <= aligned + right)
    return visible  # (T, S)


def chunk_mask(positions, key_positions, chunk: int) -> jax.Array:
    """(B|1, 1, T, S) bool: key j visible to query i iff floor(pos_q(i) / chunk) == floor(pos_k(j) / chunk):
    absolute chunks of `chunk` positions (Llama 4's chunked local attention, attention_chunk_size).
    positions (B|1, T) and key_positions (B|1, S) are integer arrays (traced under jit)."""
    q_chunk = jnp.floor_divide(jnp.asarray(positions), chunk)  # (B|1, T)
    k_chunk = jnp.floor_divide(jnp.asarray(key_positions), chunk)  # (B|1, S)
    return (q_chunk[:, :, None] == k_chunk[:, None, :])[:, None]  # (B|1, 1, T, S)


def segment_mask(segment_ids, key_segment_ids) -> jax.Array:
    """(B|1, 1, T, S) bool: key j visible to query i iff their segment ids are
    equal (packed sequences). Ids are (T,) or (B, T) and (S,) or (B, S),
    integer arrays (traced under jit)."""
    q_ids = jnp.asarray(segment_ids)
    k_ids = jnp.asarray(key_segment_ids)
    q_ids = q_ids[None] if q_ids.ndim == 1 else q_ids  # (B|1, T)
    k_ids = k_ids[None] if k_ids.ndim == 1 else k_ids  # (B|1, S)
    return (q_ids[:, :, None] == k_ids[:, None, :])[:, None]  # (B|1, 1, T, S)


def padding_mask(lengths, S: int) -> jax.Array:
    """(B, 1, 1, S) bool: key j of batch b is visible iff j < lengths[b].
    The range of lengths is checked when they are concrete (not under jit)."""
    if not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    if lengths.ndim != 1 or np.dtype(lengths.dtype).kind not in "iu":
        raise ValueError(f"lengths must be a 1-D integer array: got dtype {lengths.dtype} shape {lengths.shape}")
    if not isinstance(lengths, jax.core.Tracer):
        values = np.asarray(lengths)
        if (values < 0).any() or (values > S).any():
            raise ValueError(f"lengths must lie in [0, S={S}]: got {values.tolist()}")
    lengths = jnp.asarray(lengths)
    return (jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
