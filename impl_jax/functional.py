"""Multi-head attention in JAX, one pure function per stage: mirrors impl_numpy/functional.py.

Same stage functions, same names, same order, same einsum strings as the
NumPy spec; jax.numpy and jax.lax only. Shape letters as in impl_numpy:
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages (the bracketed ones where the config turns them on):
project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope]
-> [query temperature] -> [cache appended] -> logits (scale) -> [softcap] -> [alibi] -> mask (bias,
causal, window, local chunks, segments) -> softmax [+ sinks] -> dropout ->
attend -> [gate] -> merge_heads -> output.

The call that runs them and chooses between the stages, the fused XLA
expression and the chunked path is attention.py (`apply`; its validation
in call.py, the stages up to the keys in heads.py, the fused expression in
fused.py); chunked.py holds the chunked path. Both import this file; this
file imports neither.

Precision rule (as the spec): each stage's result is stored in the storage
dtype; its arithmetic runs in `compute_dtype`, float32 for float16/bfloat16,
the dtype itself otherwise. Every einsum runs at lax.Precision.HIGHEST
(true float32 on GPUs, where JAX's default is TF32) unless the caller passes
precision="tf32" or "default" (both lax.Precision.DEFAULT: TF32 on Ampere and
later GPUs unless jax_default_matmul_precision says otherwise, float32 on CPUs).

Integer inputs (positions, segment ids) are arrays, traced under jit; the
config's rope, softcap, windows, qk_norm and the frontier fields (alibi,
local_chunk, query_temperature, qkv_clip, output_gate) are Python values
(the config is a static argument), so each of them shapes the compiled
program; ALiBi's slopes and the gate's kernel are tensors (traced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from weights import compute_dtype
from weights.call import ATTEND, LOGITS, OUTPUT, PROJECT

from .masks import causal_mask, chunk_mask, segment_mask, window_mask

PRECISIONS = {
    "highest": lax.Precision.HIGHEST,  # float32 matmuls everywhere (the correctness setting)
    "tf32": lax.Precision.DEFAULT,  # TF32 on Ampere+ GPUs: asked for explicitly
    "default": lax.Precision.DEFAULT,  # whatever the platform does by default
}


def _precision(precision: str) -> lax.Precision:
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}: got {precision!r}") from None


def _einsum(spec: str, a, b, dtype, precision: str):
    """einsum in compute dtype, result stored in `dtype` (the spec's _matmul)."""
    ct = compute_dtype(dtype)
    y = jnp.einsum(spec, a.astype(ct), b.astype(ct), precision=_precision(precision))
    return y.astype(dtype)


# -- stages --------------------------------------------------------------------

def project(x, kernel, bias, precision: str = "highest"):
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, kernel.reshape(D, -1), x.dtype, precision)  # (B, L, F)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = (y.astype(ct) + bias.reshape(-1).astype(ct)).astype(x.dtype)  # (B, L, F)
    return y


def clip(x, c: float):
    """QKV clip: a projection clamped to [-c, c] (MPT's and OLMo's clip_qkv, after the projection's bias),
    c rounded to the storage dtype first (clip_bound, as the spec and torch.clamp round it). Two selects,
    so that the gradient passes where |x| <= the bound, bounds included (jnp.clip's max and min would
    halve it at a bound); a NaN passes as NaN, as np.clip gives it."""
    bound = jnp.asarray(clip_bound(c, x.dtype), x.dtype)
    return jnp.where(x > bound, bound, jnp.where(x < -bound, -bound, x))


