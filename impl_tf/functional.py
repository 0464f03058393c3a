"""Multi-head attention in keras.ops, one function per stage: mirrors impl_numpy/functional.py.

Same stage functions, same names, same einsum strings, same order as the
NumPy spec; every op is a keras.ops call (or one of backend.py's few
primitives, TensorFlow's own ops on TensorFlow), so the stages run on Keras's
tensorflow, jax and torch backends alike. A disagreement with the spec
therefore names a stage.

Shape letters (impl_numpy's):
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages (the bracketed ones where the config turns them on):
project -> [clip] -> [norm] -> [value norm] -> split_heads -> [rope] ->
[norm after rope] -> [query temperature] -> [cache appended] -> logits
(scale) -> [softcap] -> [alibi] -> mask (bias, causal, window, local chunks,
segments) -> softmax [+ sinks] -> dropout -> attend -> [gate] ->
merge_heads -> output. A latent layer's stages up to the keys are
weights.call.LATENT_STAGES (heads.latent_heads; rope_last, join_keys here,
and absorb_query / expand_values for its absorbed form).

The call that runs them (and chooses the fused and chunked paths) is
attention.py; this file holds the stages alone and imports neither.

Precision rule (the spec's): each stage's result is stored in the storage
dtype; its arithmetic (matmul accumulation, exp and sums) runs in
`compute_dtype`, float32 for float16/bfloat16 inputs, the dtype itself
otherwise.

Differences of form, all for each backend's autodiff (tf.GradientTape,
jax.vjp, torch.autograd) to give the spec's hand-written gradients
(impl_numpy/backward.py); the forward values are the same:
- softmax subtracts a stop_gradient row max (softmax does not depend on it;
  with sinks the sink's gradient flows through its own exp term);
- masked_row="nan" multiplies a fully masked row by NaN instead of filling
  it, so such a row's softmax input gets a NaN gradient as in the spec (the
  value gradient too); the mask stage's select (a -inf bias included) then
  passes none of it to the logits, as the spec's backward zeroes every -inf
  position.

The stages' contractions run through backend.einsum with the spec's strings
(tf.einsum on TensorFlow: tf_only.py says why).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from weights.call import ATTEND, LOGITS, OUTPUT, PROJECT

from . import backend as bk
from ._keras import keras
from .backend import constant, einsum, same_dtype
from .masks import causal_mask, chunk_mask, segment_mask, window_mask

ops = keras.ops

def dtype_name(x) -> str:
    """The dtype of a tensor, array or dtype, by its NumPy-style name."""
    return keras.backend.standardize_dtype(getattr(x, "dtype", x))


def compute_dtype(dtype) -> str:
    """Where a stage's arithmetic runs: float32 for 16-bit storage, else the dtype."""
    name = keras.backend.standardize_dtype(dtype)
    return "float32" if name in ("float16", "bfloat16") else name


def _cast(x, dtype: str):
    """ops.cast, without its dispatch when x is a tensor of that dtype already
    (most casts of a float32 or float64 call: about 30 us each, eagerly)."""
    if same_dtype(x, dtype):
        return x
    return ops.cast(x, dtype)


def _einsum(subscripts: str, a, b, dtype):
    ct = compute_dtype(dtype)
    return _cast(einsum(subscripts, _cast(a, ct), _cast(b, ct)), dtype)


# -- stages --------------------------------------------------------------------

def project(x, kernel, bias):
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, bk.reshape(kernel, (D, -1)), x.dtype)  # (B, L, F)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = _cast(_cast(y, ct) + _cast(bk.reshape(bias, (-1,)), ct), x.dtype)  # bias (F,); y (B, L, F)
    return y


def clip(x, c: float):
    """QKV clip: a projection clamped to [-c, c] (MPT's and OLMo's clip_qkv, after the projection's bias), in
    the storage dtype as the spec's (exact: the bound rounds once, as NumPy's). Autodiff of the clamp passes
    the gradient where |x| <= c, bounds included, as the spec's backward."""
    bound = constant(c, dtype_name(x))
    return ops.where(x > bound, bound, ops.where(x < -bound, -bound, x))  # a select: the gradient where |x| <= c


