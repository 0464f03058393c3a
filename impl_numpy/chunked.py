"""Exact attention over key blocks with an online softmax (no (T, S) array).

Queries are taken in blocks of `chunk_size` rows and keys in blocks of
`chunk_size` columns, so the largest temporary is (B, N, chunk, chunk). For
each query block a running max m, running sum l and running numerator acc are
rescaled as each key block arrives (Milakov & Gimelshein 2018, the recurrence
flash-attention uses). Key blocks that the causal mask hides entirely are
skipped. The result equals functional.py's plain path to round-off.
"""

from __future__ import annotations

import numpy as np

from weights import compute_dtype


def _block(array, axis_sizes, t0, t1, s0, s1):
    """Slice a rank-4 broadcastable array's T and S axes where they are full."""
    if array is None:
        return None
    T, S = axis_sizes
    ts = slice(t0, t1) if array.shape[2] == T else slice(None)
    ss = slice(s0, s1) if array.shape[3] == S else slice(None)
    return array[:, :, ts, ss]


def chunked_attention_core(config, q, k, v, *, mask, bias, keep, is_causal, causal_alignment, chunk_size):
    """q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> context (B, N, T, V)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer: got {chunk_size!r}")
    B, N, T, H = q.shape
    K, S, V = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    dtype = q.dtype
    ct = compute_dtype(dtype)
    scale = ct.type(config.effective_scale)
    offset = 0 if causal_alignment == "top_left" else S - T
    rate = ct.type(1.0 - config.dropout)
    out = np.empty((B, N, T, V), dtype=dtype)
    kc, vc = k.astype(ct, copy=False), v.astype(ct, copy=False)
    rounds = ct != dtype  # 16-bit: stage results are rounded to the storage dtype
    for t0 in range(0, T, chunk_size):
        t1 = min(T, t0 + chunk_size)
        qb = q[:, :, t0:t1].astype(ct).reshape(B, K, G * (t1 - t0), H)  # (B, K, G*t, H)
        m = np.full((B, N, t1 - t0, 1), -np.inf, dtype=ct)
        l = np.zeros((B, N, t1 - t0, 1), dtype=ct)
        acc = np.zeros((B, N, t1 - t0, V), dtype=ct)
        uniform_acc = np.zeros((B, N, t1 - t0, V), dtype=ct) if config.masked_row == "uniform" else None
        for s0 in range(0, S, chunk_size):
            s1 = min(S, s0 + chunk_size)
            vb = vc[:, :, s0:s1]  # (B, K, s, V)
            keep_b = _block(keep, (T, S), t0, t1, s0, s1)
            if uniform_acc is not None:
                # A fully masked row's weights are 1/S everywhere (then dropout).
                wu = np.full((B, N, t1 - t0, s1 - s0), 1.0 / S, dtype=ct)
                if keep_b is not None:
                    wu = np.where(keep_b, wu / rate, 0)
                uniform_acc += np.matmul(wu.reshape(B, K, -1, s1 - s0), vb).reshape(B, N, t1 - t0, V)
            if is_causal and s0 > (t1 - 1) + offset:
                continue  # every key in this block is after every query: hidden
            # The stages of functional.py, on one block (same rounding rule), in place:
            # the block (B, N, t, s) is the only large temporary.
            x = np.matmul(qb, kc[:, :, s0:s1].swapaxes(-1, -2)).reshape(B, N, t1 - t0, s1 - s0)
            x *= scale
            if rounds:
                x = x.astype(dtype).astype(ct)
            if bias is not None:
                x += _block(bias, (T, S), t0, t1, s0, s1)
                if rounds:
                    x = x.astype(dtype).astype(ct)
            allowed = _block(mask, (T, S), t0, t1, s0, s1)
            if is_causal and s1 - 1 > t0 + offset:  # the block crosses the diagonal
                causal = np.arange(s0, s1)[None, :] <= np.arange(t0, t1)[:, None] + offset
                allowed = causal if allowed is None else allowed & causal
            if allowed is not None:
                np.copyto(x, ct.type(-np.inf), where=~allowed)
            m_new = np.maximum(m, x.max(axis=-1, keepdims=True))
            m_safe = np.where(m_new == -np.inf, 0, m_new)
            correction = np.exp(m - m_safe)  # 0 when m was -inf
            x -= m_safe
            e = np.exp(x, out=x)  # (B, N, t, s)
            l = l * correction + e.sum(axis=-1, keepdims=True)
            if keep_b is not None:
                e = np.where(keep_b, e / rate, 0)
            acc *= correction
            acc += np.matmul(e.reshape(B, K, -1, s1 - s0), vb).reshape(B, N, t1 - t0, V)
            m = m_new
        empty = l == 0
        ctx = acc / np.where(empty, 1, l)
        if empty.any():
            if config.masked_row == "zero":
                ctx = np.where(empty, 0, ctx)
            elif config.masked_row == "uniform":
                ctx = np.where(empty, uniform_acc, ctx)
            else:
                ctx = np.where(empty, np.nan, ctx)
        out[:, :, t0:t1] = ctx.astype(dtype)
    return out
