"""Multi-head attention in MLX, mirroring the NumPy spec (impl_numpy).

- `multi_head_attention(config, params, query, ...)`: the call; mx.vjp / mx.grad differentiate it.
- `MultiHeadAttention`: an mlx.nn.Module holding the canonical tensors as parameters.
- `causal_mask`, `padding_mask`, `window_mask`, `segment_mask`: the reference's masks as mx.arrays.

Modules: functional.py the stages alone (mirrors impl_numpy/functional.py); attention.py the call (plan:
the choice of path, and the stages run in order); call.py its validation and the validated Call; heads.py
the stages up to the keys (mirrors impl_numpy/heads.py); latent.py MLA's; indexer.py the lightning indexer
(mirrors impl_numpy/indexer.py; call.py runs it for a config with `indexer`); fused.py the fused core
(mx.fast.scaled_dot_product_attention); chunked.py the chunked core; masks.py, layer.py, adapter.py
(conformance), convert.py (dtypes and arrays at the edges).

MLX wheels: mlx-cpu on Linux x86-64, mlx on macOS arm64 (Metal). float64 runs on the CPU device only.
mx.vjp, mx.grad and nn.value_and_grad differentiate every path; mx.compile does not take the call: it
reads values on the host (the contract's checks of infinities, bias and positions, longrope's choice of
table), as impl_numpy does. What MLX computes differently and how the stages keep to the spec:
docs/conventions.md (MLX).
"""

from weights.call import STAGES, TraceEntry

from .attention import multi_head_attention, plan
from .heads import trace_stages
from .layer import MultiHeadAttention, gpu_available, resolve_device
from .masks import causal_mask, padding_mask, segment_mask, window_mask

__all__ = [
    "MultiHeadAttention", "STAGES", "TraceEntry", "causal_mask", "gpu_available", "multi_head_attention",
    "padding_mask", "plan", "resolve_device", "segment_mask", "trace_stages", "window_mask",
]
