"""Independent formulations of multi-head attention, for checking the reference.

None of these calls impl_numpy's stages: they restate the contract the way the
seed documents write attention, so agreement is evidence, not tautology.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def _allowed(config, B, T, S, mask, is_causal, alignment):
    """Loop-built allowed[b, n, i, j] from the contract's rules."""
    N = config.num_heads
    allowed = np.ones((B, N, T, S), dtype=bool)
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        for b, n, i, j in itertools.product(range(B), range(N), range(T), range(S)):
            if m.ndim == 2:
                v = m[i, j]
            elif m.ndim == 3:
                v = m[b if m.shape[0] > 1 else 0, i if m.shape[1] > 1 else 0, j if m.shape[2] > 1 else 0]
            else:
                v = m[tuple(idx if dim > 1 else 0 for idx, dim in zip((b, n, i, j), m.shape))]
            allowed[b, n, i, j] = v
    if is_causal:
        offset = 0 if alignment == "top_left" else S - T
        for i, j in itertools.product(range(T), range(S)):
            if j > i + offset:
                allowed[:, :, i, j] = False
    return allowed


def _bias4(bias, B, N, T, S):
    if bias is None:
        return np.zeros((B, N, T, S))
    b = np.asarray(bias, dtype=np.float64)
    if b.ndim == 2:
        b = b[None, None]
    elif b.ndim == 3:
        b = b[:, None]
    return np.broadcast_to(b, (B, N, T, S))


def _row_softmax(logits, allowed_row, policy):
    """One row; logits may hold -inf from the bias."""
    ok = allowed_row & np.isfinite(logits)
    if not ok.any():
        return {"zero": np.zeros_like(logits), "uniform": np.full_like(logits, 1 / len(logits)),
                "nan": np.full_like(logits, np.nan)}[policy]
    z = np.where(ok, logits, -np.inf)
    e = np.exp(z - z[ok].max())
    return e / e.sum()


def per_head_loop(config, tensors, query, key, value, *, mask=None, bias=None, is_causal=False,
                  causal_alignment="top_left", dropout_mask=None, return_weights=False):
    """Seed 001's style: one small attention per head, outputs concatenated,
    then one output Linear. float64."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    q_in, k_in, v_in = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    B, T, _ = q_in.shape
    S = k_in.shape[1]
    N, G = config.num_heads, config.group_size
    allowed = _allowed(config, B, T, S, mask, is_causal, causal_alignment)
    bias4 = _bias4(bias, B, N, T, S)
    heads, all_w = [], np.zeros((B, N, T, S))
    for n in range(N):
        kv = n // G
        q = q_in @ t["query.kernel"][:, n] + (t["query.bias"][n] if config.use_query_bias else 0)
        k = k_in @ t["key.kernel"][:, kv] + (t["key.bias"][kv] if config.use_key_bias else 0)
        v = v_in @ t["value.kernel"][:, kv] + (t["value.bias"][kv] if config.use_value_bias else 0)
        scores = q @ k.transpose(0, 2, 1) * config.effective_scale + bias4[:, n]  # (B, T, S)
        w = np.zeros((B, T, S))
        for b, i in itertools.product(range(B), range(T)):
            w[b, i] = _row_softmax(scores[b, i], allowed[b, n, i], config.masked_row)
        all_w[:, n] = w
        if dropout_mask is not None:
            w = np.where(dropout_mask[:, n], w / (1 - config.dropout), 0.0)
        heads.append(w @ v)  # (B, T, V)
    concat = np.concatenate(heads, axis=-1)  # (B, T, N*V)
    out = concat @ t["output.kernel"].reshape(-1, config.out_dim)
    if config.use_output_bias:
        out = out + t["output.bias"]
    return (out, all_w) if return_weights else out


def fused_qkv(config, tensors, x, *, is_causal=False):
    """Seed 000/002's style for self attention: one (D, 3*N*H) projection,
    split into q, k, v by slicing, heads by reshape. Needs N == K and V == H."""
    assert config.num_kv_heads == config.num_heads and config.value_head_dim == config.head_dim
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    D, N, H = t["query.kernel"].shape
    E = N * H
    w_qkv = np.concatenate([t[f"{p}.kernel"].reshape(D, E) for p in ("query", "key", "value")], axis=1)  # (D, 3E)
    b_qkv = np.concatenate([
        t[f"{p}.bias"].reshape(E) if f"{p}.bias" in t else np.zeros(E) for p in ("query", "key", "value")
    ])
    x = np.asarray(x, dtype=np.float64)
    B, T, _ = x.shape
    qkv = (x @ w_qkv + b_qkv).reshape(B, T, 3, N, H).transpose(2, 0, 3, 1, 4)  # (3, B, N, T, H)
    q, k, v = qkv
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(H) if config.scale is None else q @ k.transpose(0, 1, 3, 2) * config.scale
    if is_causal:
        scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(-1, keepdims=True)
    ctx = (w @ v).transpose(0, 2, 1, 3).reshape(B, T, E)
    out = ctx @ t["output.kernel"].reshape(E, -1)
    return out + t["output.bias"] if "output.bias" in t else out


def scalar_loop(config, tensors, query, key, value, *, is_causal=False):
    """Every sum written as a Python loop over scalars (tiny sizes only)."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    B, T, Dq = query.shape
    S = key.shape[1]
    N, K, H, V, O = config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim, config.out_dim
    G = N // K

    def lin(x, kernel, bias, heads, width):
        y = np.zeros((x.shape[0], heads, width))
        for l, h, w in itertools.product(range(x.shape[0]), range(heads), range(width)):
            acc = bias[h, w] if bias is not None else 0.0
            for d in range(x.shape[1]):
                acc += x[l, d] * kernel[d, h, w]
            y[l, h, w] = acc
        return y

    out = np.zeros((B, T, O))
    for b in range(B):
        q = lin(query[b], t["query.kernel"], t.get("query.bias"), N, H)
        k = lin(key[b], t["key.kernel"], t.get("key.bias"), K, H)
        v = lin(value[b], t["value.kernel"], t.get("value.bias"), K, V)
        ctx = np.zeros((T, N, V))
        for n, i in itertools.product(range(N), range(T)):
            scores = []
            for j in range(S):
                if is_causal and j > i:
                    scores.append(-math.inf)
                    continue
                scores.append(sum(q[i, n, h] * k[j, n // G, h] for h in range(H)) * config.effective_scale)
            top = max(scores)
            e = [math.exp(s - top) if s != -math.inf else 0.0 for s in scores]
            total = sum(e)
            for j in range(S):
                for c in range(V):
                    ctx[i, n, c] += e[j] / total * v[j, n // G, c]
        for i, o in itertools.product(range(T), range(O)):
            acc = t["output.bias"][o] if "output.bias" in t else 0.0
            for n, c in itertools.product(range(N), range(V)):
                acc += ctx[i, n, c] * t["output.kernel"][n, c, o]
            out[b, i, o] = acc
    return out
