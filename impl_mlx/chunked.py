"""Exact attention over query and key blocks with an online softmax (no (T, S) array): mirrors
impl_numpy/chunked.py's recurrence (Milakov & Gimelshein 2018, the one flash-attention uses).

For each block of `chunk_size` queries a running max m, running sum l and running numerator acc are
rescaled as each block of `chunk_size` keys arrives, so the largest temporary is (B, N, chunk, chunk).
MLX needs no static shapes, so the blocks are plain Python slices (the last one shorter) and the loops
are Python loops building one lazy graph; mx.vjp differentiates through them. A key block that the causal
mask or a window hides from every query of the block is skipped (never read, as impl_numpy's and
impl_jax's cores skip it: a NaN value there reaches no row of that query block); with a selection
(topk_indices) so is a key block the mask, the selection in it, hides from every query of the block
(impl_numpy's skip_masked: most blocks of a long cache), judged on the host from the mask's values.

The stages run on each block as the plain path runs them on the whole (logits, softcap, alibi, mask), so
in 16 bits those round as the stages do; softmax, dropout and attend, merged into the running recurrence,
stay in the compute dtype until the context is stored (as the other mirrors' chunked cores). The heads
come in after the stages up to the present keys (heads.qkv_heads: project, clip, norm, rope, temperature,
the cache appended; a differential layer's values paired by value.pair, 2V wide, as the spec's chunked core
takes them) or a latent layer's absorbed heads (values_up: its value up-projection applied to each query
block's attended latent). The differential stage runs on each query block's stored context (its rows are
the whole call's rows: the stage mixes heads, not rows), before the gate. Masks are formed block by block from what the call holds: the mask's and
the bias's columns, causality and windows from the indices, local chunks and ALiBi from the positions,
segments from the ids. Sinks start each row's running max at its sink and its running sum at 1. The
output gate runs on each query block's context before its output projection.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from weights import AttentionConfig
from weights.contract import check_chunk_size

from . import functional as F
from .convert import ct as compute_of
from .convert import scalar
from .masks import chunk_mask, segment_mask


def _columns(array, T: int, S: int, t0: int, t1: int, s0: int, s1: int):
    """A rank-4 broadcastable array's (t0:t1, s0:s1) block, slicing only the full T and S axes."""
    if array is None:
        return None
    if array.shape[2] == T:
        array = array[:, :, t0:t1]
    if array.shape[3] == S:
        array = array[..., s0:s1]
    return array


