"""Multi-head attention in JAX / Flax NNX, mirroring the NumPy spec (impl_numpy).

- `apply(config, params, query, ...)`: pure; works under jax.jit (static
  arguments: STATIC_ARGNAMES), jax.grad and jax.vmap.
- `MultiHeadAttention`: an nnx.Module holding the canonical tensors as nnx.Params.
- `causal_mask`, `padding_mask`, `window_mask`, `segment_mask`: the
  reference's masks as jax arrays.

Modules: functional.py the stages alone (mirrors impl_numpy/functional.py);
attention.py the call (the choice of path, and the stages run in order);
call.py its validation and the validated Call; heads.py the stages up to the
keys (mirrors impl_numpy/heads.py); fused.py the fused XLA expression;
chunked.py the chunked path; masks.py, layer.py, adapter.py (conformance),
native.py (Flax's own layers).

float64 needs JAX's x64 mode. Importing impl_jax does not switch it on (it is
process-wide and changes every JAX program's default dtypes); a float64 call
without it raises ValueError naming the fix. impl_jax.adapter, the
conformance entry point, switches it on when imported, since float64 is a
conformance dtype.
"""

from weights.call import STAGES, TraceEntry

from .attention import STATIC_ARGNAMES, apply, multi_head_attention
from .heads import trace_stages
from .layer import MultiHeadAttention, gpu_available, resolve_device
from .masks import causal_mask, padding_mask, segment_mask, window_mask

__all__ = [
    "MultiHeadAttention", "STAGES", "STATIC_ARGNAMES", "TraceEntry", "apply", "causal_mask", "gpu_available",
    "multi_head_attention", "padding_mask", "resolve_device", "segment_mask", "trace_stages", "window_mask",
]
