"""Multi-head attention in PyTorch, mirroring the NumPy spec (impl_numpy) stage by stage."""

from weights.call import STAGES, TraceEntry

from .attention import multi_head_attention
from .device import devices, matmul_precision, resolve_device
from .layer import MultiHeadAttention
from .masks import causal_mask, padding_mask, segment_mask, window_mask

__all__ = [
    "MultiHeadAttention", "STAGES", "TraceEntry", "causal_mask", "devices", "matmul_precision",
    "multi_head_attention", "padding_mask", "resolve_device", "segment_mask", "window_mask",
]