def chunked_attention(config: AttentionConfig, call, q, k, v, *, is_causal: bool, causal_alignment: str,
                      chunk_size: int, values_up=None):
    """q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) (S: every key, the cache's included) -> output (B, T, O),
    the gate and the output projection applied. call: call.prepare's Call (masks, bias, keep, ids,
    positions, params)."""
    chunk_size = check_chunk_size(chunk_size)
    p = call.params
    B, N, T, H = q.shape
    K, S, V = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    dtype = q.dtype
    c = compute_of(dtype)
    offset = 0 if causal_alignment == "top_left" else S - T
    uppers = ([0] if is_causal else []) + ([config.window_right] if config.window_right >= 0 else [])
    upper = min(uppers) if uppers else None
    left = config.window_left if config.window_left >= 0 else None
    sinks = p.get("sinks")
    keep = call.keep
    rate = scalar(1.0 - config.dropout, c)
    q_ids = k_ids = None
    if call.segment_ids is not None:
        q_ids = call.segment_ids.reshape(-1, T)  # (B|1, T)
        k_ids = call.key_segment_ids.reshape(-1, S)  # (B|1, S)
    positions, key_positions = call.positions, call.every_key_position
    # with a selection, the mask's values on the host (one read; no gradient flows through a mask): the key blocks
    # it hides from every query of a query block are skipped
    shown = np.array(call.mask4) if call.selected and call.mask4 is not None else None
    fill = None if sinks is not None else {"zero": None, "uniform": 1.0 / S, "nan": float("nan")}[config.masked_row]
    outputs = []
    for t0 in range(0, T, chunk_size):
        t1 = min(t0 + chunk_size, T)
        Cq = t1 - t0
        qb = q[:, :, t0:t1]  # (B, N, Cq, H)
        rows = mx.arange(t0, t1)[:, None]  # (Cq, 1)
        if sinks is None:
            m = mx.full((B, N, Cq, 1), -float("inf"), dtype=c)
            l_sum = mx.zeros((B, N, Cq, 1), dtype=c)
        else:  # the sink joins every row first: max = sink, sum = exp(sink - sink) = 1 (its gradient)
            sink = sinks.astype(c).reshape(1, N, 1, 1)
            m = mx.broadcast_to(mx.stop_gradient(sink), (B, N, Cq, 1))
            l_sum = mx.broadcast_to(F.exp(sink - mx.stop_gradient(sink)), (B, N, Cq, 1))
        acc = mx.zeros((B, N, Cq, V), dtype=c)
        blocks = []
        for s0 in range(0, S, chunk_size):
            s1 = min(s0 + chunk_size, S)
            if upper is not None and s0 > t1 - 1 + offset + upper:
                continue  # after every query's last visible key
            if left is not None and s1 - 1 < t0 + offset - left:
                continue  # before every query's first visible key
            if shown is not None and not _columns(shown, T, S, t0, t1, s0, s1).any():
                continue  # the mask (a selection) hides the block from every query of this one
            blocks.append((s0, s1))
            cols = mx.arange(s0, s1)[None, :]  # (1, Ck)
            allowed = _columns(call.mask4, T, S, t0, t1, s0, s1)
            extra = []
            if upper is not None:
                extra.append((cols <= rows + offset + upper)[None, None])  # (1, 1, Cq, Ck)
            if left is not None:
                extra.append((cols >= rows + offset - left)[None, None])
            if config.local_chunk is not None:
                extra.append(chunk_mask(positions[:, t0:t1], key_positions[:, s0:s1], config.local_chunk))
            if q_ids is not None:
                extra.append(segment_mask(q_ids[:, t0:t1], k_ids[:, s0:s1]))  # (B|1, 1, Cq, Ck)
            for e in extra:
                allowed = e if allowed is None else allowed & e
            x = F.logits(qb, k[:, :, s0:s1], config.effective_scale)  # (B, N, Cq, Ck), stored
            if config.logit_softcap is not None:
                x = F.softcap(x, config.logit_softcap)
            if config.alibi:
                x = F.alibi(x, F.alibi_bias(p["alibi.slopes"], positions[:, t0:t1], key_positions[:, s0:s1],
                                            call.dtype, config.alibi_bias_dtype))
            x = F.mask_stage(x, allowed, _columns(call.bias4, T, S, t0, t1, s0, s1)).astype(c)
            m_new = mx.stop_gradient(mx.maximum(m, x.max(axis=-1, keepdims=True)))  # (B, N, Cq, 1)
            m_safe = mx.where(m_new == -float("inf"), scalar(0, c), m_new)
            correction = F.exp(m - m_safe)  # 0 while m is -inf
            e = F.exp(x - m_safe)  # masked -> exactly 0
            l_sum = l_sum * correction + e.sum(axis=-1, keepdims=True)
            if keep is not None:
                e = F.where(keep[:, :, t0:t1, s0:s1], e / rate, scalar(0, c))
            vb = v[:, :, s0:s1].astype(c)  # (B, K, Ck, V)
            contrib = mx.einsum("bkgts,bksv->bkgtv", e.reshape(B, K, G, Cq, s1 - s0), vb).reshape(B, N, Cq, V)
            acc = acc * correction + contrib
            m = m_new
        empty = l_sum == 0  # no allowed key in the row (l >= 1 otherwise: its max contributes exp(0))
        ctx = acc / F.where(empty, scalar(1, c), l_sum)  # "zero": an empty row's acc, 0 x V, as it is
        if fill is not None:  # the policy's weight on every key of an empty row (kept or dropped key by key),
            # 0 on the other rows, so that no NaN reaches their gradients (0 x NaN is NaN), as impl_jax's
            factor = mx.where(empty, scalar(fill, c), scalar(0, c))  # (B, N, Cq, 1): a constant
            if keep is None:
                v_sum = v.astype(c).sum(axis=2, keepdims=True)  # (B, K, 1, V)
                filled = factor * (mx.repeat(v_sum, G, axis=1) if G > 1 else v_sum)  # (B, N, Cq, V)
            else:
                filled = mx.zeros_like(acc)
                for s0, s1 in ((s, min(s + chunk_size, S)) for s in range(0, S, chunk_size)):
                    w = mx.where(keep[:, :, t0:t1, s0:s1], factor / rate, scalar(0, c))  # (B, N, Cq, Ck)
                    vb = v[:, :, s0:s1].astype(c)
                    filled = filled + mx.einsum("bkgts,bksv->bkgtv", w.reshape(B, K, G, Cq, s1 - s0),
                                                vb).reshape(B, N, Cq, V)
            ctx = F.where(empty, filled, ctx)
        ctx = ctx.astype(dtype)  # (B, N, Cq, V): the core's context, stored
        if values_up is not None:  # the attended latent (B, N, Cq, C) through each head's value up-projection
            ctx = F.expand_values(ctx, values_up)  # (B, N, Cq, V)
        if config.differential is not None:  # the halves subtracted with lambda, normed, scaled: (B, N/2, Cq, 2V)
            ctx = F.differential_stage(config, p, ctx)  # row by row: a query block's rows are the whole rows'
        if config.output_gate is not None:  # the gate's stages on this block's rows of the query input
            ctx = F.gate(ctx, F.gate_project(call.query[:, t0:t1], p["gate.kernel"], p.get("gate.bias")), N)
        outputs.append(F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias")))  # (B, Cq, O)
    return mx.concatenate(outputs, axis=1)  # (B, T, O)
