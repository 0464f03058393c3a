"""Multi-head attention, one pure function per stage: the executable spec.

Every impl_*/functional.py mirrors this file: same stage functions, same
names, same einsum strings, same order. A disagreement between two backends
therefore names a stage.

Shape letters (used in every comment and einsum string of the project):
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages (the bracketed ones where the config turns them on):
project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope]
-> [query temperature] -> [cache appended] -> logits (scale) -> [softcap] -> [alibi] -> mask (bias,
causal, window, local chunks, segments) -> softmax [+ sinks] -> dropout ->
attend -> [gate] -> merge_heads -> output.

The call that runs them (and chooses the fast paths) is attention.py; this
file holds the stages alone.

Precision rule: each stage's result is stored in the storage dtype; its
arithmetic (matmul accumulation, exp and sums) runs in `compute_dtype`,
float32 for float16/bfloat16 inputs, the dtype itself otherwise.
"""

from __future__ import annotations

import numpy as np

from weights import compute_dtype, dtype_from_name

from .masks import causal_mask, chunk_mask, segment_mask, window_mask


def _matmul(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    ct = compute_dtype(dtype)
    return np.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False)).astype(dtype, copy=False)


def _product_plus_bias(y: np.ndarray, bias: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """A matmul result y (compute dtype) plus bias, stored in dtype. The product
    is rounded to the storage dtype before the bias is added (the rounding rule);
    in float32/float64 that rounding is the identity, so the add runs in place."""
    if bias is not None:
        if y.dtype != dtype:
            y = y.astype(dtype).astype(y.dtype)
        y += bias
    return y.astype(dtype, copy=False)


def _matmul_2d(x: np.ndarray, kernel2d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (B, L, D) times (D, F) as one (B*L, D) GEMM in compute dtype: one
    large matmul runs near the BLAS roofline, B small ones do not."""
    B, L, D = x.shape
    ct = compute_dtype(x.dtype)
    y = np.matmul(x.reshape(B * L, D).astype(ct, copy=False), kernel2d.astype(ct, copy=False),
                  out=None if out is None else out.reshape(B * L, -1))  # (B*L, F)
    return y.reshape(B, L, -1)


# -- stages --------------------------------------------------------------------

def project(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F).
    out: a contiguous (B, L, F) array to compute into (float32/float64 only)."""
    D = kernel.shape[0]
    y = _matmul_2d(x, kernel.reshape(D, -1), out)  # (B, L, F)
    return _product_plus_bias(y, None if bias is None else bias.reshape(-1), x.dtype)


def clip(x: np.ndarray, c: float) -> np.ndarray:
    """QKV clip: a projection clamped to [-c, c] (MPT's and OLMo's clip_qkv, after the projection's bias),
    c rounded to the storage dtype first (as torch.clamp rounds a Python bound, and NumPy for float16 under
    NEP 50; ml_dtypes would compare bfloat16 in float32 against the unrounded c): clip_bound."""
    bound = clip_bound(c, x.dtype)
    return np.clip(x, -bound, bound).astype(x.dtype, copy=False)


def clip_bound(c: float, dtype) -> np.generic:
    """The clip's bound in the storage dtype: the values the clip passes (and its gradient) are those with
    |x| <= this, bounds included."""
    return np.dtype(dtype).type(c)


def norm(x: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, kind: str, eps: float, heads: int,
         scope: str) -> np.ndarray:
    """QK-norm (or the value norm) of a projection x (B, L, F = heads*W), in compute dtype.
    scope "head": each head's W features normalised on their own, scale/bias (W,)
    shared by the heads (Qwen3, Gemma 3) or (heads, W), one per head (Cohere);
    "all": the whole F at once, scale/bias (heads, W) (OLMo 2); scale None: a
    weightless norm (Llama 4's L2 norm, Gemma 3n's value norm). The stage runs
    on the flat projection in both scopes ("head" views it as (B, L, heads, W)
    inside), so its trace has one layout (a norm after RoPE: norm_heads). kind
    "rms": x / sqrt(mean(x^2) + eps) * scale; "layer": (x - mean) / sqrt(var +
    eps) * scale + bias (eps inside the root)."""
    B, L, F = x.shape
    ct = compute_dtype(x.dtype)
    width = F // heads if scope == "head" else F
    y = x.astype(ct).reshape(B, L, F // width, width)  # (B, L, heads|1, W|F)

    def per_feature(t):  # (W,) or (heads, W) on (B, L, heads, W); (heads, W) as (F,) on (B, L, 1, F)
        return t.astype(ct).reshape(-1) if scope == "all" else t.astype(ct)

    if kind == "layer":
        y = y - y.mean(axis=-1, keepdims=True)
    y = y / np.sqrt((y * y).mean(axis=-1, keepdims=True) + ct.type(eps))
    if scale is not None:
        y = y * per_feature(scale)
    if bias is not None:
        y = y + per_feature(bias)
    return y.reshape(B, L, F).astype(x.dtype)  # (B, L, F)


def norm_heads(x: np.ndarray, scale, bias, kind: str, eps: float, scope: str) -> np.ndarray:
    """The norm of x (B, heads, L, W) after RoPE: norm() on its flat (B, L, heads*W) view -> (B, heads, L, W)."""
    B, heads, L, W = x.shape
    flat = x.transpose(0, 2, 1, 3).reshape(B, L, heads * W)
    return split_heads(norm(flat, scale, bias, kind, eps, heads, scope), heads)


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = x.shape
    x = x.reshape(B, L, num_heads, F // num_heads)  # (B, L, heads, width)
    return x.transpose(0, 2, 1, 3)  # (B, heads, L, width)


def rope_angles(positions: np.ndarray, inv_freq: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """position x frequency in compute dtype: positions (B|1, L) int, or one per pair (B|1, L, R/2)
    (multimodal RoPE: mrope_positions), inv_freq (R/2,) float64 (weights.rope) -> (B|1, 1, L, R/2)."""
    ct = compute_dtype(dtype)
    p = positions.astype(ct)
    p = p[:, None, :, None] if p.ndim == 2 else p[:, None]  # (B|1, 1, L, 1|R/2)
    return p * inv_freq.astype(ct)  # (B|1, 1, L, R/2)


def rope(x: np.ndarray, angles: np.ndarray, rotary_dim: int, interleaved: bool, attention_factor: float) -> np.ndarray:
    """Rotate each pair of x's first rotary_dim features by its angle; x (B,
    heads, L, H), angles (B|1, 1, L, R/2). Half-split (interleaved False)
    pairs feature i with i + R/2 (GPT-NeoX, Hugging Face's rotate_half);
    interleaved pairs 2i with 2i+1 (GPT-J, Meta's Llama). (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin times attention_factor
    (YaRN; 1 otherwise); features past rotary_dim pass through."""
    ct = compute_dtype(x.dtype)
    R = rotary_dim
    cos = np.cos(angles) * ct.type(attention_factor)  # (B|1, 1, L, R/2)
    sin = np.sin(angles) * ct.type(attention_factor)
    xr = x[..., :R].astype(ct)
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : R // 2], xr[..., R // 2:])
    y1 = x1 * cos - x2 * sin  # (B, heads, L, R/2)
    y2 = x2 * cos + x1 * sin
    turned = np.stack([y1, y2], axis=-1).reshape(xr.shape) if interleaved else np.concatenate([y1, y2], axis=-1)
    return np.concatenate([turned.astype(x.dtype), x[..., R:]], axis=-1)  # (B, heads, L, H)


def rope_last(x: np.ndarray, angles: np.ndarray, rotary_dim: int, interleaved: bool, attention_factor: float):
    """RoPE on the LAST rotary_dim features of x (B, heads, L, H): a latent layer's heads are [features
    without position | rotary features] (DeepSeek's order); the first H - rotary_dim pass through."""
    H = x.shape[-1]
    turned = rope(x[..., H - rotary_dim:], angles, rotary_dim, interleaved, attention_factor)
    return np.concatenate([x[..., : H - rotary_dim], turned], axis=-1)


def join_keys(k_nope: np.ndarray, k_rope: np.ndarray) -> np.ndarray:
    """KEY.JOIN (latent): each head's key features from the latent, k_nope (B, K, S, H - R), then the rotary
    key every head shares, k_rope (B, 1, S, R) -> (B, K, S, H)."""
    return np.concatenate([k_nope, np.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1)


def absorb_query(q: np.ndarray, key_kernel: np.ndarray, rope_dim: int) -> np.ndarray:
    """The absorbed form's query (latent): each head's features without position taken through its key
    up-projection's transpose, q_nope W_uk^T (C features), then its rotary features: (B, N, T, H) with
    key.kernel (C, K, H - R) -> (B, N, T, C + R), in compute dtype, stored. Query head n reads key head
    n // G. Then q_abs . [latent | rotary key] = q . [latent W_uk | rotary key]: the expanded logits."""
    B, N, T, H = q.shape
    C, K, _ = key_kernel.shape
    ct = compute_dtype(q.dtype)
    q_nope = q[..., : H - rope_dim].astype(ct).reshape(B, K, (N // K) * T, H - rope_dim)
    # einsum("bkgth,ckh->bkgtc") as one matmul per batch row and kv head (BLAS; np.einsum's own loops took 1 ms of
    # a 7 ms NumPy DSA decode step, and astype's default copy of the kernel 0.3 more: docs/performance.md)
    w_uk = key_kernel.astype(ct, copy=False).transpose(1, 2, 0)  # (K, H - R, C)
    q_latent = np.matmul(q_nope, w_uk).reshape(B, N, T, C)
    return np.concatenate([q_latent.astype(q.dtype), q[..., H - rope_dim:]], axis=-1)


def expand_values(ctx_latent: np.ndarray, value_kernel: np.ndarray) -> np.ndarray:
    """The absorbed form's context (latent): each head's attention over the latent, (B, N, T, C), through
    its value up-projection (C, K, V) -> (B, N, T, V) (sum_j w_j (c_j W_uv) = (sum_j w_j c_j) W_uv)."""
    B, N, T, C = ctx_latent.shape
    K = value_kernel.shape[1]
    ct = compute_dtype(ctx_latent.dtype)
    grouped = ctx_latent.astype(ct).reshape(B, K, (N // K) * T, C)
    # einsum("bkgtc,ckv->bkgtv") as one matmul per batch row and kv head (as absorb_query's)
    w_uv = value_kernel.astype(ct, copy=False).transpose(1, 0, 2)  # (K, C, V)
    return np.matmul(grouped, w_uv).reshape(B, N, T, -1).astype(ctx_latent.dtype)


def temperature_factor(positions: np.ndarray, beta: float, floor: float, offset: int, dtype) -> np.ndarray:
    """The query temperature's factor per query, (B|1, 1, T, 1) in compute dtype:
    1 + beta * ln(1 + floor((position + offset) / floor)). The floor of the
    quotient is taken in float64 (positions are integers: exact), the log in
    compute dtype."""
    ct = compute_dtype(dtype)
    steps = np.floor((positions.astype(np.float64) + offset) / floor)  # (B|1, T)
    return (1 + ct.type(beta) * np.log1p(steps.astype(ct)))[:, None, :, None]


def temperature(q: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """QUERY TEMPERATURE: q (B, N, T, H) times temperature_factor (after RoPE)."""
    return (q.astype(factor.dtype) * factor).astype(q.dtype)


def logits(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, (N // K) * T, H)  # (B, K, G*T, H)
    ct = compute_dtype(q.dtype)
    scores = np.matmul(qg.astype(ct, copy=False), k.astype(ct, copy=False).swapaxes(-1, -2))  # (B, K, G*T, S)
    scores *= ct.type(scale)
    return scores.reshape(B, N, T, S).astype(q.dtype, copy=False)  # (B, N, T, S)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(logits / cap), after the scale and before mask and bias, so a
    masked position stays -inf (Gemma 2's attn_logit_softcapping, ONNX's softcap)."""
    ct = compute_dtype(x.dtype)
    c = ct.type(cap)
    return (np.tanh(x.astype(ct) / c) * c).astype(x.dtype)


def alibi_bias(slopes: np.ndarray, positions: np.ndarray, key_positions: np.ndarray, dtype,
               rounding: str | None = None) -> np.ndarray:
    """ALiBi's bias in compute dtype, (B|1, N, T, S): -slope_n * |pos_q(i) - pos_k(j)|. slopes (N,),
    positions (B|1, T), key_positions (B|1, S) of every key (all_key_positions). The distance is an
    integer, exact in any compute dtype the contract uses up to 2^24.
    rounding (config.alibi_bias_dtype, e.g. "bfloat16"): Falcon-RW's form instead, round(round(slope_n) *
    round(pos_k(j))), each rounding to nearest even in that dtype; the product of two rounded values is
    exact in the compute dtype (8 + 8 or 11 + 11 significant bits; float32's 24 + 24 in float64, and one
    rounding in float32), so the one rounding of it is the same in every compute dtype."""
    ct = compute_dtype(dtype)
    if rounding is not None:
        r = dtype_from_name(rounding)
        slope = slopes.astype(ct).astype(r).astype(ct).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
        key = key_positions.astype(ct).astype(r).astype(ct)[:, None, None, :]  # (B|1, 1, 1, S)
        bias = (slope * key).astype(r).astype(ct)  # (B|1, N, 1, S)
        B = max(positions.shape[0], key_positions.shape[0])
        return np.broadcast_to(bias, (B, bias.shape[1], positions.shape[1], bias.shape[3])).copy()  # (B|1, N, T, S)
    distance = np.abs(positions[:, :, None] - key_positions[:, None, :]).astype(ct)  # (B|1, T, S)
    return -slopes.astype(ct).reshape(1, -1, 1, 1) * distance[:, None]  # (B|1, N, T, S)


def alibi(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """ALIBI: the scaled (and softcapped) logits plus alibi_bias, before the mask (so a masked position stays
    -inf): BLOOM's baddbmm adds it to the scaled q.k (Falcon-RW scales it by the same 1/sqrt(H) through the
    same product, which a converter folds into the slopes)."""
    return (x.astype(bias.dtype) + bias).astype(x.dtype)


def mask(x: np.ndarray, allowed: np.ndarray | None, bias: np.ndarray | None) -> np.ndarray:
    """Add bias, then set disallowed positions to -inf. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A -inf in bias is a mask, the same
    as a False in allowed: the position is set to -inf, whatever the logit
    (a NaN logit there, from a NaN key, is hidden as a bool mask hides it)."""
    if bias is not None:
        x = (x.astype(compute_dtype(x.dtype)) + bias).astype(x.dtype)
        finite = bias > -np.inf  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        x = np.where(allowed, x, x.dtype.type(-np.inf))
    return x


def softmax(x: np.ndarray, masked_row: str, sinks: np.ndarray | None = None) -> np.ndarray:
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN.
    sinks (N,): one logit per head that joins every row's denominator and
    attends to nothing (gpt-oss): the row's max includes it and the weights
    over S sum to less than 1; a fully masked row puts all its mass on the
    sink (weights 0, whatever masked_row says)."""
    ct = compute_dtype(x.dtype)
    row_max = x.max(axis=-1, keepdims=True).astype(ct)  # (B, N, T, 1); exact in any dtype
    sink = None if sinks is None else sinks.astype(ct).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
    if sink is not None:
        row_max = np.maximum(row_max, sink)
    empty = row_max == -np.inf
    row_max[empty] = 0
    w = np.subtract(x, row_max, dtype=ct)  # a fresh array (x may be a traced stage), then worked on in place
    np.exp(w, out=w)  # masked -> exactly 0
    total = w.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - row_max)
    total[empty] = 1
    w /= total
    if empty.any():
        fill = {"zero": 0.0, "uniform": 1.0 / x.shape[-1], "nan": np.nan}[masked_row]
        w = np.where(empty, ct.type(fill), w)
    return w.astype(x.dtype, copy=False)


def dropout(w: np.ndarray, keep: np.ndarray | None, rate: float) -> np.ndarray:
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    ct = compute_dtype(w.dtype)
    return np.where(keep, w.astype(ct) / ct.type(1.0 - rate), ct.type(0)).astype(w.dtype)


def attend(w: np.ndarray, v: np.ndarray) -> np.ndarray:
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = w.shape
    K = v.shape[1]
    wg = w.reshape(B, K, (N // K) * T, S)  # (B, K, G*T, S)
    return _matmul(wg, v, w.dtype).reshape(B, N, T, v.shape[-1])  # (B, N, T, V)


def gate_project(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """GATE.PROJECT: the query input (B, T, D) times gate.kernel (D, N, V) or (D, N) -> (B, T, N*V) or (B, T, N)."""
    return project(x, kernel, bias)


def gate(ctx: np.ndarray, gate_logits: np.ndarray, num_heads: int) -> np.ndarray:
    """GATE: the context (B, N, T, V) times sigmoid of gate.project's logits, (B, T, N*V) per element or
    (B, T, N) per head; in compute dtype, stored."""
    ct = compute_dtype(ctx.dtype)
    B, N, T, V = ctx.shape
    g = gate_logits.astype(ct).reshape(B, T, num_heads, -1).transpose(0, 2, 1, 3)  # (B, N, T, V|1)
    g = 1 / (1 + np.exp(-g))
    return (ctx.astype(ct) * g).astype(ctx.dtype)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, N * V)  # (B, T, N*V)


def output(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O).
    out: a contiguous (B, T, O) array to compute into (float32/float64 only)."""
    y = _matmul_2d(x, kernel.reshape(-1, kernel.shape[-1]), out)  # (B, T, O)
    return _product_plus_bias(y, bias, x.dtype)


# -- differential attention (config.differential: diffllama) ------------------------

def value_pair(v: np.ndarray) -> np.ndarray:
    """VALUE.PAIR: v (B, K, S, V) -> (B, K, S, 2V), kv head g's value joined with its pair's: [v_g' | v_{g'+K/2}],
    g' = g mod K/2 (diffllama's value halves, each repeated over the two halves of the kv heads). Query heads n
    and n + N/2 then read the same 2V-wide value (n // G and n // G + K/2 pair to the same g')."""
    half = v.shape[1] // 2
    joined = np.concatenate([v[:, :half], v[:, half:]], axis=-1)  # (B, K/2, S, 2V)
    return np.concatenate([joined, joined], axis=1)  # (B, K, S, 2V)


def differential_lambda(lq1: np.ndarray, lk1: np.ndarray, lq2: np.ndarray, lk2: np.ndarray, lambda_init: float,
                        dtype) -> np.ndarray:
    """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init: a 0-d array in compute
    dtype (diffllama sums the products in float32 whatever the model's dtype)."""
    ct = compute_dtype(dtype)
    one = np.exp((lq1.astype(ct) * lk1.astype(ct)).sum())
    two = np.exp((lq2.astype(ct) * lk2.astype(ct)).sum())
    return np.asarray(one - two + ct.type(lambda_init), dtype=ct)


def differential(ctx: np.ndarray, lam: np.ndarray, lambda_init: float, eps: float) -> np.ndarray:
    """DIFFERENTIAL: the context of every query head, ctx (B, N, T, 2V) -> (B, N/2, T, 2V): head n's minus lambda
    times head n + N/2's ((w_n - lambda w_{n+N/2}) @ the pair's value), an RMS norm over the 2V features (no
    weight, eps inside the root), times (1 - lambda_init); in compute dtype, stored."""
    ct = compute_dtype(ctx.dtype)
    half = ctx.shape[1] // 2
    c = ctx.astype(ct)
    d = c[:, :half] - lam.astype(ct) * c[:, half:]  # (B, N/2, T, 2V)
    y = d / np.sqrt((d * d).mean(axis=-1, keepdims=True) + ct.type(eps)) * ct.type(1 - lambda_init)
    return y.astype(ctx.dtype)


def differential_stage(config, params: dict, ctx: np.ndarray) -> np.ndarray:
    """The differential stage of a call: differential_lambda from params' differential.lambda_* and the config's
    lambda_init, then differential."""
    d = config.differential
    lam = differential_lambda(*(params[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")), d.lambda_init,
                              ctx.dtype)
    return differential(ctx, lam, d.lambda_init, d.eps)


# `mask` is both a stage and an argument name; callers use this alias.
mask_stage = mask


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape: tuple[int, ...], rate: float, seed: int) -> np.ndarray:
    """NumPy's own seeded keep-mask. Seeds are per framework: for the same
    dropout across frameworks pass an explicit dropout_mask instead."""
    return np.random.default_rng(seed).random(shape) >= rate


def allowed_mask(mask4: np.ndarray | None, T: int, S: int, is_causal: bool, causal_alignment: str, *,
                 window_left: int = -1, window_right: int = -1, segment_ids=None, key_segment_ids=None,
                 local_chunk: int | None = None, positions=None, key_positions=None) -> np.ndarray | None:
    """mask AND causal AND window AND local chunks AND segments, rank 4, broadcastable to (B, N,
    T, S) (S: every key, the cache's included); None if none applies. local_chunk reads positions
    (B|1, T) and every key's key_positions (B|1, S)."""
    allowed = mask4

    def both(extra):
        return extra if allowed is None else allowed & extra

    if is_causal:
        allowed = both(causal_mask(T, S, causal_alignment)[None, None])  # (1, 1, T, S)
    if window_left >= 0 or window_right >= 0:
        allowed = both(window_mask(T, S, window_left, window_right, causal_alignment)[None, None])  # (1, 1, T, S)
    if local_chunk is not None:
        allowed = both(chunk_mask(positions, key_positions, local_chunk))  # (B|1, 1, T, S)
    if segment_ids is not None:
        allowed = both(segment_mask(segment_ids, key_segment_ids))  # (B|1, 1, T, S)
    return allowed


def selection_mask(topk_indices: np.ndarray, num_heads: int, S: int) -> np.ndarray:
    """The keys each query may see, bool (B, 1|N, T, S) (S: every key, the cache's first): topk_indices (B, T, k)
    (one selection for every head) or (B, K, T, k) (one per kv head: query head n reads kv head n // G, as
    attend groups them). Index j < P is the cache's key j, P + i the new key i; -1 pads an unused slot (it
    selects nothing, never the last key); a key selected twice is selected. ANDed with every other mask (the
    mask argument's place): a selected key another mask hides stays hidden."""
    idx = np.asarray(topk_indices).astype(np.int64)
    idx = idx[:, None] if idx.ndim == 3 else idx  # (B, K|1, T, k)
    B, K, T, _ = idx.shape
    selected = np.zeros((B, K, T, S + 1), dtype=bool)  # column S: where the -1 slots land, dropped below
    np.put_along_axis(selected, np.where(idx < 0, S, idx), True, axis=-1)
    selected = selected[..., :S]
    return selected if K == 1 else np.repeat(selected, num_heads // K, axis=1)  # (B, 1|N, T, S)


def all_key_positions(key_positions: np.ndarray, P: int, past_key_positions: np.ndarray | None = None) -> np.ndarray:
    """Every key's position, (B|1, P+S): the cache's keys at past_key_positions (B|1, P) (default 0..P-1),
    then the new keys' key_positions (B|1, S)."""
    if key_positions.ndim == 3:  # multimodal RoPE's, one per pair (mrope_positions): no stage but RoPE reads them
        return None
    if not P:
        return key_positions
    cached = np.arange(P, dtype=np.int64)[None] if past_key_positions is None else past_key_positions  # (B|1, P)
    B = max(cached.shape[0], key_positions.shape[0])
    return np.concatenate([np.broadcast_to(cached, (B, P)), np.broadcast_to(key_positions, (B, key_positions.shape[1]))],
                          axis=1)


def temperature_positions(positions: np.ndarray, source: str, P: int, T: int) -> np.ndarray:
    """The positions a query temperature reads, (B|1, T): the queries' positions ("positions"), or their
    index in the cache, P + arange(T) ("cache_index": transformers' Llama 4, left pads counted)."""
    return positions if source == "positions" else (P + np.arange(T, dtype=np.int64))[None]


def default_positions(positions, P: int, L: int) -> np.ndarray:
    """(B|1, L) int64: the given positions ((L,) or (B, L)), or P + arange(L)
    (the cache's length P offsets new tokens)."""
    if positions is None:
        return (P + np.arange(L, dtype=np.int64))[None]  # (1, L)
    positions = np.asarray(positions).astype(np.int64)
    return positions[None] if positions.ndim == 1 else positions  # (B|1, L)




# -- issue 42: the key multiplier and the value scale ---------------------------

def multiply(x: np.ndarray, factor: float) -> np.ndarray:
    """KEY MULTIPLIER / VALUE SCALE: a projection (B, L, F), after its clip and norm, times a config number
    (Falcon-H1's key_multiplier on k, MiMo-V2's attention_value_scale on v), in compute dtype and stored in
    the storage dtype (as torch multiplies a 16-bit tensor by a Python float: in float32, rounded once)."""
    ct = compute_dtype(x.dtype)
    return (x.astype(ct) * ct.type(factor)).astype(x.dtype)


def mrope_positions(positions, P: int, L: int, axes: np.ndarray) -> np.ndarray:
    """Multimodal RoPE: each rotating pair's position, (B|1, L, R/2) int64. positions (3, L) or (3, B, L):
    the temporal, height and width rows (default: P + arange(L) on all three, a text token's); axes (R/2,)
    the axis that turns each pair (weights.rope.mrope_axes)."""
    if positions is None:
        positions = np.broadcast_to((P + np.arange(L, dtype=np.int64))[None, None], (3, 1, L))  # (3, 1, L)
    positions = np.asarray(positions).astype(np.int64)
    positions = positions[:, None] if positions.ndim == 2 else positions  # (3, B|1, L)
    return positions[axes].transpose(1, 2, 0)  # (B|1, L, R/2)
