"""Multi-head attention in PyTorch, one function per stage: mirrors impl_numpy/functional.py.

Same stage functions, same names, same order, same einsum strings as the
NumPy spec; torch ops only. Shape letters as in impl_numpy:
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages (the bracketed ones where the config turns them on):
project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope]
-> [query temperature] -> [cache appended] -> logits (scale) -> [softcap] -> [alibi] -> mask (bias,
causal, window, local chunks, segments) -> softmax [+ sinks] -> dropout ->
attend -> [gate] -> merge_heads -> output.

The call that runs them (and chooses SDPA, the torch-only fast core in
sdpa.py) is attention.py; this file holds the stages alone and imports
neither.

Precision rule (as the spec): each stage's result is stored in the storage
dtype; its arithmetic runs in `compute_dtype`, float32 for float16/bfloat16.
Under autocast, torch's own rules pick the matmul dtype instead.
"""

from __future__ import annotations

import torch

from weights.call import ATTEND, LOGITS, OUTPUT, PROJECT

from .convert import TORCH_DTYPES, compute_dtype
from .masks import causal_mask, chunk_mask, segment_mask, window_mask


def _einsum(spec: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ct = compute_dtype(dtype)
    return torch.einsum(spec, a.to(ct), b.to(ct)).to(dtype)


# -- stages --------------------------------------------------------------------

def project(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, kernel.reshape(D, -1), x.dtype)  # (B, L, F)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        # In place on the fresh product (its matmul's backward needs only the inputs):
        # one (B, L, F) array fewer at the peak.
        y = y.to(ct).add_(bias.reshape(-1).to(ct)).to(x.dtype)  # bias (F,)
    return y


def clip(x: torch.Tensor, c: float) -> torch.Tensor:
    """QKV clip: a projection clamped to [-c, c], c rounded to the storage dtype (MPT's and OLMo's clip_qkv,
    after the projection's bias). torch.clamp rounds a Python bound to the tensor's dtype, as the spec does;
    the gradient passes where |x| <= that c, bounds included."""
    return torch.clamp(x, -c, c)


def norm(x: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, kind: str, eps: float, heads: int,
         scope: str) -> torch.Tensor:
    """QK-norm (or the value norm) of a projection x (B, L, F = heads*W), in compute dtype.
    scope "head": each head's W features normalised on their own, scale/bias (W,)
    shared by the heads (Qwen3, Gemma 3) or (heads, W), one per head (Cohere);
    "all": the whole F at once, scale/bias (heads, W) (OLMo 2); scale None: a
    weightless norm (Llama 4's L2 norm, Gemma 3n's value norm). Runs on the
    flat projection in both scopes ("head" views it as (B, L, heads, W)
    inside), so its trace has one layout (a norm after RoPE: norm_heads).
    kind "rms": x / sqrt(mean(x^2) + eps) * scale; "layer": (x - mean) /
    sqrt(var + eps) * scale + bias (eps inside the root)."""
    B, L, F = x.shape
    ct = compute_dtype(x.dtype)
    width = F // heads if scope == "head" else F
    y = x.to(ct).reshape(B, L, F // width, width)  # (B, L, heads|1, W|F)

    def per_feature(t):  # (W,) or (heads, W) on (B, L, heads, W); (heads, W) as (F,) on (B, L, 1, F)
        return t.to(ct).reshape(-1) if scope == "all" else t.to(ct)

    if kind == "layer":
        y = y - y.mean(dim=-1, keepdim=True)
    y = y / torch.sqrt((y * y).mean(dim=-1, keepdim=True) + eps)
    if scale is not None:
        y = y * per_feature(scale)
    if bias is not None:
        y = y + per_feature(bias)
    return y.reshape(B, L, F).to(x.dtype)  # (B, L, F)


def norm_heads(x: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, kind: str, eps: float,
               scope: str) -> torch.Tensor:
    """The norm of x (B, heads, L, W) after RoPE: norm() on its flat (B, L, heads*W) view -> (B, heads, L, W)."""
    B, heads, L, W = x.shape
    flat = x.transpose(1, 2).reshape(B, L, heads * W)
    return split_heads(norm(flat, scale, bias, kind, eps, heads, scope), heads)


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = x.shape
    x = x.reshape(B, L, num_heads, F // num_heads)  # (B, L, heads, width)
    return x.transpose(1, 2)  # (B, heads, L, width)


def rope_angles(positions: torch.Tensor, inv_freq, dtype: torch.dtype) -> torch.Tensor:
    """position x frequency in compute dtype: positions (B|1, L) int, or one per pair (B|1, L, R/2)
    (multimodal RoPE: mrope_positions), inv_freq (R/2,) float64 (weights.rope, a NumPy array) -> (B|1, 1, L, R/2)."""
    ct = compute_dtype(dtype)
    freq = torch.as_tensor(inv_freq, device=positions.device).to(ct)  # float64 rounded once, as the spec's astype
    p = positions.to(ct)
    p = p[:, None, :, None] if p.ndim == 2 else p[:, None]  # (B|1, 1, L, 1|R/2)
    return p * freq  # (B|1, 1, L, R/2)


def rope(x: torch.Tensor, angles: torch.Tensor, rotary_dim: int, interleaved: bool,
         attention_factor: float) -> torch.Tensor:
    """Rotate each pair of x's first rotary_dim features by its angle; x (B,
    heads, L, H), angles (B|1, 1, L, R/2). Half-split (interleaved False)
    pairs feature i with i + R/2 (GPT-NeoX, Hugging Face's rotate_half);
    interleaved pairs 2i with 2i+1 (GPT-J, Meta's Llama). (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), cos and sin times attention_factor
    (YaRN; 1 otherwise); features past rotary_dim pass through."""
    ct = compute_dtype(x.dtype)
    R = rotary_dim
    cos = torch.cos(angles) * attention_factor  # (B|1, 1, L, R/2)
    sin = torch.sin(angles) * attention_factor
    xr = x[..., :R].to(ct)
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : R // 2], xr[..., R // 2:])
    y1 = x1 * cos - x2 * sin  # (B, heads, L, R/2)
    y2 = x2 * cos + x1 * sin
    turned = torch.stack([y1, y2], dim=-1).reshape(xr.shape) if interleaved else torch.cat([y1, y2], dim=-1)
    return torch.cat([turned.to(x.dtype), x[..., R:]], dim=-1)  # (B, heads, L, H)


def rope_last(x: torch.Tensor, angles: torch.Tensor, rotary_dim: int, interleaved: bool,
              attention_factor: float) -> torch.Tensor:
    """RoPE on the LAST rotary_dim features of x (B, heads, L, H): a latent layer's heads are [features
    without position | rotary features] (DeepSeek's order); the first H - rotary_dim pass through."""
    H = x.shape[-1]
    turned = rope(x[..., H - rotary_dim:], angles, rotary_dim, interleaved, attention_factor)
    return torch.cat([x[..., : H - rotary_dim], turned], dim=-1)


def join_keys(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """KEY.JOIN (latent): each head's key features from the latent, k_nope (B, K, S, H - R), then the rotary
    key every head shares, k_rope (B, 1, S, R) -> (B, K, S, H)."""
    return torch.cat([k_nope, k_rope.expand(*k_nope.shape[:3], k_rope.shape[-1])], dim=-1)


def absorb_query(q: torch.Tensor, key_kernel: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The absorbed form's query (latent): each head's features without position taken through its key
    up-projection's transpose, q_nope W_uk^T (C features), then its rotary features: (B, N, T, H) with
    key.kernel (C, K, H - R) -> (B, N, T, C + R), in compute dtype, stored. Query head n reads key head
    n // G. Then q_abs . [latent | rotary key] = q . [latent W_uk | rotary key]: the expanded logits."""
    B, N, T, H = q.shape
    C, K, _ = key_kernel.shape
    q_nope = q[..., : H - rope_dim].reshape(B, K, N // K, T, H - rope_dim)
    q_latent = _einsum("bkgth,ckh->bkgtc", q_nope, key_kernel, q.dtype).reshape(B, N, T, C)
    return torch.cat([q_latent, q[..., H - rope_dim:]], dim=-1)


def expand_values(ctx_latent: torch.Tensor, value_kernel: torch.Tensor) -> torch.Tensor:
    """The absorbed form's context (latent): each head's attention over the latent, (B, N, T, C), through
    its value up-projection (C, K, V) -> (B, N, T, V) (sum_j w_j (c_j W_uv) = (sum_j w_j c_j) W_uv)."""
    B, N, T, C = ctx_latent.shape
    K = value_kernel.shape[1]
    grouped = ctx_latent.reshape(B, K, N // K, T, C)
    return _einsum("bkgtc,ckv->bkgtv", grouped, value_kernel, ctx_latent.dtype).reshape(B, N, T, -1)


def temperature_factor(positions: torch.Tensor, beta: float, floor: float, offset: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """The query temperature's factor per query, (B|1, 1, T, 1) in compute dtype:
    1 + beta * ln(1 + floor((position + offset) / floor)). The floor of the
    quotient is taken in float64 (positions are integers: exact), the log in
    compute dtype."""
    ct = compute_dtype(dtype)
    steps = torch.floor((positions.to(torch.float64) + offset) / floor)  # (B|1, T)
    return (1 + beta * torch.log1p(steps.to(ct)))[:, None, :, None]  # a Python beta: rounded to ct by torch


def temperature(q: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """QUERY TEMPERATURE: q (B, N, T, H) times temperature_factor (after RoPE)."""
    return (q.to(factor.dtype) * factor).to(q.dtype)


def logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, N // K, T, H)  # (B, K, G, T, H)
    ct = compute_dtype(q.dtype)
    scores = torch.einsum(LOGITS, qg.to(ct), k.to(ct))  # (B, K, G, T, S)
    return (scores * scale).reshape(B, N, T, S).to(q.dtype)  # (B, N, T, S)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), after the scale and before mask and bias, so a
    masked position stays -inf (Gemma 2's attn_logit_softcapping, ONNX's softcap)."""
    ct = compute_dtype(x.dtype)
    return (torch.tanh(x.to(ct) / cap) * cap).to(x.dtype)


def alibi_bias(slopes: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
               dtype: torch.dtype, rounding: str | None = None) -> torch.Tensor:
    """ALiBi's bias in compute dtype, (B|1, N, T, S): -slope_n * |pos_q(i) - pos_k(j)|. slopes (N,),
    positions (B|1, T), key_positions (B|1, S) of every key (all_key_positions). The distance is an
    integer, exact in any compute dtype the contract uses up to 2^24; autograd gives the slopes'
    gradient through the product.
    rounding (config.alibi_bias_dtype): Falcon-RW's round(round(slope_n) * round(pos_k(j))) in that dtype;
    the roundings pass the gradient straight through (d slope_n = sum(d bias * round(pos_k)))."""
    ct = compute_dtype(dtype)
    if rounding is not None:
        r = TORCH_DTYPES[rounding]
        slope = slopes.to(ct).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
        key = key_positions.to(ct).to(r).to(ct)[:, None, None, :]  # (B|1, 1, 1, S)
        exact = slope * key  # (B|1, N, 1, S): carries the gradient
        rounded = (slope.detach().to(r).to(ct) * key).to(r).to(ct)
        bias = exact + (rounded - exact).detach()
        B = max(positions.shape[0], key_positions.shape[0])
        return bias.expand(B, -1, positions.shape[1], -1).contiguous()  # (B|1, N, T, S)
    distance = (positions[:, :, None] - key_positions[:, None, :]).abs().to(ct)  # (B|1, T, S)
    return -slopes.to(ct).reshape(1, -1, 1, 1) * distance[:, None]  # (B|1, N, T, S)


def alibi(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """ALIBI: the scaled (and softcapped) logits plus alibi_bias, before the mask (so a masked position stays
    -inf), in compute dtype, stored."""
    return (x.to(bias.dtype) + bias).to(x.dtype)


def mask(x: torch.Tensor, allowed: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Add bias, then set disallowed positions to -inf. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A select, so a masked position gets
    no gradient (as in impl_numpy/backward.py); a -inf in bias masks, so it
    joins the select (the value is -inf either way): otherwise a "nan" row
    masked by bias alone would pass its NaN to the query and key gradients."""
    if bias is not None:
        ct = compute_dtype(x.dtype)
        x = (x.to(ct) + bias).to(x.dtype)
        finite = bias > float("-inf")  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    return x


def softmax(x: torch.Tensor, masked_row: str, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN.
    sinks (N,): one logit per head that joins every row's denominator and
    attends to nothing (gpt-oss): the row's max includes it and the weights
    over S sum to less than 1; a fully masked row puts all its mass on the
    sink (weights 0, whatever masked_row says)."""
    ct = compute_dtype(x.dtype)
    xc = x.to(ct)
    row_max = xc.amax(dim=-1, keepdim=True).detach()  # (B, N, T, 1); a shift, not a function of x
    sink = None if sinks is None else sinks.to(ct).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
    if sink is not None:
        row_max = torch.maximum(row_max, sink.detach())
    empty = row_max == float("-inf")  # never with sinks (they are finite)
    shift = torch.where(empty, 0.0, row_max)
    e = torch.exp(xc - shift)  # masked -> exactly 0
    total = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - shift)
    w = e / torch.where(empty, 1.0, total)  # an empty row is all 0 here: "zero" done
    if masked_row == "uniform":
        w = torch.where(empty, 1.0 / x.shape[-1], w)
    elif masked_row == "nan":
        w = w * torch.where(empty, float("nan"), 1.0)  # NaN in the gradient too, as the reference VJP
    return w.to(x.dtype)


def dropout(w: torch.Tensor, keep: torch.Tensor | None, rate: float) -> torch.Tensor:
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    ct = compute_dtype(w.dtype)
    return torch.where(keep, w.to(ct) / (1.0 - rate), 0.0).to(w.dtype)


def attend(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = w.shape
    K = v.shape[1]
    wg = w.reshape(B, K, N // K, T, S)  # (B, K, G, T, S)
    return _einsum(ATTEND, wg, v, w.dtype).reshape(B, N, T, v.shape[-1])  # (B, N, T, V)


def gate_project(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GATE.PROJECT: the query input (B, T, D) times gate.kernel (D, N, V) or (D, N) -> (B, T, N*V) or (B, T, N)."""
    return project(x, kernel, bias)


def gate(ctx: torch.Tensor, gate_logits: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GATE: the context (B, N, T, V) times sigmoid of gate.project's logits, (B, T, N*V) per element or
    (B, T, N) per head; in compute dtype, stored."""
    ct = compute_dtype(ctx.dtype)
    B, N, T, V = ctx.shape
    g = gate_logits.to(ct).reshape(B, T, num_heads, -1).transpose(1, 2)  # (B, N, T, V|1)
    return (ctx.to(ct) * torch.sigmoid(g)).to(ctx.dtype)


# -- differential attention (config.differential: diffllama) ------------------------

def value_pair(v: torch.Tensor) -> torch.Tensor:
    """VALUE.PAIR: v (B, K, S, V) -> (B, K, S, 2V), kv head g's value joined with its pair's: [v_g' | v_{g'+K/2}],
    g' = g mod K/2."""
    half = v.shape[1] // 2
    joined = torch.cat([v[:, :half], v[:, half:]], dim=-1)  # (B, K/2, S, 2V)
    return torch.cat([joined, joined], dim=1)  # (B, K, S, 2V)


def differential_lambda(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor,
                        lambda_init: float, dtype: torch.dtype) -> torch.Tensor:
    """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init: a 0-d tensor in compute
    dtype."""
    ct = compute_dtype(dtype)
    one = torch.exp((lq1.to(ct) * lk1.to(ct)).sum())
    two = torch.exp((lq2.to(ct) * lk2.to(ct)).sum())
    return one - two + lambda_init


def differential(ctx: torch.Tensor, lam: torch.Tensor, lambda_init: float, eps: float) -> torch.Tensor:
    """DIFFERENTIAL: ctx (B, N, T, 2V) -> (B, N/2, T, 2V): head n's minus lambda times head n + N/2's, an RMS norm
    over the 2V features (no weight, eps inside the root), times (1 - lambda_init); in compute dtype, stored."""
    ct = compute_dtype(ctx.dtype)
    half = ctx.shape[1] // 2
    c = ctx.to(ct)
    d = c[:, :half] - lam.to(ct) * c[:, half:]  # (B, N/2, T, 2V)
    y = d / torch.sqrt((d * d).mean(dim=-1, keepdim=True) + eps) * (1 - lambda_init)
    return y.to(ctx.dtype)


def differential_stage(config, params: dict, ctx: torch.Tensor) -> torch.Tensor:
    """The differential stage of a call: differential_lambda from params' differential.lambda_* and the config's
    lambda_init, then differential."""
    d = config.differential
    lam = differential_lambda(*(params[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")), d.lambda_init,
                              ctx.dtype)
    return differential(ctx, lam, d.lambda_init, d.eps)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = x.shape
    return x.transpose(1, 2).reshape(B, T, N * V)  # (B, T, N*V)


def output(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O)."""
    y = _einsum(OUTPUT, x, kernel.reshape(-1, kernel.shape[-1]), x.dtype)  # (B, T, O)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = y.to(ct).add_(bias.to(ct)).to(x.dtype)  # in place, as in project
    return y


# `mask` is both a stage and an argument name; callers use this alias.
mask_stage = mask


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape: tuple[int, ...], rate: float, seed: int, device: torch.device) -> torch.Tensor:
    """torch's own seeded keep-mask. Seeds are per framework: for the same
    dropout across frameworks pass an explicit dropout_mask instead."""
    generator = torch.Generator(device=device).manual_seed(int(seed))
    return torch.rand(shape, generator=generator, device=device) >= rate


def allowed_mask(mask4: torch.Tensor | None, T: int, S: int, is_causal: bool, causal_alignment: str, *,
                 window_left: int = -1, window_right: int = -1, segment_ids=None, key_segment_ids=None,
                 local_chunk: int | None = None, positions=None, key_positions=None,
                 device=None) -> torch.Tensor | None:
    """mask AND causal AND window AND local chunks AND segments, rank 4, broadcastable to (B, N,
    T, S) (S: every key, the cache's included); None if none applies. local_chunk reads positions
    (B|1, T) and every key's key_positions (B|1, S)."""
    allowed = mask4

    def both(extra):
        return extra if allowed is None else allowed & extra

    if is_causal:
        allowed = both(causal_mask(T, S, causal_alignment, device=device)[None, None])  # (1, 1, T, S)
    if window_left >= 0 or window_right >= 0:
        allowed = both(window_mask(T, S, window_left, window_right, causal_alignment, device=device)[None, None])
    if local_chunk is not None:
        allowed = both(chunk_mask(positions, key_positions, local_chunk))  # (B|1, 1, T, S)
    if segment_ids is not None:
        allowed = both(segment_mask(segment_ids, key_segment_ids))  # (B|1, 1, T, S)
    return allowed


def selection_mask(topk_indices: torch.Tensor, num_heads: int, S: int) -> torch.Tensor:
    """impl_numpy's selection_mask: topk_indices (B, T, k) or (B, K, T, k) -> bool (B, 1|N, T, S), -1 selecting
    nothing (a scatter into a spare column S, dropped), kv head K's selection for its G query heads."""
    idx = topk_indices.to(torch.int64)
    idx = idx[:, None] if idx.dim() == 3 else idx  # (B, K|1, T, k)
    B, K, T, _ = idx.shape
    selected = torch.zeros((B, K, T, S + 1), dtype=torch.bool, device=idx.device)
    selected.scatter_(-1, torch.where(idx < 0, torch.full_like(idx, S), idx), True)
    selected = selected[..., :S]
    return selected if K == 1 else selected.repeat_interleave(num_heads // K, dim=1)  # (B, 1|N, T, S)


def all_key_positions(key_positions: torch.Tensor, P: int, past_key_positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Every key's position, (B|1, P+S): the cache's keys at past_key_positions (B|1, P) (default 0..P-1),
    then the new keys' key_positions (B|1, S)."""
    if key_positions.ndim == 3:  # multimodal RoPE's, one per pair (mrope_positions): no stage but RoPE reads them
        return None
    if not P:
        return key_positions
    cached = (torch.arange(P, dtype=torch.int64, device=key_positions.device)[None] if past_key_positions is None
              else past_key_positions)  # (B|1, P)
    B = max(cached.shape[0], key_positions.shape[0])
    return torch.cat([cached.expand(B, P), key_positions.expand(B, key_positions.shape[1])], dim=1)


def temperature_positions(positions: torch.Tensor, source: str, P: int, T: int) -> torch.Tensor:
    """The positions a query temperature reads, (B|1, T): the queries' positions ("positions"), or their
    index in the cache, P + arange(T) ("cache_index": transformers' Llama 4, left pads counted)."""
    if source == "positions":
        return positions
    return (P + torch.arange(T, dtype=torch.int64, device=positions.device))[None]


def default_positions(positions: torch.Tensor | None, P: int, L: int, device=None) -> torch.Tensor:
    """(B|1, L) int64: the given positions ((L,) or (B, L)), or P + arange(L)
    (the cache's length P offsets new tokens)."""
    if positions is None:
        return (P + torch.arange(L, dtype=torch.int64, device=device))[None]  # (1, L)
    positions = positions.to(device=device, dtype=torch.int64)
    return positions[None] if positions.ndim == 1 else positions  # (B|1, L)




# -- issue 42: the key multiplier and the value scale (mirrors impl_numpy/functional.py) ---------------

def multiply(x: torch.Tensor, factor: float) -> torch.Tensor:
    """KEY MULTIPLIER / VALUE SCALE: a projection (B, L, F) times a config number, in compute dtype."""
    ct = compute_dtype(x.dtype)
    return (x.to(ct) * factor).to(x.dtype)


def mrope_positions(positions: torch.Tensor | None, P: int, L: int, axes, device=None) -> torch.Tensor:
    """Multimodal RoPE: each rotating pair's position, (B|1, L, R/2) int64. positions (3, L) or (3, B, L):
    the temporal, height and width rows (default: P + arange(L) on all three, a text token's); axes (R/2,)
    the axis that turns each pair (weights.rope.mrope_axes, a NumPy array)."""
    if positions is None:
        positions = (P + torch.arange(L, dtype=torch.int64, device=device))[None, None].expand(3, 1, L)  # (3, 1, L)
    positions = positions.to(device=device, dtype=torch.int64)
    positions = positions[:, None] if positions.ndim == 2 else positions  # (3, B|1, L)
    return positions[torch.as_tensor(axes, device=positions.device)].permute(1, 2, 0)  # (B|1, L, R/2)