def norm(x, scale, bias, kind: str, eps: float, heads: int, scope: str):
    """QK-norm (or the value norm) of a projection x (B, L, F = heads*W), in compute dtype.
    scope "head": each head's W features normalised on their own, scale/bias (W,)
    shared by the heads (Qwen3, Gemma 3) or (heads, W), one per head (Cohere);
    "all": the whole F at once, scale/bias (heads, W) (OLMo 2); scale None: a
    weightless norm (Llama 4's L2 norm, Gemma 3n's value norm). The stage runs
    on the flat projection in both scopes ("head" views it as (B, L, heads, W)
    inside), so its trace has one layout (a norm after RoPE: norm_heads). kind
    "rms": x / sqrt(mean(x^2) + eps) * scale; "layer": (x - mean) / sqrt(var +
    eps) * scale + bias (eps inside the root)."""
    B, L = bk.shape(x)[0], bk.shape(x)[1]
    F = x.shape[-1]
    ct = compute_dtype(x.dtype)
    width = F // heads if scope == "head" else F
    y = bk.reshape(_cast(x, ct), (B, L, F // width, width))  # (B, L, heads|1, W|F)

    def per_feature(t):  # (W,) or (heads, W) on (B, L, heads, W); (heads, W) as (F,) on (B, L, 1, F)
        return bk.reshape(_cast(t, ct), (-1,)) if scope == "all" else _cast(t, ct)

    if kind == "layer":
        y = y - bk.mean(y, axis=-1, keepdims=True)
    y = y / ops.sqrt(bk.mean(y * y, axis=-1, keepdims=True) + constant(eps, ct))
    if scale is not None:
        y = y * per_feature(scale)
    if bias is not None:
        y = y + per_feature(bias)
    return _cast(bk.reshape(y, (B, L, F)), x.dtype)  # (B, L, F)


def norm_heads(x, scale, bias, kind: str, eps: float, scope: str):
    """The norm of x (B, heads, L, W) after RoPE: norm() on its flat (B, L, heads*W) view -> (B, heads, L, W)."""
    B, heads, L, W = bk.shape(x)[0], x.shape[1], bk.shape(x)[2], x.shape[3]
    flat = bk.reshape(ops.transpose(x, (0, 2, 1, 3)), (B, L, heads * W))
    return split_heads(norm(flat, scale, bias, kind, eps, heads, scope), heads)


def split_heads(x, num_heads: int):
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = bk.shape(x)
    x = bk.reshape(x, (B, L, num_heads, F // num_heads))  # (B, L, heads, width)
    return ops.transpose(x, (0, 2, 1, 3))  # (B, heads, L, width)


def rope_angles(positions, inv_freq, dtype):
    """position x frequency in compute dtype: positions (B|1, L) int, or one per pair (B|1, L, R/2)
    (multimodal RoPE: mrope_positions), inv_freq (R/2,) float64 (weights.rope) -> (B|1, 1, L, R/2)."""
    ct = compute_dtype(dtype)
    p = _cast(positions, ct)
    p = p[:, None, :, None] if len(p.shape) == 2 else p[:, None]  # (B|1, 1, L, 1|R/2)
    return p * _cast(inv_freq, ct)  # (B|1, 1, L, R/2)


def rope(x, angles, rotary_dim: int, interleaved: bool, attention_factor: float):
    """Rotate each pair of x's first rotary_dim features by its angle; x (B,
    heads, L, H), angles (B|1, 1, L, R/2). Half-split (interleaved False)
    pairs feature i with i + R/2 (GPT-NeoX, Hugging Face's rotate_half);
    interleaved pairs 2i with 2i+1 (GPT-J, Meta's Llama). (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin times attention_factor
    (YaRN; 1 otherwise); features past rotary_dim pass through."""
    ct = compute_dtype(x.dtype)
    R = rotary_dim
    factor = constant(attention_factor, ct)
    cos = bk.cos(angles) * factor  # (B|1, 1, L, R/2)
    sin = bk.sin(angles) * factor
    xr = _cast(x[..., :R], ct)
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : R // 2], xr[..., R // 2:])
    y1 = x1 * cos - x2 * sin  # (B, heads, L, R/2)
    y2 = x2 * cos + x1 * sin
    if interleaved:
        turned = bk.reshape(ops.stack([y1, y2], axis=-1), bk.shape(xr))  # (B, heads, L, R): pairs back in place
    else:
        turned = ops.concatenate([y1, y2], axis=-1)
    if R == x.shape[-1]:
        return _cast(turned, x.dtype)  # (B, heads, L, H)
    return ops.concatenate([_cast(turned, x.dtype), x[..., R:]], axis=-1)  # (B, heads, L, H)


def rope_last(x, angles, rotary_dim: int, interleaved: bool, attention_factor: float):
    """RoPE on the LAST rotary_dim features of x (B, heads, L, H): a latent layer's heads are [features
    without position | rotary features] (DeepSeek's order); the first H - rotary_dim pass through."""
    H = x.shape[-1]
    turned = rope(x[..., H - rotary_dim:], angles, rotary_dim, interleaved, attention_factor)
    return ops.concatenate([x[..., : H - rotary_dim], turned], axis=-1)


def join_keys(k_nope, k_rope):
    """KEY.JOIN (latent): each head's key features from the latent, k_nope (B, K, S, H - R), then the rotary
    key every head shares, k_rope (B, 1, S, R) -> (B, K, S, H)."""
    B, K, S = bk.shape(k_nope)[:3]
    return ops.concatenate([k_nope, ops.broadcast_to(k_rope, (B, K, S, k_rope.shape[3]))], axis=-1)


def absorb_query(q, key_kernel, rope_dim: int):
    """The absorbed form's query (latent): each head's features without position taken through its key
    up-projection's transpose, q_nope W_uk^T (C features), then its rotary features: (B, N, T, H) with
    key.kernel (C, K, H - R) -> (B, N, T, C + R), in compute dtype, stored. Query head n reads key head
    n // G. Then q_abs . [latent | rotary key] = q . [latent W_uk | rotary key]: the expanded logits."""
    B, N, T, H = bk.shape(q)[0], q.shape[1], bk.shape(q)[2], q.shape[3]
    C, K = key_kernel.shape[0], key_kernel.shape[1]
    ct = compute_dtype(q.dtype)
    q_nope = bk.reshape(_cast(q[..., : H - rope_dim], ct), (B, K, N // K, T, H - rope_dim))
    q_latent = bk.reshape(einsum("bkgth,ckh->bkgtc", q_nope, _cast(key_kernel, ct)), (B, N, T, C))
    return ops.concatenate([_cast(q_latent, q.dtype), q[..., H - rope_dim:]], axis=-1)


def expand_values(ctx_latent, value_kernel):
    """The absorbed form's context (latent): each head's attention over the latent, (B, N, T, C), through
    its value up-projection (C, K, V) -> (B, N, T, V) (sum_j w_j (c_j W_uv) = (sum_j w_j c_j) W_uv)."""
    B, N, T, C = bk.shape(ctx_latent)[0], ctx_latent.shape[1], bk.shape(ctx_latent)[2], ctx_latent.shape[3]
    K, V = value_kernel.shape[1], value_kernel.shape[2]
    ct = compute_dtype(ctx_latent.dtype)
    grouped = bk.reshape(_cast(ctx_latent, ct), (B, K, N // K, T, C))
    return _cast(bk.reshape(einsum("bkgtc,ckv->bkgtv", grouped, _cast(value_kernel, ct)), (B, N, T, V)),
                 ctx_latent.dtype)


def temperature_factor(positions, beta: float, floor: float, offset: int, dtype):
    """The query temperature's factor per query, (B|1, 1, T, 1) in compute dtype:
    1 + beta * ln(1 + floor((position + offset) / floor)). The floor of the
    quotient is taken in float64 (positions are integers: exact), the log in
    compute dtype, as the spec's."""
    ct = compute_dtype(dtype)
    steps = bk.floor((_cast(positions, "float64") + offset) / constant(floor, "float64"))  # (B|1, T)
    return (1 + constant(beta, ct) * ops.log1p(_cast(steps, ct)))[:, None, :, None]


def temperature(q, factor):
    """QUERY TEMPERATURE: q (B, N, T, H) times temperature_factor (after RoPE)."""
    return _cast(_cast(q, factor.dtype) * factor, q.dtype)


def logits(q, k, scale: float):
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = bk.shape(q)
    K, S = k.shape[1], bk.shape(k)[2]
    qg = bk.reshape(q, (B, K, N // K, T, H))  # (B, K, G, T, H)
    ct = compute_dtype(q.dtype)
    scores = einsum(LOGITS, _cast(qg, ct), _cast(k, ct))  # (B, K, G, T, S)
    return _cast(bk.reshape(scores * scale, (B, N, T, S)), q.dtype)  # (B, N, T, S)


def softcap(x, cap: float):
    """cap * tanh(logits / cap), after the scale and before mask and bias, so a
    masked position stays -inf (Gemma 2's attn_logit_softcapping, ONNX's softcap)."""
    ct = compute_dtype(x.dtype)
    c = constant(cap, ct)
    return _cast(bk.tanh(_cast(x, ct) / c) * c, x.dtype)


def alibi_bias(slopes, positions, key_positions, dtype, rounding=None):
    """ALiBi's bias in compute dtype, (B|1, N, T, S): -slope_n * |pos_q(i) - pos_k(j)|. slopes (N,),
    positions (B|1, T), key_positions (B|1, S) of every key (all_key_positions). The distance is an
    integer, exact in any compute dtype the contract uses up to 2^24; the slopes' gradient flows
    through the product.
    rounding (config.alibi_bias_dtype): Falcon-RW's round(round(slope_n) * round(pos_k(j))) in that dtype;
    the roundings pass the gradient straight through (d slope_n = sum(d bias * round(pos_k)))."""
    ct = compute_dtype(dtype)
    if rounding is not None:
        slope = bk.reshape(_cast(slopes, ct), (1, -1, 1, 1))  # (1, N, 1, 1)
        key = _cast(_cast(_cast(key_positions, ct), rounding), ct)[:, None, None, :]  # (B|1, 1, 1, S)
        exact = slope * key  # (B|1, N, 1, S): carries the gradient
        rounded = _cast(_cast(_cast(_cast(ops.stop_gradient(slope), rounding), ct) * key, rounding), ct)
        rows = ops.zeros_like(_cast(positions, ct))[:, None, :, None]  # (B|1, 1, T, 1)
        return exact + ops.stop_gradient(rounded - exact) + rows  # (B|1, N, T, S)
    q_pos, k_pos = _cast(positions, "int64"), _cast(key_positions, "int64")
    distance = _cast(ops.abs(q_pos[:, :, None] - k_pos[:, None, :]), ct)  # (B|1, T, S)
    return -bk.reshape(_cast(slopes, ct), (1, -1, 1, 1)) * distance[:, None]  # (B|1, N, T, S)


def alibi(x, bias):
    """ALIBI: the scaled (and softcapped) logits plus alibi_bias, before the mask (so a masked position stays
    -inf): BLOOM's baddbmm adds it to the scaled q.k."""
    return _cast(_cast(x, bias.dtype) + bias, x.dtype)


def mask(x, allowed, bias):
    """Add bias, then -inf at disallowed positions. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A select, so a masked position gets
    no gradient (as in impl_numpy/backward.py); a -inf in bias masks, so it
    joins the select (the value is -inf either way): otherwise a "nan" row
    masked by bias alone would pass its NaN to the query and key gradients."""
    if bias is not None:
        ct = compute_dtype(x.dtype)
        x = _cast(_cast(x, ct) + bias, x.dtype)
        finite = bias > constant(-math.inf, ct)  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else ops.logical_and(allowed, finite)
    if allowed is not None:
        x = ops.where(allowed, x, _cast(-math.inf, x.dtype))
    return x


def softmax(x, masked_row: str, sinks=None):
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN.
    sinks (N,): one logit per head that joins every row's denominator and
    attends to nothing (gpt-oss): the row's max includes it and the weights
    over S sum to less than 1; a fully masked row puts all its mass on the
    sink (weights 0, whatever masked_row says)."""
    ct = compute_dtype(x.dtype)
    xc = _cast(x, ct)
    row_max = ops.max(xc, axis=-1, keepdims=True)  # (B, N, T, 1)
    sink = None if sinks is None else bk.reshape(_cast(sinks, ct), (1, -1, 1, 1))  # (1, N, 1, 1)
    if sink is not None:
        row_max = bk.maximum(row_max, sink)
    row_max = ops.stop_gradient(row_max)
    empty = ops.equal(row_max, -math.inf)
    shift = ops.where(empty, ops.zeros_like(row_max), row_max)
    e = ops.exp(xc - shift)  # masked -> exactly 0
    total = ops.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + ops.exp(sink - shift)  # never empty: the sink is finite
    w = e / ops.where(empty, ops.ones_like(total), total)  # an empty row is all 0 here
    if sink is None and masked_row == "uniform":
        w = ops.where(empty, ops.ones_like(w) / _cast(bk.shape(x)[-1], ct), w)
    elif sink is None and masked_row == "nan":
        # times NaN, not a NaN fill: the row's gradient is NaN too, as in the spec
        w = w * ops.where(empty, ops.full_like(total, math.nan), ops.ones_like(total))
    return _cast(w, x.dtype)


def dropout(w, keep, rate: float):
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    wc = _cast(w, compute_dtype(w.dtype))
    return _cast(ops.where(keep, wc / (1.0 - rate), ops.zeros_like(wc)), w.dtype)


def attend(w, v):
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = bk.shape(w)
    K, V = v.shape[1], v.shape[-1]
    wg = bk.reshape(w, (B, K, N // K, T, S))  # (B, K, G, T, S)
    return bk.reshape(_einsum(ATTEND, wg, v, w.dtype), (B, N, T, V))  # (B, N, T, V)


def gate_project(x, kernel, bias):
    """GATE.PROJECT: the query input (B, T, D) times gate.kernel (D, N, V) or (D, N) -> (B, T, N*V) or (B, T, N)."""
    return project(x, kernel, bias)


def gate(ctx, gate_logits, num_heads: int):
    """GATE: the context (B, N, T, V) times sigmoid of gate.project's logits, (B, T, N*V) per element or
    (B, T, N) per head; in compute dtype, stored. Autodiff of the sigmoid gives the spec's g (1 - g)."""
    ct = compute_dtype(ctx.dtype)
    B, T = bk.shape(gate_logits)[0], bk.shape(gate_logits)[1]
    g = bk.reshape(_cast(gate_logits, ct), (B, T, num_heads, -1))  # (B, T, N, V|1)
    g = ops.sigmoid(ops.transpose(g, (0, 2, 1, 3)))  # (B, N, T, V|1)
    return _cast(_cast(ctx, ct) * g, ctx.dtype)


# -- differential attention (config.differential: diffllama) ------------------------

def value_pair(v):
    """VALUE.PAIR: v (B, K, S, V) -> (B, K, S, 2V), kv head g's value joined with its pair's: [v_g' | v_{g'+K/2}],
    g' = g mod K/2."""
    half = v.shape[1] // 2
    joined = ops.concatenate([v[:, :half], v[:, half:]], axis=-1)  # (B, K/2, S, 2V)
    return ops.concatenate([joined, joined], axis=1)  # (B, K, S, 2V)


def differential_lambda(lq1, lk1, lq2, lk2, lambda_init: float, dtype):
    """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init: a 0-d tensor in compute
    dtype."""
    ct = compute_dtype(dtype)
    one = ops.exp(ops.sum(_cast(lq1, ct) * _cast(lk1, ct)))
    two = ops.exp(ops.sum(_cast(lq2, ct) * _cast(lk2, ct)))
    return one - two + constant(lambda_init, ct)


def differential(ctx, lam, lambda_init: float, eps: float):
    """DIFFERENTIAL: ctx (B, N, T, 2V) -> (B, N/2, T, 2V): head n's minus lambda times head n + N/2's, an RMS norm
    over the 2V features (no weight, eps inside the root), times (1 - lambda_init); in compute dtype, stored."""
    ct = compute_dtype(ctx.dtype)
    half = ctx.shape[1] // 2
    c = _cast(ctx, ct)
    d = c[:, :half] - _cast(lam, ct) * c[:, half:]  # (B, N/2, T, 2V)
    y = d / ops.sqrt(bk.mean(d * d, axis=-1, keepdims=True) + constant(eps, ct)) * constant(1 - lambda_init, ct)
    return _cast(y, ctx.dtype)


def differential_stage(config, params: dict, ctx):
    """The differential stage of a call: differential_lambda from params' differential.lambda_* and the config's
    lambda_init, then differential."""
    d = config.differential
    lam = differential_lambda(*(params[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")), d.lambda_init,
                              ctx.dtype)
    return differential(ctx, lam, d.lambda_init, d.eps)


def merge_heads(x):
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = bk.shape(x)
    x = ops.transpose(x, (0, 2, 1, 3))  # (B, T, N, V)
    return bk.reshape(x, (B, T, N * V))  # (B, T, N*V)


def output(x, kernel, bias):
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O)."""
    y = _einsum(OUTPUT, x, bk.reshape(kernel, (-1, kernel.shape[-1])), x.dtype)  # (B, T, O)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = _cast(_cast(y, ct) + _cast(bias, ct), x.dtype)
    return y


# `mask` is both a stage and an argument name; callers use this alias.
mask_stage = mask


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape, rate: float, seed) -> Any:
    """Keras's own seeded keep-mask (stateless for an int seed). Seeds are per
    framework: for the same dropout across frameworks pass dropout_mask."""
    if isinstance(seed, (int, np.integer)):
        seed = int(seed)
    return keras.random.uniform(shape, seed=seed) >= rate


def allowed_mask(mask4, T, S, is_causal: bool, causal_alignment: str, *, window_left: int = -1,
                 window_right: int = -1, segment_ids=None, key_segment_ids=None, local_chunk: int | None = None,
                 positions=None, key_positions=None):
    """mask AND causal AND window AND local chunks AND segments, rank 4, broadcastable to (B, N,
    T, S) (S: every key, the cache's included); None if none applies. T and S
    may be traced scalars. local_chunk reads positions (B|1, T) and every key's
    key_positions (B|1, S)."""
    allowed = mask4

    def both(extra):
        return extra if allowed is None else ops.logical_and(allowed, extra)

    if is_causal:
        allowed = both(causal_mask(T, S, causal_alignment)[None, None])  # (1, 1, T, S)
    if window_left >= 0 or window_right >= 0:
        allowed = both(window_mask(T, S, window_left, window_right, causal_alignment)[None, None])  # (1, 1, T, S)
    if local_chunk is not None:
        allowed = both(chunk_mask(positions, key_positions, local_chunk))  # (B|1, 1, T, S)
    if segment_ids is not None:
        allowed = both(segment_mask(segment_ids, key_segment_ids))  # (B|1, 1, T, S)
    return allowed


# selection_mask builds a one-hot of at most this many bytes; a larger selection (a long cache's) is scattered.
ONE_HOT_MAX_BYTES = 2**20


def selection_mask(topk_indices, num_heads: int, S):
    """impl_numpy's selection_mask: topk_indices (B, T, k) or (B, K, T, k) -> bool (B, 1|N, T, S), -1 selecting
    nothing (a spare column S, dropped), kv head K's selection for its G query heads. A one-hot, (B, K, T,
    k, S+1) bytes at once, where that is at most ONE_HOT_MAX_BYTES or a shape is not known (traced); else
    (a long cache: at k 2048 and S 65537 the one-hot is 134 MB per query, and made TensorFlow's sparse
    decode step cost 2-13x its dense one) a scatter of one count per selected slot into (B, K, T, S+1).
    The one-hot stays for small calls: the scatter's extra ops cost mha check's keras columns more to trace
    and compile than the one-hot costs them to run."""
    idx = _cast(topk_indices, "int32")
    idx = idx[:, None] if len(idx.shape) == 3 else idx  # (B, K|1, T, k)
    idx = ops.where(idx < 0, S, idx)
    shape = tuple(idx.shape)
    if all(isinstance(n, int) for n in (*shape, S)) and math.prod(shape) * (S + 1) > ONE_HOT_MAX_BYTES:
        B, K, T, k = shape
        grid = ops.meshgrid(*(ops.arange(n, dtype="int32") for n in shape[:3]), ops.arange(k, dtype="int32"),
                            indexing="ij")  # (B, K, T, k) each
        at = ops.reshape(ops.stack([*grid[:3], idx], axis=-1), (B * K * T * k, 4))  # (b, kv head, t, key)
        counts = ops.scatter(at, ops.ones((B * K * T * k,), dtype="int32"), (B, K, T, S + 1))  # (B, K|1, T, S+1)
        selected = counts[..., :S] > 0  # a key selected twice counts 2: selected
    else:
        selected = ops.max(ops.one_hot(idx, S + 1, dtype="uint8"), axis=-2)[..., :S] > 0  # (B, K|1, T, S)
    K = idx.shape[1]
    return selected if K == 1 else ops.repeat(selected, num_heads // K, axis=1)  # (B, 1|N, T, S)


def all_key_positions(key_positions, P, past_key_positions=None):
    """Every key's position, (B|1, P+S): the cache's keys at past_key_positions (B|1, P) (default 0..P-1),
    then the new keys' key_positions (B|1, S). P may be a traced scalar."""
    if len(key_positions.shape) == 3:  # multimodal RoPE's, one per pair (mrope_positions): RoPE alone reads them
        return None
    if isinstance(P, int) and not P:
        return key_positions
    key_positions = _cast(key_positions, "int64")
    if past_key_positions is None:
        cached = ops.broadcast_to(ops.arange(P, dtype="int64")[None], (bk.shape(key_positions)[0], P))  # (B|1, P)
        return ops.concatenate([cached, key_positions], axis=1)  # (B|1, P+S)
    cached = _cast(past_key_positions, "int64")  # (B|1, P)
    B1, B2 = bk.shape(cached)[0], bk.shape(key_positions)[0]
    B = max(B1, B2) if isinstance(B1, int) and isinstance(B2, int) else bk.maximum(B1, B2)
    return ops.concatenate([ops.broadcast_to(cached, (B, bk.shape(cached)[1])),
                            ops.broadcast_to(key_positions, (B, bk.shape(key_positions)[1]))], axis=1)  # (B, P+S)


def temperature_positions(positions, source: str, P, T):
    """The positions a query temperature reads, (B|1, T): the queries' positions ("positions"), or their
    index in the cache, P + arange(T) ("cache_index": transformers' Llama 4, left pads counted). P and T
    may be traced scalars."""
    return positions if source == "positions" else default_positions(None, P, T)


def default_positions(positions, P, L):
    """(B|1, L) int: the given positions ((L,) or (B, L)), or P + arange(L)
    (the cache's length P offsets new tokens). P and L may be traced scalars."""
    if positions is None:
        return (ops.arange(L, dtype="int64") + ops.cast(P, "int64"))[None]  # (1, L)
    positions = ops.convert_to_tensor(positions)
    return positions[None] if len(positions.shape) == 1 else positions  # (B|1, L)


def rope_tables_of(rope, *positions):
    """(inv_freq (R/2,), attention_factor) of a Rope config for a call at these positions (None skipped):
    weights.rope.rope_tables, where LongRoPE picks its table by the largest position. Eagerly that position
    is read to the host (LongRoPE only); traced, the table is selected by a where, nothing read to Python.
    The call's RoPE (call.Call.rope_tables) and the indexer's (impl_tf.indexer) read it so."""
    from weights.rope import attention_factor, inverse_frequencies, rope_tables

    scaling = rope.scaling
    if scaling is None or scaling.type != "longrope":
        return rope_tables(rope)
    given = [x for x in positions if x is not None]
    if not any(bk.is_symbolic(x) for x in given):
        values = [np.asarray(keras.ops.convert_to_numpy(x)) for x in given]
        largest = [int(x.max()) for x in values if x.size]
        return rope_tables(rope, max(largest) if largest else None)
    largest = keras.ops.max(keras.ops.stack([keras.ops.max(keras.ops.cast(x, "int64")) for x in given]))
    long = largest + 1 > scaling.original_max_position_embeddings
    inv_freq = keras.ops.where(long, keras.ops.convert_to_tensor(inverse_frequencies(rope, long=True), "float64"),
                         keras.ops.convert_to_tensor(inverse_frequencies(rope, long=False), "float64"))  # (R/2,)
    return inv_freq, attention_factor(rope)


# -- issue 42: the key multiplier and the value scale (mirrors impl_numpy/functional.py) ---------------

def multiply(x, factor: float):
    """KEY MULTIPLIER / VALUE SCALE: a projection (B, L, F) times a config number, in compute dtype."""
    ct = compute_dtype(x.dtype)
    return _cast(_cast(x, ct) * constant(factor, ct), x.dtype)


def mrope_positions(positions, P, L, axes):
    """Multimodal RoPE: each rotating pair's position, (B|1, L, R/2) int64. positions (3, L) or (3, B, L):
    the temporal, height and width rows (default: P + arange(L) on all three, a text token's); axes (R/2,)
    the axis that turns each pair (weights.rope.mrope_axes). P and L may be traced scalars."""
    if positions is None:
        positions = ops.broadcast_to((ops.arange(L, dtype="int64") + ops.cast(P, "int64"))[None, None],
                                     (3, 1, L))  # (3, 1, L)
    positions = _cast(positions, "int64")
    positions = positions[:, None] if len(positions.shape) == 2 else positions  # (3, B|1, L)
    return ops.transpose(ops.take(positions, ops.convert_to_tensor(axes), axis=0), (1, 2, 0))  # (B|1, L, R/2)
