"""The executable spec of multi-head attention in NumPy (see functional.py)."""

from weights.call import STAGES, TraceEntry

from .attention import multi_head_attention
from .backward import multi_head_attention_vjp
from .layer import MultiHeadAttention
from .masks import CONVENTIONS, causal_mask, combine, padding_mask, to_allowed

__all__ = [
    "CONVENTIONS", "MultiHeadAttention", "STAGES", "TraceEntry", "causal_mask", "combine",
    "multi_head_attention", "multi_head_attention_vjp", "padding_mask", "to_allowed",
]