def clip_bound(c: float, dtype):
    """The clip's bound in the storage dtype: the values the clip passes (and its gradient) are those with
    |x| <= this, bounds included."""
    return np.dtype(dtype).type(c)


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
    B, L, F = x.shape
    ct = compute_dtype(x.dtype)
    width = F // heads if scope == "head" else F
    y = x.astype(ct).reshape(B, L, F // width, width)  # (B, L, heads|1, W|F)

    def per_feature(t):  # (W,) or (heads, W) on (B, L, heads, W); (heads, W) as (F,) on (B, L, 1, F)
        return t.astype(ct).reshape(-1) if scope == "all" else t.astype(ct)

    if kind == "layer":
        y = y - y.mean(axis=-1, keepdims=True)
    y = y / jnp.sqrt((y * y).mean(axis=-1, keepdims=True) + jnp.asarray(eps, ct))
    if scale is not None:
        y = y * per_feature(scale)
    if bias is not None:
        y = y + per_feature(bias)
    return y.reshape(B, L, F).astype(x.dtype)  # (B, L, F)


def norm_heads(x, scale, bias, kind: str, eps: float, scope: str):
    """The norm of x (B, heads, L, W) after RoPE: norm() on its flat (B, L, heads*W) view -> (B, heads, L, W)."""
    B, heads, L, W = x.shape
    flat = x.transpose(0, 2, 1, 3).reshape(B, L, heads * W)
    return split_heads(norm(flat, scale, bias, kind, eps, heads, scope), heads)


def split_heads(x, num_heads: int):
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = x.shape
    x = x.reshape(B, L, num_heads, F // num_heads)  # (B, L, heads, width)
    return x.transpose(0, 2, 1, 3)  # (B, heads, L, width)


def rope_angles(positions, inv_freq: np.ndarray, dtype):
    """position x frequency in compute dtype: positions (B|1, L) int (traced), or one per pair (B|1, L, R/2)
    (multimodal RoPE: mrope_positions), inv_freq (R/2,) float64 NumPy constants (weights.rope) -> (B|1, 1,
    L, R/2)."""
    ct = compute_dtype(dtype)
    freq = jnp.asarray(np.asarray(inv_freq).astype(ct))  # (R/2,): rounded once to the compute dtype, as the spec
    p = positions.astype(ct)
    p = p[:, None, :, None] if p.ndim == 2 else p[:, None]  # (B|1, 1, L, 1|R/2)
    return p * freq  # (B|1, 1, L, R/2)


def rope(x, angles, rotary_dim: int, interleaved: bool, attention_factor: float):
    """Rotate each pair of x's first rotary_dim features by its angle; x (B,
    heads, L, H), angles (B|1, 1, L, R/2). Half-split (interleaved False)
    pairs feature i with i + R/2 (GPT-NeoX, Hugging Face's rotate_half);
    interleaved pairs 2i with 2i+1 (GPT-J, Meta's Llama). (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin times attention_factor
    (YaRN; 1 otherwise); features past rotary_dim pass through."""
    ct = compute_dtype(x.dtype)
    R = rotary_dim
    cos = jnp.cos(angles) * jnp.asarray(attention_factor, ct)  # (B|1, 1, L, R/2)
    sin = jnp.sin(angles) * jnp.asarray(attention_factor, ct)
    xr = x[..., :R].astype(ct)
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : R // 2], xr[..., R // 2:])
    y1 = x1 * cos - x2 * sin  # (B, heads, L, R/2)
    y2 = x2 * cos + x1 * sin
    turned = jnp.stack([y1, y2], axis=-1).reshape(xr.shape) if interleaved else jnp.concatenate([y1, y2], axis=-1)
    return jnp.concatenate([turned.astype(x.dtype), x[..., R:]], axis=-1)  # (B, heads, L, H)


def temperature_factor(positions, beta: float, floor: float, offset: int, dtype):
    """The query temperature's factor per query, (B|1, 1, T, 1) in compute dtype:
    1 + beta * ln(1 + floor((position + offset) / floor)). The floor of the
    quotient is exact, as the spec's float64 one: an integer division where
    floor is a whole number, else in float64 (x64) or the compute dtype; the
    log in compute dtype."""
    ct = compute_dtype(dtype)
    if float(floor).is_integer():
        steps = (positions + offset) // int(floor)  # (B|1, T): integers, floored toward -inf as np.floor
    else:
        wide = jnp.float64 if jax.config.jax_enable_x64 else ct
        steps = jnp.floor((positions.astype(wide) + offset) / jnp.asarray(floor, wide))
    return (1 + jnp.asarray(beta, ct) * jnp.log1p(steps.astype(ct)))[:, None, :, None]


def temperature(q, factor):
    """QUERY TEMPERATURE: q (B, N, T, H) times temperature_factor (after RoPE)."""
    return (q.astype(factor.dtype) * factor).astype(q.dtype)


def rope_last(x, angles, rotary_dim: int, interleaved: bool, attention_factor: float):
    """RoPE on the LAST rotary_dim features of x (B, heads, L, H): a latent layer's heads are [features
    without position | rotary features] (DeepSeek's order); the first H - rotary_dim pass through."""
    H = x.shape[-1]
    turned = rope(x[..., H - rotary_dim:], angles, rotary_dim, interleaved, attention_factor)
    return jnp.concatenate([x[..., : H - rotary_dim], turned], axis=-1)


def join_keys(k_nope, k_rope):
    """KEY.JOIN (latent): each head's key features from the latent, k_nope (B, K, S, H - R), then the rotary
    key every head shares, k_rope (B, 1, S, R) -> (B, K, S, H)."""
    return jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1)


def absorb_query(q, key_kernel, rope_dim: int, precision: str = "highest"):
    """The absorbed form's query (latent): each head's features without position taken through its key
    up-projection's transpose, q_nope W_uk^T (C features), then its rotary features: (B, N, T, H) with
    key.kernel (C, K, H - R) -> (B, N, T, C + R), in compute dtype, stored. Query head n reads key head
    n // G. Then q_abs . [latent | rotary key] = q . [latent W_uk | rotary key]: the expanded logits."""
    B, N, T, H = q.shape
    C, K, _ = key_kernel.shape
    ct = compute_dtype(q.dtype)
    q_nope = q[..., : H - rope_dim].astype(ct).reshape(B, K, N // K, T, H - rope_dim)
    q_latent = jnp.einsum("bkgth,ckh->bkgtc", q_nope, key_kernel.astype(ct),
                          precision=_precision(precision)).reshape(B, N, T, C)
    return jnp.concatenate([q_latent.astype(q.dtype), q[..., H - rope_dim:]], axis=-1)


def expand_values(ctx_latent, value_kernel, precision: str = "highest"):
    """The absorbed form's context (latent): each head's attention over the latent, (B, N, T, C), through
    its value up-projection (C, K, V) -> (B, N, T, V) (sum_j w_j (c_j W_uv) = (sum_j w_j c_j) W_uv)."""
    B, N, T, C = ctx_latent.shape
    K = value_kernel.shape[1]
    ct = compute_dtype(ctx_latent.dtype)
    grouped = ctx_latent.astype(ct).reshape(B, K, N // K, T, C)
    y = jnp.einsum("bkgtc,ckv->bkgtv", grouped, value_kernel.astype(ct), precision=_precision(precision))
    return y.reshape(B, N, T, -1).astype(ctx_latent.dtype)


def logits(q, k, scale: float, precision: str = "highest"):
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, N // K, T, H)  # (B, K, G, T, H)
    ct = compute_dtype(q.dtype)
    scores = jnp.einsum(LOGITS, qg.astype(ct), k.astype(ct), precision=_precision(precision))  # (B, K, G, T, S)
    return (scores * jnp.asarray(scale, ct)).reshape(B, N, T, S).astype(q.dtype)  # (B, N, T, S)


def softcap(x, cap: float):
    """cap * tanh(logits / cap), after the scale and before mask and bias, so a
    masked position stays -inf (Gemma 2's attn_logit_softcapping, ONNX's softcap)."""
    ct = compute_dtype(x.dtype)
    c = jnp.asarray(cap, ct)
    return (jnp.tanh(x.astype(ct) / c) * c).astype(x.dtype)


def alibi_bias(slopes, positions, key_positions, dtype, rounding=None):
    """ALiBi's bias in compute dtype, (B|1, N, T, S): -slope_n * |pos_q(i) - pos_k(j)|. slopes (N,),
    positions (B|1, T), key_positions (B|1, S) of every key (all_key_positions). The distance is an
    integer, exact in any compute dtype the contract uses up to 2^24.
    rounding (config.alibi_bias_dtype): Falcon-RW's round(round(slope_n) * round(pos_k(j))) in that dtype;
    the roundings pass the gradient straight through (d slope_n = sum(d bias * round(pos_k)))."""
    ct = compute_dtype(dtype)
    if rounding is not None:
        # lax.reduce_precision, not astype(r).astype(ct): under jit XLA drops a convert pair that loses
        # precision (xla_allow_excess_precision, on by default), and the rounding with it
        bits = {"bfloat16": (8, 7), "float16": (5, 10), "float32": (8, 23)}[rounding]

        def round_(a):
            return lax.reduce_precision(a, *bits)

        slope = slopes.astype(ct).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
        key = round_(key_positions.astype(ct))[:, None, None, :]  # (B|1, 1, 1, S)
        exact = slope * key  # (B|1, N, 1, S): carries the gradient
        rounded = round_(round_(lax.stop_gradient(slope)) * key)
        rows = jnp.zeros_like(positions, dtype=ct)[:, None, :, None]  # (B|1, 1, T, 1)
        return exact + lax.stop_gradient(rounded - exact) + rows  # (B|1, N, T, S)
    distance = jnp.abs(positions[:, :, None] - key_positions[:, None, :]).astype(ct)  # (B|1, T, S)
    return -slopes.astype(ct).reshape(1, -1, 1, 1) * distance[:, None]  # (B|1, N, T, S)


def alibi(x, bias):
    """ALIBI: the scaled (and softcapped) logits plus alibi_bias, before the mask (so a masked position stays
    -inf): BLOOM's baddbmm adds it to the scaled q.k (Falcon-RW's slopes come folded with its scale)."""
    return (x.astype(bias.dtype) + bias).astype(x.dtype)


def mask(x, allowed, bias):
    """Add bias, then set disallowed positions to -inf. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A -inf in bias is a mask, the same
    as a False in allowed: the position is set to -inf, whatever the logit (a
    NaN logit there, from a NaN key, is hidden as a bool mask hides it). A
    select, so a masked position gets no gradient (as in impl_numpy/backward.py)."""
    if bias is not None:
        x = (x.astype(compute_dtype(x.dtype)) + bias).astype(x.dtype)
        finite = bias > -jnp.inf  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        x = jnp.where(allowed, x, jnp.asarray(-jnp.inf, x.dtype))
    return x


def softmax(x, masked_row: str, sinks=None):
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN.
    sinks (N,): one logit per head that joins every row's denominator and
    attends to nothing (gpt-oss): the row's max includes it and the weights
    over S sum to less than 1; a fully masked row puts all its mass on the
    sink (weights 0, whatever masked_row says)."""
    ct = compute_dtype(x.dtype)
    xc = x.astype(ct)
    row_max = jnp.max(xc, axis=-1, keepdims=True)  # (B, N, T, 1)
    sink = None if sinks is None else sinks.astype(ct).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink)
    empty = row_max == -jnp.inf
    # softmax is shift-invariant: the shift carries no gradient
    shift = lax.stop_gradient(jnp.where(empty, jnp.asarray(0, ct), row_max))  # (B, N, T, 1)
    e = jnp.exp(xc - shift)  # masked -> exactly 0
    total = e.sum(axis=-1, keepdims=True)  # (B, N, T, 1)
    if sink is not None:
        total = total + jnp.exp(sink - shift)
    w = e / jnp.where(empty, jnp.asarray(1, ct), total)
    fill = {"zero": 0.0, "uniform": 1.0 / x.shape[-1], "nan": np.nan}[masked_row]
    w = jnp.where(empty, jnp.asarray(fill, ct), w)  # the filled row carries no gradient to its logits
    return w.astype(x.dtype)


def dropout(w, keep, rate: float):
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    ct = compute_dtype(w.dtype)
    return jnp.where(keep, w.astype(ct) / jnp.asarray(1.0 - rate, ct), jnp.asarray(0, ct)).astype(w.dtype)


def attend(w, v, precision: str = "highest"):
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = w.shape
    K = v.shape[1]
    wg = w.reshape(B, K, N // K, T, S)  # (B, K, G, T, S)
    return _einsum(ATTEND, wg, v, w.dtype, precision).reshape(B, N, T, v.shape[-1])  # (B, N, T, V)


def gate_project(x, kernel, bias, precision: str = "highest"):
    """GATE.PROJECT: the query input (B, T, D) times gate.kernel (D, N, V) or (D, N) -> (B, T, N*V) or (B, T, N)."""
    return project(x, kernel, bias, precision)


def gate(ctx, gate_logits, num_heads: int):
    """GATE: the context (B, N, T, V) times sigmoid of gate.project's logits, (B, T, N*V) per element or
    (B, T, N) per head; in compute dtype, stored. jax.nn.sigmoid, not 1 / (1 + exp(-l)): the same values to
    round-off, and a gradient g (1 - g) that stays finite where exp(-l) overflows."""
    ct = compute_dtype(ctx.dtype)
    B, N, T, V = ctx.shape
    g = gate_logits.astype(ct).reshape(B, T, num_heads, -1).transpose(0, 2, 1, 3)  # (B, N, T, V|1)
    return (ctx.astype(ct) * jax.nn.sigmoid(g)).astype(ctx.dtype)


# -- differential attention (config.differential: diffllama) ------------------------

def value_pair(v):
    """VALUE.PAIR: v (B, K, S, V) -> (B, K, S, 2V), kv head g's value joined with its pair's: [v_g' | v_{g'+K/2}],
    g' = g mod K/2."""
    half = v.shape[1] // 2
    joined = jnp.concatenate([v[:, :half], v[:, half:]], axis=-1)  # (B, K/2, S, 2V)
    return jnp.concatenate([joined, joined], axis=1)  # (B, K, S, 2V)


def differential_lambda(lq1, lk1, lq2, lk2, lambda_init: float, dtype):
    """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init: a 0-d array in compute
    dtype."""
    ct = compute_dtype(dtype)
    one = jnp.exp(jnp.sum(lq1.astype(ct) * lk1.astype(ct)))
    two = jnp.exp(jnp.sum(lq2.astype(ct) * lk2.astype(ct)))
    return one - two + lambda_init


def differential(ctx, lam, lambda_init: float, eps: float):
    """DIFFERENTIAL: ctx (B, N, T, 2V) -> (B, N/2, T, 2V): head n's minus lambda times head n + N/2's, an RMS norm
    over the 2V features (no weight, eps inside the root), times (1 - lambda_init); in compute dtype, stored."""
    ct = compute_dtype(ctx.dtype)
    half = ctx.shape[1] // 2
    c = ctx.astype(ct)
    d = c[:, :half] - lam.astype(ct) * c[:, half:]  # (B, N/2, T, 2V)
    y = d / jnp.sqrt(jnp.mean(d * d, axis=-1, keepdims=True) + eps) * (1 - lambda_init)
    return y.astype(ctx.dtype)


def differential_stage(config, params: dict, ctx):
    """The differential stage of a call: differential_lambda from params' differential.lambda_* and the config's
    lambda_init, then differential."""
    d = config.differential
    lam = differential_lambda(*(params[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")), d.lambda_init,
                              ctx.dtype)
    return differential(ctx, lam, d.lambda_init, d.eps)


def merge_heads(x):
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, N * V)  # (B, T, N*V)


def output(x, kernel, bias, precision: str = "highest"):
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O)."""
    y = _einsum(OUTPUT, x, kernel.reshape(-1, kernel.shape[-1]), x.dtype, precision)  # (B, T, O)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = (y.astype(ct) + bias.astype(ct)).astype(x.dtype)  # (B, T, O)
    return y


# `mask` is both a stage and an argument name; callers use this alias.
mask_stage = mask


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape: tuple[int, ...], rate: float, rng) -> jax.Array:
    """JAX's own keep-mask from a PRNG key. Seeds are per framework: for the
    same dropout across frameworks pass an explicit dropout_mask instead."""
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def allowed_mask(mask4, T: int, S: int, is_causal: bool, causal_alignment: str, *, window_left: int = -1,
                 window_right: int = -1, segment_ids=None, key_segment_ids=None, local_chunk: int | None = None,
                 positions=None, key_positions=None):
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


def selection_mask(topk_indices, num_heads: int, S: int):
    """impl_numpy's selection_mask: topk_indices (B, T, k) or (B, K, T, k), a traced input like any other ->
    bool (B, 1|N, T, S), -1 selecting nothing (scattered into a spare column S, dropped), kv head K's selection
    for its G query heads."""
    idx = jnp.asarray(topk_indices)
    idx = idx[:, None] if idx.ndim == 3 else idx  # (B, K|1, T, k)
    B, K, T, _ = idx.shape
    idx = jnp.where(idx < 0, S, idx)
    rows = jnp.arange(B)[:, None, None, None], jnp.arange(K)[None, :, None, None], jnp.arange(T)[None, None, :, None]
    selected = jnp.zeros((B, K, T, S + 1), dtype=bool).at[(*rows, idx)].set(True)[..., :S]
    return selected if K == 1 else jnp.repeat(selected, num_heads // K, axis=1)  # (B, 1|N, T, S)


def all_key_positions(key_positions, P, capacity: int | None = None, past_key_positions=None):
    """Every key's position, (B|1, P+S): the cache's keys at past_key_positions (B|1, P) (default 0..P-1),
    then the new keys' key_positions (B|1, S). capacity: an in-place cache's buffer read whole, (B|1,
    capacity) with P a Python int or traced (past_key_positions only with a Python int): slot j < P holds
    the cached key's position (j by default), P <= j < P+S key_positions[j - P], the slots after (hidden)
    position 0."""
    if key_positions.ndim == 3:  # multimodal RoPE's, one per pair (mrope_positions): RoPE alone reads them
        return None
    cached = None if past_key_positions is None else past_key_positions.astype(key_positions.dtype)  # (B|1, P)
    B = key_positions.shape[0] if cached is None else max(cached.shape[0], key_positions.shape[0])
    if capacity is None:
        if isinstance(P, int) and not P:
            return key_positions
        if cached is None:
            cached = jnp.broadcast_to(jnp.arange(P, dtype=key_positions.dtype)[None], (key_positions.shape[0], P))
            return jnp.concatenate([cached, key_positions], axis=1)
        return jnp.concatenate([jnp.broadcast_to(cached, (B, cached.shape[1])),
                                jnp.broadcast_to(key_positions, (B, key_positions.shape[1]))], axis=1)  # (B, P+S)
    j = jnp.arange(capacity, dtype=key_positions.dtype)[None]  # (1, C)
    new = jnp.zeros((key_positions.shape[0], capacity), key_positions.dtype)
    new = lax.dynamic_update_slice(new, key_positions, (jnp.asarray(0, jnp.int32), jnp.asarray(P, jnp.int32)))
    if cached is None:
        return jnp.where(j < P, j, new)  # (B|1, C)
    slots = jnp.pad(cached, ((0, 0), (0, capacity - cached.shape[1])))  # (B|1, C): the cached keys' positions first
    return jnp.where(j < P, slots, new)  # (B, C)


def temperature_positions(positions, source: str, P, T: int):
    """The positions a query temperature reads, (B|1, T): the queries' positions ("positions"), or their
    index in the cache, P + arange(T) ("cache_index": transformers' Llama 4, left pads counted). P may be
    traced (an in-place cache's length)."""
    return positions if source == "positions" else default_positions(None, P, T)


def default_positions(positions, P: int, L: int):
    """(B|1, L) integer: the given positions ((L,) or (B, L)), or P + arange(L)
    (the cache's length P offsets new tokens). int32 when made here: JAX has
    no int64 without x64, and positions past 2**31 mean nothing to RoPE."""
    if positions is None:
        return (P + jnp.arange(L, dtype=jnp.int32))[None]  # (1, L)
    positions = jnp.asarray(positions)
    return positions[None] if positions.ndim == 1 else positions  # (B|1, L)



# -- issue 42: the key multiplier and the value scale (mirrors impl_numpy/functional.py) ---------------

def multiply(x, factor: float):
    """KEY MULTIPLIER / VALUE SCALE: a projection (B, L, F) times a config number, in compute dtype."""
    ct = compute_dtype(x.dtype)
    return (x.astype(ct) * jnp.asarray(factor, ct)).astype(x.dtype)


def mrope_positions(positions, P, L: int, axes: np.ndarray):
    """Multimodal RoPE: each rotating pair's position, (B|1, L, R/2) integer. positions (3, L) or (3, B, L):
    the temporal, height and width rows (default: P + arange(L) on all three, a text token's; int32 as
    default_positions); axes (R/2,) the axis that turns each pair (weights.rope.mrope_axes). P may be
    traced (an in-place cache's length)."""
    if positions is None:
        positions = jnp.broadcast_to((P + jnp.arange(L, dtype=jnp.int32))[None, None], (3, 1, L))  # (3, 1, L)
    positions = jnp.asarray(positions)
    positions = positions[:, None] if positions.ndim == 2 else positions  # (3, B|1, L)
    return positions[np.asarray(axes)].transpose(1, 2, 0)  # (B|1, L, R/2)
