"""The SDPA core (torch only): logits .. attend through F.scaled_dot_product_attention.

Stands where impl_numpy's chunked.py stands: a fast path that attention.py
chooses when it gives the stages' numbers, never a stage itself. It
expresses masks (bool or additive), causal, windows, local chunks and
segment ids (folded into the bool mask by functional.allowed_mask) and
ALiBi (its bias added to the call's by attention.py: SDPA's float mask, the
slopes' gradient through it); the clip, RoPE, QK-norm, the query temperature
and the cache come before it (attention.qkv_heads), the output gate after.
Softcap and sinks have no SDPA counterpart: attention.py sends such calls
to the stages. A latent layer's call arrives absorbed (attention.absorb_latent):
q (B, N, T, C+R) against one shared head k (B, 1, S, C+R), v the latent (B, 1,
S, C), at the config's scale (1/sqrt(H) by default, not 1/sqrt(C+R)).
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
    mask, causal of either alignment, window, local chunks, segments) and `bias`
    (the call's, plus ALiBi's) are folded
    into SDPA's attn_mask here.

    Rows with no allowed key never reach SDPA: what kernels return for them
    differs (0 from the CPU kernels of torch 2.13, measured in
    tests/test_torch.py; NaN from others), so such rows are opened to every key
    and their result is then replaced by the masked_row policy's: 0, the mean
    of v, or NaN. Gradients follow the policy too.
    """
    scale = config.effective_scale
    dtype = v.dtype  # the storage dtype: the result is stored in it even under autocast
    if plain_causal:
        return _grouped_sdpa(q, k, v, is_causal=True, scale=scale).to(dtype)
    if allowed is None and bias is None:
        return _grouped_sdpa(q, k, v, scale=scale).to(dtype)
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
    ctx = _grouped_sdpa(q, k, v, attn_mask=attn_mask, scale=scale)  # (B, N, T, V)
    ctx = ctx.to(dtype)
    # The policy's weights (0, 1/S or NaN) on every key times V, as the spec's attend: "zero" is
    # NaN in a value column holding a NaN (0 * NaN), "uniform" the mean of V, "nan" NaN, and V's
    # gradient is the spec's. The factor is 0 on every other row, so no NaN reaches their gradients.
    ct = compute_dtype(v.dtype)
    weight = {"zero": 0.0, "uniform": 1.0 / v.shape[2], "nan": float("nan")}[config.masked_row]
    zero = torch.zeros((), dtype=ct, device=v.device)
    factor = torch.where(empty, zero + weight, zero)  # (B|1, N|1, T, 1), 1/S in the compute dtype
    # (B, N, 1, V): query head n reads value head n // G (G = N // K; a latent layer's one shared head: N)
    v_sum = v.to(ct).sum(dim=2, keepdim=True).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.where(empty, (factor * v_sum).to(dtype), ctx)


def _grouped_sdpa(q, k, v, *, attn_mask=None, is_causal: bool = False, scale: float) -> torch.Tensor:
    """F.scaled_dot_product_attention with query head n reading key head n // G
    (G = N // K): q (B, N, T, H), k (B, K, S, H), v (B, K, S, V), attn_mask
    (B|1, N|1, T, S) -> (B, N, T, V).

    One query per head (a decode step, T = 1, not is_causal) with K < N:
    the G query heads of key head j are handed to SDPA as G query rows of j,
    q (B, K, G, H), plain attention for every backend: none repeats the keys
    and values (the whole cache) per query head, as SDPA's math fallback
    does under enable_gqa, and the kernel works on G rows per head instead
    of one (torch 2.13 CPU, whose flash kernel takes enable_gqa without a
    copy; 2-core VM, 2026-11-26, K 8, N 32, H 128, S 65537, float32: 66 ms
    against 156 ms with enable_gqa). Otherwise enable_gqa."""
    B, N, T, H = q.shape
    K = k.shape[1]
    if K == N:
        return nnF.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    if T != 1 or is_causal:
        return nnF.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                                enable_gqa=True)
    G = N // K
    if attn_mask is not None:  # (B|1, N|1, 1, S): row g of key head j is query head j * G + g
        Bm, Nm, _, S = attn_mask.shape
        attn_mask = attn_mask.reshape(Bm, K, G, S) if Nm == N else attn_mask.expand(Bm, 1, G, S)
    ctx = nnF.scaled_dot_product_attention(q.reshape(B, K, G, H), k, v, attn_mask=attn_mask, scale=scale)
    return ctx.reshape(B, N, 1, v.shape[-1])  # (B, K, G, V) -> (B, N, 1, V)
