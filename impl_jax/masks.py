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
