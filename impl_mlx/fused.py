"""The fused core (MLX only): logits .. attend through mx.fast.scaled_dot_product_attention.

Stands where impl_numpy's fused core and impl_torch's sdpa.py stand: a fast path that attention.py
chooses when it gives the stages' numbers, never a stage itself. It expresses masks (bool or additive),
causal of either alignment, windows, local chunks, segment ids and a selection (topk_indices, which
call.prepare ANDs into the mask) (folded into one bool mask by functional.allowed_mask), ALiBi and the
call's bias (one additive mask, the slopes' gradient through it: mx.vjp differentiates the kernel's
additive mask), sinks (the kernel's own `sinks=`) and grouped heads
(K < N: the kernel reads key head n // G itself, keys not tiled). The clip, RoPE, QK-norm, the query
temperature and the cache come before it (heads.qkv_heads), the output gate after. What it cannot take
(attention.plan says why): the weights or a trace (it returns neither), dropout (no keep-mask argument),
a logit softcap (no counterpart) and float64 (it computes in float32 whatever its inputs: measured
in tests/test_mlx.py). A latent layer's call arrives absorbed (latent.absorbed).

MLX's mask="causal" aligns bottom-right (the last query with the last key, as documented; measured in
tests/test_mlx.py): it is used only where that is the call's causal mask, nothing else masks, and T <= S
(with T > S its first T - S rows see no key, and MLX gives such a row the mean of V).
"""

from __future__ import annotations

import mlx.core as mx

from weights import AttentionConfig

from . import functional as F
from .convert import ct as compute_of
from .convert import scalar


def sdpa_attend(config: AttentionConfig, q, k, v, *, allowed, bias, sinks=None, bottom_right_causal: bool = False):
    """logits -> [alibi / bias] -> mask -> softmax [+ sinks] -> attend through
    mx.fast.scaled_dot_product_attention: q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> (B, N, T, V).

    bottom_right_causal: the only masking is causal aligned bottom-right (or T == S) with T <= S, so MLX's own
    mask="causal" applies. Otherwise `allowed` (rank 4 bool) and `bias` (compute dtype: the call's plus
    ALiBi's) become the kernel's mask.

    A row with no allowed key never reaches the kernel as such: MLX gives it the mean of V (its masked
    logits are a large finite negative, measured in tests/test_mlx.py), the spec the masked_row policy's
    weights. Such rows are opened to every key and their context replaced by the policy's weights (0, 1/S
    or NaN; 0 with sinks, whose mass then goes to the sink) times V, as the stages' attend: V's gradient
    is theirs, and the factor is 0 on every other row, so no NaN reaches their gradients."""
    scale = config.effective_scale
    dtype = q.dtype
    if bottom_right_causal:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal", sinks=sinks)
    if allowed is None and bias is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, sinks=sinks)
    T, S = q.shape[2], k.shape[2]
    finite = mx.array(True) if allowed is None else allowed
    if bias is not None:
        finite = finite & (bias > -mx.inf)  # (B|1, N|1, T|1, S|1)
    finite = mx.broadcast_to(finite, (*finite.shape[:2], T, S)) if finite.ndim == 4 else mx.broadcast_to(
        finite, (1, 1, T, S))
    empty = ~finite.any(axis=-1, keepdims=True)  # (B|1, N|1, T, 1)
    open_rows = finite | empty
    if bias is None:
        attn_mask = open_rows
    else:  # additive, in the inputs' dtype (the kernel's rule); a hidden position -inf
        safe = mx.where(bias > -mx.inf, bias, scalar(0, bias.dtype)).astype(dtype)
        attn_mask = mx.where(open_rows, safe, scalar(-float("inf"), dtype))
    ctx = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=attn_mask, sinks=sinks)  # (B, N, T, V)
    c = compute_of(v.dtype)
    weight = 0.0 if sinks is not None else {"zero": 0.0, "uniform": 1.0 / S, "nan": float("nan")}[config.masked_row]
    factor = mx.where(empty, scalar(weight, c), scalar(0, c))  # (B|1, N|1, T, 1)
    G = q.shape[1] // v.shape[1]
    v_sum = v.astype(c).sum(axis=2, keepdims=True)  # (B, K, 1, V)
    v_sum = mx.repeat(v_sum, G, axis=1) if G > 1 else v_sum  # (B, N, 1, V): query head n reads value head n // G
    return F.where(empty, (factor * v_sum).astype(dtype), ctx)  # a select in the gradient too (functional.where)
