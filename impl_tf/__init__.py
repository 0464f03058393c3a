"""Multi-head attention in Keras: a split_heads layer (seed 003's style) over
a keras.ops mirror of the NumPy spec (see functional.py), on Keras's
tensorflow, jax and torch backends.

Importing impl_tf selects Keras's TensorFlow backend (KERAS_BACKEND) unless
keras was already imported or KERAS_BACKEND says otherwise; it runs on the
backend keras is on (_keras.py). The chunked path and the in-place cache are
TensorFlow's alone (tf_only.py, chunked.py): NotImplementedError elsewhere.
"""

from weights.call import STAGES, TraceEntry

from ._keras import keras  # noqa: F401  (first: picks the backend)
from .attention import multi_head_attention
from .layer import MultiHeadAttention
from .masks import causal_mask, padding_mask, segment_mask, window_mask

__all__ = ["MultiHeadAttention", "STAGES", "TraceEntry", "causal_mask", "multi_head_attention", "padding_mask",
           "segment_mask", "window_mask"]
