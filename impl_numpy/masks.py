"""Masks in the reference convention (bool, True = may attend), and converters
from every foreign convention the frameworks use (docs/conventions.md measures them).

A converter is named after the convention it reads, so a port states its
source explicitly: `to_allowed("torch-mha-attn-mask", m, num_heads=N)`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from weights.contract import CAUSAL_ALIGNMENTS


def causal_mask(T: int, S: int, alignment: str = "top_left") -> np.ndarray:
    """(T, S) bool. top_left: key j visible to query i iff j <= i.
    bottom_right: iff j <= i + S - T (the last query sees every key, as in
    decoding with a cache)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    offset = 0 if alignment == "top_left" else S - T
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + offset  # (T, S)


def window_mask(T: int, S: int, left: int, right: int, alignment: str = "top_left") -> np.ndarray:
    """(T, S) bool: key j visible to query i iff p_i - left <= j <= p_i + right,
    p_i = i (top_left) or i + S - T (bottom_right), a bound of -1 unbounded.
    ONNX Attention's left_window_size / right_window_size (opset 25) and
    flash-attention's window_size=(left, right)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    aligned = np.arange(T)[:, None] + (0 if alignment == "top_left" else S - T)  # (T, 1): p_i
    j = np.arange(S)[None, :]  # (1, S)
    visible = np.ones((T, S), dtype=bool)
    if left >= 0:
        visible &= j >= aligned - left
    if right >= 0:
        visible &= j <= aligned + right
    return visible  # (T, S)


def chunk_mask(positions, key_positions, chunk: int) -> np.ndarray:
    """(B|1, 1, T, S) bool: key j visible to query i iff floor(pos_q(i) / chunk) == floor(pos_k(j) / chunk):
    absolute chunks of `chunk` positions (Llama 4's chunked local attention, attention_chunk_size)."""
    q_chunk = np.floor_divide(np.asarray(positions), chunk)  # (B|1, T)
    k_chunk = np.floor_divide(np.asarray(key_positions), chunk)  # (B|1, S)
    return (q_chunk[:, :, None] == k_chunk[:, None, :])[:, None]  # (B|1, 1, T, S)


def segment_mask(segment_ids, key_segment_ids) -> np.ndarray:
    """(B|1, 1, T, S) bool: key j visible to query i iff their segment ids are
    equal (packed sequences). Ids are (T,) or (B, T) and (S,) or (B, S)."""
    q_ids = np.asarray(segment_ids)
    k_ids = np.asarray(key_segment_ids)
    q_ids = q_ids[None] if q_ids.ndim == 1 else q_ids  # (B|1, T)
    k_ids = k_ids[None] if k_ids.ndim == 1 else k_ids  # (B|1, S)
    return (q_ids[:, :, None] == k_ids[:, None, :])[:, None]  # (B|1, 1, T, S)


def padding_mask(lengths, S: int) -> np.ndarray:
    """(B, 1, 1, S) bool: key j of batch b is visible iff j < lengths[b]."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise ValueError(f"lengths must be a 1-D integer array: got dtype {lengths.dtype} shape {lengths.shape}")
    if (lengths < 0).any() or (lengths > S).any():
        raise ValueError(f"lengths must lie in [0, S={S}]: got {lengths.tolist()}")
    return (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)


def as_rank4(mask: np.ndarray) -> np.ndarray:
    """(T, S) -> (1, 1, T, S); (B, T, S) -> (B, 1, T, S); rank 4 unchanged."""
    if mask.ndim == 2:
        return mask[None, None]
    if mask.ndim == 3:
        return mask[:, None]
    if mask.ndim == 4:
        return mask
    raise ValueError(f"mask must have rank 2, 3 or 4: got shape {mask.shape}")


def combine(*masks: np.ndarray | None) -> np.ndarray | None:
    """Logical AND of masks (None entries ignored), each read by `as_rank4`."""
    present = [as_rank4(np.asarray(m, dtype=bool)) for m in masks if m is not None]
    if not present:
        return None
    return np.logical_and.reduce(np.broadcast_arrays(*present)) if len(present) > 1 else present[0]


# -- foreign conventions -----------------------------------------------------

def _require_bool_or_01(argument: str, mask) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype == bool:
        return mask
    if mask.dtype.kind in "iuf" and np.isin(mask, (0, 1)).all():
        return mask.astype(bool)
    raise ValueError(f"{argument} must be bool or 0/1: got dtype {mask.dtype} with other values")


def from_torch_mha_attn_mask(mask, *, num_heads: int | None = None) -> np.ndarray:
    """torch nn.MultiheadAttention attn_mask (bool, True = NOT allowed).
    (T, S) or (B*N, T, S); the latter needs num_heads to become (B, N, T, S)."""
    allowed = ~_require_bool_or_01("attn_mask", mask)
    if allowed.ndim == 3:
        if not num_heads:
            raise ValueError("a 3-D torch attn_mask is (B*num_heads, T, S): pass num_heads")
        if allowed.shape[0] % num_heads:
            raise ValueError(f"attn_mask's first axis {allowed.shape[0]} is not a multiple of num_heads={num_heads}")
        allowed = allowed.reshape(-1, num_heads, *allowed.shape[1:])  # (B, N, T, S)
    return allowed


def from_torch_key_padding_mask(mask) -> np.ndarray:
    """torch key_padding_mask (B, S), True = padding (ignored) -> (B, 1, 1, S)."""
    ignore = _require_bool_or_01("key_padding_mask", mask)
    if ignore.ndim != 2:
        raise ValueError(f"key_padding_mask must have shape (B, S): got {ignore.shape}")
    return (~ignore)[:, None, None, :]


def from_allowed(mask) -> np.ndarray:
    """SDPA bool attn_mask, Keras attention_mask, Flax/JAX mask, ONNX bool
    attn_mask, seed 002's `mask == 0 -> -inf`: all True/1 = may attend."""
    return _require_bool_or_01("mask", mask)


def from_one_is_masked(mask) -> np.ndarray:
    """The split_heads tutorial (seed 003: `logits += mask * -1e9`) and seed
    004's triu buffer: 1/True = masked."""
    return ~_require_bool_or_01("mask", mask)


def from_additive(mask, *, masked_at_or_below: float = -1e4) -> np.ndarray:
    """An additive float mask of 0 (attend) and -inf / -1e9 style (masked).
    Any other value is a real bias, not a mask: pass it as `bias=` instead."""
    mask = np.asarray(mask, dtype=np.float64)
    masked = mask <= masked_at_or_below
    if not (masked | (mask == 0)).all():
        bad = mask[~(masked | (mask == 0))].flat[0]
        raise ValueError(
            f"additive mask holds {bad!r}, neither 0 nor <= {masked_at_or_below}: it is a bias, pass it as bias="
        )
    return ~masked


CONVENTIONS: dict[str, Callable[..., np.ndarray]] = {
    "torch-mha-attn-mask": from_torch_mha_attn_mask,
    "torch-key-padding-mask": from_torch_key_padding_mask,
    "sdpa-bool": from_allowed,
    "keras": from_allowed,
    "flax": from_allowed,
    "onnx-bool": from_allowed,
    "zero-is-masked": from_allowed,
    "one-is-masked": from_one_is_masked,
    "additive": from_additive,
}


def to_allowed(convention: str, mask, **kwargs) -> np.ndarray:
    """Convert a mask in a named foreign convention to bool, True = may attend."""
    try:
        convert = CONVENTIONS[convention]
    except KeyError:
        raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}: got {convention!r}") from None
    return convert(mask, **kwargs)
