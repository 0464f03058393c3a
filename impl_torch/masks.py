"""Masks in the reference convention (bool, True = may attend), as torch tensors.

Mirrors impl_numpy/masks.py's builders: the same masks, element for element,
and the same error wording.
"""

from __future__ import annotations

import torch

from weights.contract import CAUSAL_ALIGNMENTS

from .convert import dtype_name, to_torch


def causal_mask(T: int, S: int, alignment: str = "top_left", device: torch.device | str | None = None) -> torch.Tensor:
    """(T, S) bool. top_left: key j visible to query i iff j <= i.
    bottom_right: iff j <= i + S - T (the last query sees every key, as in
    decoding with a cache)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    offset = 0 if alignment == "top_left" else S - T
    return torch.arange(S, device=device)[None, :] <= torch.arange(T, device=device)[:, None] + offset  # (T, S)


def window_mask(T: int, S: int, left: int, right: int, alignment: str = "top_left",
                device: torch.device | str | None = None) -> torch.Tensor:
    """(T, S) bool: key j visible to query i iff p_i - left <= j <= p_i + right,
    p_i = i (top_left) or i + S - T (bottom_right), a bound of -1 unbounded
    (ONNX Attention's left/right_window_size, flash-attention's window_size)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {alignment!r}")
    aligned = torch.arange(T, device=device)[:, None] + (0 if alignment == "top_left" else S - T)  # (T, 1): p_i
    j = torch.arange(S, device=device)[None, :]  # (1, S)
    visible = torch.ones((T, S), dtype=torch.bool, device=device)
    if left >= 0:
        visible = visible & (j >= aligned - left)
    if right >= 0:
        visible = visible & (j <= aligned + right)
    return visible  # (T, S)


def chunk_mask(positions: torch.Tensor, key_positions: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B|1, 1, T, S) bool: key j visible to query i iff floor(pos_q(i) / chunk) == floor(pos_k(j) / chunk):
    absolute chunks of `chunk` positions (Llama 4's chunked local attention, attention_chunk_size)."""
    q_chunk = torch.div(positions, chunk, rounding_mode="floor")  # (B|1, T)
    k_chunk = torch.div(key_positions, chunk, rounding_mode="floor")  # (B|1, S)
    return (q_chunk[:, :, None] == k_chunk[:, None, :])[:, None]  # (B|1, 1, T, S)


def segment_mask(segment_ids: torch.Tensor, key_segment_ids: torch.Tensor) -> torch.Tensor:
    """(B|1, 1, T, S) bool: key j visible to query i iff their segment ids are
    equal (packed sequences). Ids are (T,) or (B, T) and (S,) or (B, S)."""
    q_ids = segment_ids[None] if segment_ids.ndim == 1 else segment_ids  # (B|1, T)
    k_ids = key_segment_ids[None] if key_segment_ids.ndim == 1 else key_segment_ids  # (B|1, S)
    return (q_ids[:, :, None] == k_ids[:, None, :])[:, None]  # (B|1, 1, T, S)


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def padding_mask(lengths, S: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(B, 1, 1, S) bool: key j of batch b is visible iff j < lengths[b]."""
    lengths = to_torch(lengths, device)
    if lengths.ndim != 1 or lengths.dtype not in _INTEGER_DTYPES:
        raise ValueError(
            f"lengths must be a 1-D integer array: got dtype {dtype_name(lengths.dtype)} shape {tuple(lengths.shape)}"
        )
    if bool((lengths < 0).any()) or bool((lengths > S).any()):
        raise ValueError(f"lengths must lie in [0, S={S}]: got {lengths.tolist()}")
    arange = torch.arange(S, device=lengths.device)
    return (arange[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
