"""Multi-head attention in MLX, one pure function per stage: mirrors impl_numpy/functional.py.

Same stage functions, same names, same order, same einsum strings as the
NumPy spec; mlx.core only. Shape letters as in impl_numpy:
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages (the bracketed ones where the config turns them on):
project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope]
-> [query temperature] -> [cache appended] -> logits (scale) -> [softcap] -> [alibi] -> mask (bias,
causal, window, local chunks, segments) -> softmax [+ sinks] -> dropout ->
attend -> [gate] -> merge_heads -> output.

The call that runs them and chooses between the stages, MLX's fused
kernel (mx.fast.scaled_dot_product_attention, fused.py) and the chunked
path (chunked.py) is attention.py; this file imports neither.

Precision rule (as the spec): each stage's result is stored in the storage
dtype; its arithmetic runs in the compute dtype, float32 for float16/bfloat16,
the dtype itself otherwise. MLX has one float32 matmul (no TF32 mode); float64
runs on its CPU device only (convert.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from weights import dtype_from_name
from weights.call import ATTEND, LOGITS, PROJECT

from .convert import ct as compute_of
from .convert import np_dtype, scalar, to_mx_dtype
from .masks import causal_mask, chunk_mask, segment_mask, window_mask


def _einsum(spec: str, a: mx.array, b: mx.array, dtype: mx.Dtype) -> mx.array:
    """einsum in compute dtype, result stored in `dtype` (the spec's _matmul)."""
    c = compute_of(dtype)
    return mx.einsum(spec.lower(), a.astype(c), b.astype(c)).astype(dtype)


# MLX 0.32.4's CPU exp, sin and cos are float32-accurate whatever the dtype: in float64 their relative error
# is about 6e-7 (exp) and their absolute error 1e-5 (cos, sin of angles to 90), where tanh, log1p, expm1,
# tan and power are float64-accurate (measured in tests/test_mlx.py, 2-core AMD EPYC VM, 2026-11-29). In
# float64 the stages therefore take exp(x) as power(e, x) (differentiable, its gradient power(e, x) too)
# and RoPE's cos and sin of the angles in NumPy (the angles come from the integer positions: no gradient
# flows through them); in 32 and 16 bits MLX's own.
_E = float(np.e)


def exp(x: mx.array) -> mx.array:
    """exp in x's dtype, float64-accurate in float64 (see above)."""
    if x.dtype == mx.float64:
        return mx.power(scalar(_E, mx.float64), x)
    return mx.exp(x)


# MLX 0.32.4's VJP of mx.where multiplies the cotangent by the condition cast to a float (mlx/primitives.cpp,
# Select::vjp), so a NaN cotangent reaches the branch not taken as NaN x 0 = NaN, where the spec's backward
# (np.where in impl_numpy/backward.py), torch.where's and jnp.where's select it away: a masked_row "nan" row's
# NaN value gradient came through the value clip's untaken branch into value and value.kernel (random_982308,
# docs/conformance.md). The stages select with `where`, whose VJP selects too.
def _unbroadcast(g: mx.array, shape) -> mx.array:
    """A cotangent of a broadcast result summed back to an operand's shape."""
    if g.ndim > len(shape):
        g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


@mx.custom_function
def _select(condition: mx.array, x: mx.array, y: mx.array) -> mx.array:
    return mx.where(condition, x, y)


@_select.vjp
def _select_vjp(primals, cotangent, output):
    condition, x, y = primals
    zero = mx.zeros_like(cotangent)
    return (mx.zeros_like(condition), _unbroadcast(mx.where(condition, cotangent, zero), x.shape).astype(x.dtype),
            _unbroadcast(mx.where(condition, zero, cotangent), y.shape).astype(y.dtype))


def where(condition: mx.array, x: mx.array, y: mx.array) -> mx.array:
    """mx.where, its gradient a select as the spec's (above): x's cotangent where condition, y's elsewhere,
    0 in the other, whatever the cotangent holds. Arrays only (scalar() for a constant)."""
    assert all(isinstance(a, mx.array) for a in (condition, x, y)), "where takes arrays (scalar() for a number)"
    return _select(condition, x, y)


def cos_sin(angles: mx.array) -> tuple[mx.array, mx.array]:
    """cos and sin of RoPE's angles (no gradient flows through them), float64-accurate in float64."""
    if angles.dtype == mx.float64:
        host = np.array(angles)
        return mx.array(np.cos(host), dtype=mx.float64), mx.array(np.sin(host), dtype=mx.float64)
    return mx.cos(angles), mx.sin(angles)


# -- stages --------------------------------------------------------------------

def project(x: mx.array, kernel: mx.array, bias: mx.array | None) -> mx.array:
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F). The product is
    rounded to the storage dtype before the bias is added (the spec's rounding rule)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, kernel.reshape(D, -1), x.dtype)  # (B, L, F)
    if bias is not None:
        c = compute_of(x.dtype)
        y = (y.astype(c) + bias.reshape(-1).astype(c)).astype(x.dtype)  # (B, L, F)
    return y


def clip(x: mx.array, c: float) -> mx.array:
    """QKV clip: a projection clamped to [-c, c] (MPT's and OLMo's clip_qkv, after the projection's bias),
    c rounded to the storage dtype first (clip_bound). Two selects, so that the gradient passes where
    |x| <= the bound, bounds included, and is 0 elsewhere even where it is NaN (`where`); a NaN passes as
    NaN, as np.clip gives it."""
    bound = scalar(float(clip_bound(c, np_dtype(x.dtype))), x.dtype)
    return where(x > bound, bound, where(x < -bound, -bound, x))


def clip_bound(c: float, dtype) -> np.generic:
    """The clip's bound in the storage dtype: the values the clip passes (and its gradient) are those with
    |x| <= this, bounds included."""
    return np.dtype(dtype).type(c)


def norm(x: mx.array, scale, bias, kind: str, eps: float, heads: int, scope: str) -> mx.array:
    """QK-norm (or the value norm) of a projection x (B, L, F = heads*W), in compute dtype.
    scope "head": each head's W features normalised on their own, scale/bias (W,)
    shared by the heads (Qwen3, Gemma 3) or (heads, W), one per head (Cohere);
    "all": the whole F at once, scale/bias (heads, W) (OLMo 2); scale None: a
    weightless norm (Llama 4's L2 norm, Gemma 3n's value norm). kind
    "rms": x / sqrt(mean(x^2) + eps) * scale; "layer": (x - mean) / sqrt(var +
    eps) * scale + bias (eps inside the root)."""
    B, L, F = x.shape
    c = compute_of(x.dtype)
    width = F // heads if scope == "head" else F
    y = x.astype(c).reshape(B, L, F // width, width)  # (B, L, heads|1, W|F)

    def per_feature(t):  # (W,) or (heads, W) on (B, L, heads, W); (heads, W) as (F,) on (B, L, 1, F)
        return t.astype(c).reshape(-1) if scope == "all" else t.astype(c)

    if kind == "layer":
        y = y - y.mean(axis=-1, keepdims=True)
    y = y / mx.sqrt((y * y).mean(axis=-1, keepdims=True) + scalar(eps, c))
    if scale is not None:
        y = y * per_feature(scale)
    if bias is not None:
        y = y + per_feature(bias)
    return y.reshape(B, L, F).astype(x.dtype)  # (B, L, F)


def norm_heads(x: mx.array, scale, bias, kind: str, eps: float, scope: str) -> mx.array:
    """The norm of x (B, heads, L, W) after RoPE: norm() on its flat (B, L, heads*W) view -> (B, heads, L, W)."""
    B, heads, L, W = x.shape
    flat = x.transpose(0, 2, 1, 3).reshape(B, L, heads * W)
    return split_heads(norm(flat, scale, bias, kind, eps, heads, scope), heads)


def split_heads(x: mx.array, num_heads: int) -> mx.array:
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = x.shape
    x = x.reshape(B, L, num_heads, F // num_heads)  # (B, L, heads, width)
    return x.transpose(0, 2, 1, 3)  # (B, heads, L, width)


def rope_angles(positions: mx.array, inv_freq: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """position x frequency in compute dtype: positions (B|1, L) int, or one per pair (B|1, L, R/2)
    (multimodal RoPE: mrope_positions), inv_freq (R/2,) float64 NumPy constants (weights.rope), rounded once
    to the compute dtype as the spec -> (B|1, 1, L, R/2)."""
    c = compute_of(dtype)
    freq = mx.array(np.asarray(inv_freq).astype(np_dtype(c)), dtype=c)  # (R/2,)
    p = positions.astype(c)
    p = p[:, None, :, None] if p.ndim == 2 else p[:, None]  # (B|1, 1, L, 1|R/2)
    return p * freq  # (B|1, 1, L, R/2)


def rope(x: mx.array, angles: mx.array, rotary_dim: int, interleaved: bool, attention_factor: float) -> mx.array:
    """Rotate each pair of x's first rotary_dim features by its angle; x (B,
    heads, L, H), angles (B|1, 1, L, R/2). Half-split (interleaved False)
    pairs feature i with i + R/2 (GPT-NeoX, Hugging Face's rotate_half);
    interleaved pairs 2i with 2i+1 (GPT-J, Meta's Llama). (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin times attention_factor
    (YaRN; 1 otherwise); features past rotary_dim pass through."""
    c = compute_of(x.dtype)
    R = rotary_dim
    cos, sin = cos_sin(angles)
    cos = cos * scalar(attention_factor, c)  # (B|1, 1, L, R/2)
    sin = sin * scalar(attention_factor, c)
    xr = x[..., :R].astype(c)
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : R // 2], xr[..., R // 2:])
    y1 = x1 * cos - x2 * sin  # (B, heads, L, R/2)
    y2 = x2 * cos + x1 * sin
    turned = mx.stack([y1, y2], axis=-1).reshape(xr.shape) if interleaved else mx.concatenate([y1, y2], axis=-1)
    return mx.concatenate([turned.astype(x.dtype), x[..., R:]], axis=-1)  # (B, heads, L, H)


def rope_last(x: mx.array, angles: mx.array, rotary_dim: int, interleaved: bool, attention_factor: float):
    """RoPE on the LAST rotary_dim features of x (B, heads, L, H): a latent layer's heads are [features
    without position | rotary features] (DeepSeek's order); the first H - rotary_dim pass through."""
    H = x.shape[-1]
    turned = rope(x[..., H - rotary_dim:], angles, rotary_dim, interleaved, attention_factor)
    return mx.concatenate([x[..., : H - rotary_dim], turned], axis=-1)


def join_keys(k_nope: mx.array, k_rope: mx.array) -> mx.array:
    """KEY.JOIN (latent): each head's key features from the latent, k_nope (B, K, S, H - R), then the rotary
    key every head shares, k_rope (B, 1, S, R) -> (B, K, S, H)."""
    return mx.concatenate([k_nope, mx.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1)


def absorb_query(q: mx.array, key_kernel: mx.array, rope_dim: int) -> mx.array:
    """The absorbed form's query (latent): each head's features without position taken through its key
    up-projection's transpose, q_nope W_uk^T (C features), then its rotary features: (B, N, T, H) with
    key.kernel (C, K, H - R) -> (B, N, T, C + R), in compute dtype, stored. Query head n reads key head
    n // G."""
    B, N, T, H = q.shape
    C, K, _ = key_kernel.shape
    c = compute_of(q.dtype)
    q_nope = q[..., : H - rope_dim].astype(c).reshape(B, K, N // K, T, H - rope_dim)
    q_latent = mx.einsum("bkgth,ckh->bkgtc", q_nope, key_kernel.astype(c)).reshape(B, N, T, C)
    return mx.concatenate([q_latent.astype(q.dtype), q[..., H - rope_dim:]], axis=-1)


def expand_values(ctx_latent: mx.array, value_kernel: mx.array) -> mx.array:
    """The absorbed form's context (latent): each head's attention over the latent, (B, N, T, C), through
    its value up-projection (C, K, V) -> (B, N, T, V) (sum_j w_j (c_j W_uv) = (sum_j w_j c_j) W_uv)."""
    B, N, T, C = ctx_latent.shape
    K = value_kernel.shape[1]
    c = compute_of(ctx_latent.dtype)
    grouped = ctx_latent.astype(c).reshape(B, K, N // K, T, C)
    y = mx.einsum("bkgtc,ckv->bkgtv", grouped, value_kernel.astype(c))
    return y.reshape(B, N, T, -1).astype(ctx_latent.dtype)


def temperature_factor(positions: mx.array, beta: float, floor: float, offset: int, dtype: mx.Dtype) -> mx.array:
    """The query temperature's factor per query, (B|1, 1, T, 1) in compute dtype:
    1 + beta * ln(1 + floor((position + offset) / floor)). The floor of the
    quotient is exact, as the spec's float64 one: an integer division where
    floor is a whole number, else in float64 on the CPU; the log in compute dtype."""
    c = compute_of(dtype)
    if float(floor).is_integer():
        steps = mx.floor_divide(positions + offset, int(floor))  # (B|1, T): integers, floored toward -inf
    else:
        wide = positions.astype(mx.float64, stream=mx.cpu)
        steps = mx.floor((wide + offset) / floor, stream=mx.cpu)
    return (1 + scalar(beta, c) * mx.log1p(steps.astype(c)))[:, None, :, None]


def temperature(q: mx.array, factor: mx.array) -> mx.array:
    """QUERY TEMPERATURE: q (B, N, T, H) times temperature_factor (after RoPE)."""
    return (q.astype(factor.dtype) * factor).astype(q.dtype)


def logits(q: mx.array, k: mx.array, scale: float) -> mx.array:
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, N // K, T, H)  # (B, K, G, T, H)
    c = compute_of(q.dtype)
    scores = mx.einsum(LOGITS.lower(), qg.astype(c), k.astype(c))  # (B, K, G, T, S)
    return (scores * scalar(scale, c)).reshape(B, N, T, S).astype(q.dtype)  # (B, N, T, S)


def softcap(x: mx.array, cap: float) -> mx.array:
    """cap * tanh(logits / cap), after the scale and before mask and bias, so a
    masked position stays -inf (Gemma 2's attn_logit_softcapping, ONNX's softcap)."""
    c = compute_of(x.dtype)
    cc = scalar(cap, c)
    return (mx.tanh(x.astype(c) / cc) * cc).astype(x.dtype)


def alibi_bias(slopes: mx.array, positions: mx.array, key_positions: mx.array, dtype: mx.Dtype,
               rounding: str | None = None) -> mx.array:
    """ALiBi's bias in compute dtype, (B|1, N, T, S): -slope_n * |pos_q(i) - pos_k(j)|. slopes (N,),
    positions (B|1, T), key_positions (B|1, S) of every key (all_key_positions).
    rounding (config.alibi_bias_dtype): Falcon-RW's round(round(slope_n) * round(pos_k(j))) in that dtype,
    each a cast (MLX keeps every cast it is given); the roundings pass the gradient straight through (d slope_n
    = sum(d bias * round(pos_k)), as impl_torch's): the rounded bias is the exact product plus a stop_gradient
    of their difference, since MLX's VJP of a cast to bfloat16 rounds the cotangent to bfloat16 too (its
    float64 slopes' gradient was 0.02 off, found by tests/test_mirrors_modern.py's mlx_alibi_bf16_cache)."""
    c = compute_of(dtype)
    if rounding is not None:
        r = to_mx_dtype(dtype_from_name(rounding))
        slope = slopes.astype(c).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
        key = key_positions.astype(c).astype(r).astype(c)[:, None, None, :]  # (B|1, 1, 1, S)
        exact = slope * key  # (B|1, N, 1, S): carries the gradient
        rounded = (mx.stop_gradient(slope).astype(r).astype(c) * key).astype(r).astype(c)
        bias = exact + mx.stop_gradient(rounded - exact)  # the rounded values (Sterbenz: the difference is exact)
        B = max(positions.shape[0], key_positions.shape[0])
        return mx.broadcast_to(bias, (B, bias.shape[1], positions.shape[1], bias.shape[3]))  # (B|1, N, T, S)
    distance = mx.abs(positions[:, :, None] - key_positions[:, None, :]).astype(c)  # (B|1, T, S)
    return -slopes.astype(c).reshape(1, -1, 1, 1) * distance[:, None]  # (B|1, N, T, S)


def alibi(x: mx.array, bias: mx.array) -> mx.array:
    """ALIBI: the scaled (and softcapped) logits plus alibi_bias, before the mask (so a masked position stays
    -inf)."""
    return (x.astype(bias.dtype) + bias).astype(x.dtype)


def mask(x: mx.array, allowed, bias) -> mx.array:
    """Add bias, then set disallowed positions to -inf. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A -inf in bias is a mask, the same
    as a False in allowed: the position is set to -inf, whatever the logit. A
    select, so a masked position gets no gradient (as in impl_numpy/backward.py)."""
    if bias is not None:
        x = (x.astype(compute_of(x.dtype)) + bias).astype(x.dtype)
        finite = bias > -mx.inf  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        x = where(allowed, x, scalar(-np.inf, x.dtype))
    return x


def softmax(x: mx.array, masked_row: str, sinks=None) -> mx.array:
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN.
    sinks (N,): one logit per head that joins every row's denominator and
    attends to nothing (gpt-oss); a fully masked row puts all its mass on the
    sink (weights 0, whatever masked_row says). The row max is held constant
    for the gradient (softmax is shift-invariant), and an empty row's
    denominator is 1, so no 0/0 reaches a gradient."""
    c = compute_of(x.dtype)
    xc = x.astype(c)
    row_max = xc.max(axis=-1, keepdims=True)  # (B, N, T, 1)
    sink = None if sinks is None else sinks.astype(c).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
    if sink is not None:
        row_max = mx.maximum(row_max, sink)
    row_max = mx.stop_gradient(row_max)
    empty = row_max == -mx.inf
    row_max = mx.where(empty, scalar(0, c), row_max)
    w = exp(xc - row_max)  # masked -> exactly 0
    total = w.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + exp(sink - row_max)
    total = where(empty, scalar(1, c), total)
    w = w / total
    fill = {"zero": 0.0, "uniform": 1.0 / x.shape[-1], "nan": np.nan}[masked_row]
    w = where(empty, scalar(fill, c), w)
    return w.astype(x.dtype)


def dropout(w: mx.array, keep, rate: float) -> mx.array:
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    c = compute_of(w.dtype)
    return where(keep, w.astype(c) / scalar(1.0 - rate, c), scalar(0, c)).astype(w.dtype)


def attend(w: mx.array, v: mx.array) -> mx.array:
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = w.shape
    K = v.shape[1]
    wg = w.reshape(B, K, N // K, T, S)  # (B, K, G, T, S)
    return _einsum(ATTEND, wg, v, w.dtype).reshape(B, N, T, v.shape[-1])  # (B, N, T, V)


def gate_project(x: mx.array, kernel: mx.array, bias) -> mx.array:
    """GATE.PROJECT: the query input (B, T, D) times gate.kernel (D, N, V) or (D, N) -> (B, T, N*V) or (B, T, N)."""
    return project(x, kernel, bias)


def gate(ctx: mx.array, gate_logits: mx.array, num_heads: int) -> mx.array:
    """GATE: the context (B, N, T, V) times sigmoid of gate.project's logits, (B, T, N*V) per element or
    (B, T, N) per head; in compute dtype, stored."""
    c = compute_of(ctx.dtype)
    B, N, T, V = ctx.shape
    g = gate_logits.astype(c).reshape(B, T, num_heads, -1).transpose(0, 2, 1, 3)  # (B, N, T, V|1)
    g = 1 / (1 + exp(-g))
    return (ctx.astype(c) * g).astype(ctx.dtype)


# -- differential attention (config.differential: diffllama) ------------------------

def value_pair(v: mx.array) -> mx.array:
    """VALUE.PAIR: v (B, K, S, V) -> (B, K, S, 2V), kv head g's value joined with its pair's: [v_g' | v_{g'+K/2}],
    g' = g mod K/2."""
    half = v.shape[1] // 2
    joined = mx.concatenate([v[:, :half], v[:, half:]], axis=-1)  # (B, K/2, S, 2V)
    return mx.concatenate([joined, joined], axis=1)  # (B, K, S, 2V)


def differential_lambda(lq1: mx.array, lk1: mx.array, lq2: mx.array, lk2: mx.array, lambda_init: float,
                        dtype) -> mx.array:
    """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init: a 0-d array in compute
    dtype (exp: this module's, float64-accurate in float64)."""
    c = compute_of(dtype)
    one = exp((lq1.astype(c) * lk1.astype(c)).sum())
    two = exp((lq2.astype(c) * lk2.astype(c)).sum())
    return one - two + scalar(lambda_init, c)


def differential(ctx: mx.array, lam: mx.array, lambda_init: float, eps: float) -> mx.array:
    """DIFFERENTIAL: ctx (B, N, T, 2V) -> (B, N/2, T, 2V): head n's minus lambda times head n + N/2's, an RMS norm
    over the 2V features (no weight, eps inside the root), times (1 - lambda_init); in compute dtype, stored."""
    c = compute_of(ctx.dtype)
    half = ctx.shape[1] // 2
    x = ctx.astype(c)
    d = x[:, :half] - lam.astype(c) * x[:, half:]  # (B, N/2, T, 2V)
    y = d / mx.sqrt((d * d).mean(axis=-1, keepdims=True) + scalar(eps, c)) * scalar(1 - lambda_init, c)
    return y.astype(ctx.dtype)


def differential_stage(config, params: dict, ctx: mx.array) -> mx.array:
    """The differential stage of a call: differential_lambda from params' differential.lambda_* and the config's
    lambda_init, then differential."""
    d = config.differential
    lam = differential_lambda(*(params[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")), d.lambda_init,
                              ctx.dtype)
    return differential(ctx, lam, d.lambda_init, d.eps)


def merge_heads(x: mx.array) -> mx.array:
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, N * V)  # (B, T, N*V)


def output(x: mx.array, kernel: mx.array, bias) -> mx.array:
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O)."""
    return project(x, kernel.reshape(-1, 1, kernel.shape[-1]), None if bias is None else bias)


# `mask` is both a stage and an argument name; callers use this alias.
mask_stage = mask


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape: tuple[int, ...], rate: float, seed: int) -> mx.array:
    """MLX's own seeded keep-mask. Seeds are per framework: for the same
    dropout across frameworks pass an explicit dropout_mask instead."""
    return mx.random.uniform(shape=shape, key=mx.random.key(int(seed or 0))) >= rate


def allowed_mask(mask4, T: int, S: int, is_causal: bool, causal_alignment: str, *, window_left: int = -1,
                 window_right: int = -1, segment_ids=None, key_segment_ids=None, local_chunk: int | None = None,
                 positions=None, key_positions=None):
    """mask AND causal AND window AND local chunks AND segments, rank 4, broadcastable to (B, N,
    T, S) (S: every key, the cache's included); None if none applies."""
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


def selection_mask(topk_indices, num_heads: int, S: int) -> mx.array:
    """impl_numpy's selection_mask: topk_indices (B, T, k) or (B, K, T, k) -> bool (B, 1|N, T, S) (S: every key,
    the cache's first), -1 selecting nothing (put_along_axis into a spare column S, dropped), kv head K's
    selection for its G query heads (query head n reads kv head n // G, as attend groups them)."""
    idx = topk_indices.astype(mx.int64)
    idx = idx[:, None] if idx.ndim == 3 else idx  # (B, K|1, T, k)
    B, K, T, _ = idx.shape
    selected = mx.zeros((B, K, T, S + 1), dtype=mx.bool_)  # column S: where the -1 slots land, dropped below
    selected = mx.put_along_axis(selected, mx.where(idx < 0, S, idx), mx.array(True), axis=-1)[..., :S]
    return selected if K == 1 else mx.repeat(selected, num_heads // K, axis=1)  # (B, 1|N, T, S)


def all_key_positions(key_positions: mx.array, P: int, past_key_positions=None) -> mx.array:
    """Every key's position, (B|1, P+S): the cache's keys at past_key_positions (B|1, P) (default 0..P-1),
    then the new keys' key_positions (B|1, S)."""
    if key_positions.ndim == 3:  # multimodal RoPE's, one per pair (mrope_positions): no stage but RoPE reads them
        return None
    if not P:
        return key_positions
    cached = mx.arange(P, dtype=mx.int64)[None] if past_key_positions is None else past_key_positions  # (B|1, P)
    B = max(cached.shape[0], key_positions.shape[0])
    return mx.concatenate([mx.broadcast_to(cached, (B, P)).astype(mx.int64),
                           mx.broadcast_to(key_positions, (B, key_positions.shape[1])).astype(mx.int64)], axis=1)


def temperature_positions(positions: mx.array, source: str, P: int, T: int) -> mx.array:
    """The positions a query temperature reads, (B|1, T): the queries' positions ("positions"), or their
    index in the cache, P + arange(T) ("cache_index": transformers' Llama 4, left pads counted)."""
    return positions if source == "positions" else (P + mx.arange(T, dtype=mx.int64))[None]


def default_positions(positions, P: int, L: int) -> mx.array:
    """(B|1, L) int64: the given positions ((L,) or (B, L)), or P + arange(L)
    (the cache's length P offsets new tokens)."""
    if positions is None:
        return (P + mx.arange(L, dtype=mx.int64))[None]  # (1, L)
    positions = positions.astype(mx.int64)
    return positions[None] if positions.ndim == 1 else positions  # (B|1, L)


# -- issue 42: the key multiplier and the value scale (mirrors impl_numpy/functional.py) ---------------

def multiply(x: mx.array, factor: float) -> mx.array:
    """KEY MULTIPLIER / VALUE SCALE: a projection (B, L, F) times a config number, in compute dtype."""
    c = compute_of(x.dtype)
    return (x.astype(c) * scalar(factor, c)).astype(x.dtype)


def mrope_positions(positions, P: int, L: int, axes: np.ndarray) -> mx.array:
    """Multimodal RoPE: each rotating pair's position, (B|1, L, R/2) int64. positions (3, L) or (3, B, L):
    the temporal, height and width rows (default: P + arange(L) on all three, a text token's); axes (R/2,)
    the axis that turns each pair (weights.rope.mrope_axes)."""
    if positions is None:
        positions = mx.broadcast_to((P + mx.arange(L, dtype=mx.int64))[None, None], (3, 1, L))  # (3, 1, L)
    positions = positions.astype(mx.int64)
    positions = positions[:, None] if positions.ndim == 2 else positions  # (3, B|1, L)
    return mx.take(positions, mx.array(np.asarray(axes)), axis=0).transpose(1, 2, 0)  # (B|1, L, R/2)
