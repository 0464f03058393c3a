"""The SDPA core (torch only): logits .. attend through F.scaled_dot_product_attention.

Stands where impl_numpy's chunked.py stands: a fast path that attention.py
chooses when it gives the stages' numbers, never a stage itself. It
expresses masks (bool or additive), causal, windows and segment ids (folded
into the bool mask by functional.allowed_mask); RoPE, QK-norm and the cache
come before it (attention.qkv_heads). Softcap and sinks have no SDPA
counterpart: attention.py sends such calls to the stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnF

from weights import AttentionConfig

from .convert import compute_dtype


def sdpa_attend(config: AttentionConfig, q, k, v, *, allowed, bias, plain_causal: bool) -> torch.Tensor:
    """logits -> mask -> softmax -> attend through F.scaled_dot_product_attention:
    q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> (B, N, T, V).

    `plain_causal`: the only masking is top-left causal, so SDPA's own
    is_causal (top-left) applies. Otherwise `allowed` (functional.allowed_mask:
    mask, causal of either alignment, window, segments) and `bias` are folded
    into SDPA's attn_mask here.

    Rows with no allowed key never reach SDPA: what kernels return for them
    differs (0 from the CPU kernels of torch 2.13, measured in
    tests/test_torch.py; NaN from others), so such rows are opened to every key
    and their result is then replaced by the masked_row policy's: 0, the mean
    of v, or NaN. Gradients follow the policy too.
    """
    gqa = config.num_kv_heads != config.num_heads
    scale = config.effective_scale
    dtype = v.dtype  # the storage dtype: the result is stored in it even under autocast
    if plain_causal:
        return nnF.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa).to(dtype)
    if allowed is None and bias is None:
        return nnF.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa).to(dtype)
    finite = torch.ones((), dtype=torch.bool, device=q.device) if allowed is None else allowed
    if bias is not None:
        finite = finite & ~torch.isneginf(bias)  # (B|1, N|1, T|1, S|1)
    T, S = q.shape[2], k.shape[2]
    finite = finite.expand(*finite.shape[:2], T, S)
    empty = ~finite.any(dim=-1, keepdim=True)  # (B|1, N|1, T, 1)
    open_rows = finite | empty
    if bias is None:
        attn_mask = open_rows
    else:
        safe_bias = bias.masked_fill(torch.isneginf(bias), 0.0).to(q.dtype)
        attn_mask = safe_bias.masked_fill(~open_rows, float("-inf"))
    ctx = nnF.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)  # (B, N, T, V)
    ctx = ctx.to(dtype)
    # The policy's weights (0, 1/S or NaN) on every key times V, as the spec's attend: "zero" is
    # NaN in a value column holding a NaN (0 * NaN), "uniform" the mean of V, "nan" NaN, and V's
    # gradient is the spec's. The factor is 0 on every other row, so no NaN reaches their gradients.
    ct = compute_dtype(v.dtype)
    weight = {"zero": 0.0, "uniform": 1.0 / v.shape[2], "nan": float("nan")}[config.masked_row]
    zero = torch.zeros((), dtype=ct, device=v.device)
    factor = torch.where(empty, zero + weight, zero)  # (B|1, N|1, T, 1), 1/S in the compute dtype
    v_sum = v.to(ct).sum(dim=2, keepdim=True).repeat_interleave(config.group_size, dim=1)  # (B, N, 1, V)
    return torch.where(empty, (factor * v_sum).to(dtype), ctx)
