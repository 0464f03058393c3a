"""Hand-written vector-Jacobian product of multi_head_attention.

Given the output cotangent d_output (B, T, O), returns the gradient of
sum(output * d_output) with respect to query, key, value (those passed) and
every canonical tensor (and past_key / past_value when a cache is given).
It walks functional.py's stages in reverse; each block names the stage it
undoes: output, merge_heads, gate, attend, dropout, softmax (and sinks), mask,
alibi, softcap, logits, the cache's split, temperature, rope, split_heads,
norm, clip, project. Checked against finite differences in
float64 (tests/test_numpy_backward.py).

Precision follows the forward rule: each backward stage's result is stored in
the storage dtype and its arithmetic runs in compute dtype (float32 for 16-bit
storage), as autodiff in the frameworks does. Where a key defaults to the query (self
attention), the key and value gradients are folded into "query".

`gradient_magnitudes` runs the same backward pass on absolute values (every
difference turned into a sum, the softmax weights kept): the size of the
terms each gradient element is summed from. Rounding errors are proportional
to that, not to the gradient, which can cancel to nearly nothing (the key
bias gradient is exactly zero); the tolerance policy scales by it. It runs and
stores in float64 whatever the call's dtype: sizes are never rounded.
"""

from __future__ import annotations

import numpy as np

from weights import compute_dtype, dtype_from_name
from weights.config import QKNorm

from . import functional as F
from .attention import prepare


def _grouped(x, K):  # (B, N, T, X) -> (B, K, G*T, X)
    B, N, T, X = x.shape
    return x.reshape(B, K, (N // K) * T, X)


def _merge(x):  # (B, heads, L, X) -> (B, L, heads*X): split_heads undone
    B, n, L, X = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, n * X)


def _norm_parts(x, kind, eps, heads, scope, ct):
    """norm's forward pieces in compute dtype: x (B, L, F) -> xhat (B, L, groups, W), r (B, L, groups, 1)."""
    B, L, F = x.shape
    width = F // heads if scope == "head" else F
    y = x.astype(ct).reshape(B, L, F // width, width)
    if kind == "layer":
        y = y - y.mean(axis=-1, keepdims=True)
    r = 1 / np.sqrt((y * y).mean(axis=-1, keepdims=True) + ct.type(eps))
    return y * r, r


def _sink_weight(x: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """The weight functional.softmax gives each row's sink, (B, N, T, 1) in
    compute dtype: exp(sink - max) over the same denominator as softmax's. (As
    1 - sum(w) it would cancel to 0 in float32 once the sink's share falls
    below float32's unit round-off, as it does beside a logit of 23.)"""
    ct = compute_dtype(x.dtype)
    sink = sinks.astype(ct).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
    row_max = np.maximum(x.max(axis=-1, keepdims=True).astype(ct), sink)  # finite: the sink is
    e_sink = np.exp(sink - row_max)  # (B, N, T, 1)
    return e_sink / (np.exp(np.subtract(x, row_max, dtype=ct)).sum(axis=-1, keepdims=True) + e_sink)


def _rope_pair(x, R, interleaved):
    return (x[..., 0:R:2], x[..., 1:R:2]) if interleaved else (x[..., : R // 2], x[..., R // 2: R])


def _rope_join(y1, y2, rest, interleaved):
    turned = np.stack([y1, y2], axis=-1).reshape(*y1.shape[:-1], 2 * y1.shape[-1]) if interleaved else np.concatenate([y1, y2], -1)
    return np.concatenate([turned, rest], axis=-1)


def _backward(config, call, d_out, is_causal, causal_alignment, *, magnitude=False, true_forward=None,
              chunked_core=False, fold_scale=False):
    """The forward pass kept for backward, then the backward pass. Returns
    (out, w, wd, kept, grads).

    chunked_core=True: the chunked core's precision (chunked.py, and the mirrors' chunked cores that autodiff
    differentiates): the logits round as the stages' do, but the softmax's weights, dropout, the attend's
    product and its cotangent stay in the compute dtype; the context is stored, and the logits' cotangent
    as the mask stage's. In float32/float64 it is the stages' pass.

    fold_scale=True: the scale folded into the query before the logits' product, both stored in the storage
    dtype (q_s = round(q * round(scale)), logits = q_s k^T), as a fused kernel computing in the inputs' dtype
    does (MLX's mx.fast.scaled_dot_product_attention on CPU: mlx/fast.cpp's fallback multiplies q by
    array(scale, q.dtype()) first): one more 16-bit rounding of every logit's terms. ALiBi's bias then joins
    the logits rounded to the storage dtype itself, as a fused kernel takes it: its additive mask in the
    inputs' dtype (MLX's must promote to the output type; impl_torch's SDPA attn_mask is in the query's):
    rounded once more where |bias| is large (random_long_2200020: bfloat16, ALiBi over 1038 keys, MLX's
    fused output 0.0747 from float64, this order's 0.0747, the stages' 0.0081). With chunked_core and
    fold_scale false it is the stages' pass; neither changes a float32/float64 result by more than round-off.

    magnitude=True: inputs, tensors and d_out are replaced by their absolute
    values, every difference in the backward by a sum, and the nonlinear
    stages' factors (softmax weights, the norm's 1/rms and normalised x,
    cos/sin, softcap's slope) taken from the true forward (true_forward: the
    first call's `kept`) as magnitudes."""
    N, K, H, V, O = config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim, config.out_dim
    B_, T_ = call.query.shape[:2]
    dtype = call.dtype
    ct = compute_dtype(dtype)
    P = call.shapes.P
    scale = config.effective_scale
    p = call.params
    xq, xk, xv = call.query, call.key, call.value
    past_key, past_value = call.past_key, call.past_value

    def mm(a, b):  # a matmul: accumulate in compute dtype, store in dtype
        return np.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False)).astype(dtype, copy=False)

    def ein(spec, a, b):
        return np.einsum(spec, a.astype(ct, copy=False), b.astype(ct, copy=False)).astype(dtype, copy=False)

    def ew(a):  # an elementwise result, stored
        return a.astype(dtype, copy=False)

    norm_cfg, rope_cfg, cap = config.qk_norm, config.rope, config.logit_softcap
    if magnitude:
        # Sizes, not a backend's rounding: the pass runs and stores in float64 whatever the call's dtype (a
        # 16-bit call's pass is the clip gate as 16 bits see it, compare.expected_for). Stored in float16,
        # terms that a norm's 1/sqrt(eps) enlarges passed 65504 and came back inf, which the policy reads as
        # no terms at all: random_1475876 (a LayerNorm of head_dim 1 after qkv_clip) judged its float16 key
        # norm's bias gradient, rounding noise of an exact 0, against an allowance of 0.
        dtype = ct = np.dtype(np.float64)
        kept = true_forward

        def wide(a):
            return None if a is None else np.abs(np.asarray(a, dtype=np.float64))
        p = {name: wide(t) for name, t in p.items()}
        xq, xk, xv, d_out, scale = wide(xq), wide(xk), wide(xv), wide(d_out), abs(float(scale))
        past_key, past_value = wide(past_key), wide(past_value)
    else:
        kept = {}
    def per_feature(t, cfg):  # a norm tensor on xhat (B, L, groups, W): (W,) / (heads, W) per head, (F,) over all
        return t.astype(ct).reshape(-1) if cfg.scope == "all" else t.astype(ct)

    # In magnitude mode a "layer" norm's xhat counts the terms of its centring, as every other difference of
    # this pass: (|x| + |mean(x)|) r of the true forward, not |x - mean(x)| r. A row that is constant up to
    # rounding (every value clipped to c) centres to pure rounding noise, 1e-17 in float64 and another noise in
    # float32, times r = 1 / sqrt(eps): its |xhat| allowed nothing of it (the sweep's random_1454684: a value
    # norm after qkv_clip, grad output.kernel expected 9e-14 against terms of 8e-19). "rms" has no difference.
    def norm_forward(name, x, heads, cfg):  # functional.norm, its pieces kept for norm_back
        if not magnitude:
            kept[name + ".norm"] = _norm_parts(x, cfg.type, cfg.eps, heads, cfg.scope, ct)
            if cfg.type == "layer":
                xhat, r = kept[name + ".norm"]
                y = x.astype(ct).reshape(xhat.shape)
                kept[name + ".norm.terms"] = (np.abs(y) + np.abs(y.mean(axis=-1, keepdims=True))) * r
        xhat, _ = kept[name + ".norm"]
        y = kept.get(name + ".norm.terms", np.abs(xhat)) if magnitude else xhat
        if name + ".norm.scale" in p:
            y = y * per_feature(p[name + ".norm.scale"], cfg)
        if name + ".norm.bias" in p:
            y = y + per_feature(p[name + ".norm.bias"], cfg)
        return ew(y.reshape(x.shape))

    def keep_rope_tables():  # cos and sin (times the attention factor) of the queries' and the new keys' angles
        inv_freq, factor = call.rope_tables(config)
        for name, positions in (("query", call.positions), ("key", call.key_positions)):
            angles = F.rope_angles(positions, inv_freq, dtype)
            kept[name + ".rope"] = (np.cos(angles) * ct.type(factor), np.sin(angles) * ct.type(factor))

    def rope_abs(x, cs):  # rope in magnitude mode: every difference a sum, |cos| and |sin|
        R_, inter_ = rope_cfg.rotary_dim, rope_cfg.interleaved
        c, s_ = np.abs(cs[0]), np.abs(cs[1])
        x1, x2 = _rope_pair(x.astype(ct), R_, inter_)
        return ew(_rope_join(x1 * c + x2 * s_, x2 * c + x1 * s_, x[..., R_:].astype(ct), inter_))

    latent = config.latent
    if latent is not None:  # latent.py's expanded form
        C, R, inter = latent.kv_rank, latent.rope_dim, rope_cfg.interleaved
        rms = QKNorm(type="rms", eps=latent.eps)  # the latent norms: RMS over the whole width (one group)
        if latent.query_rank is not None:
            qd = F.project(xq, p["query.down.kernel"], p.get("query.down.bias"))  # (B, T, Qr)
            qdn = norm_forward("query.down", qd, 1, rms)  # (B, T, Qr): the up-projection's input
            qp = F.project(qdn, p["query.kernel"], None)
        else:
            qp = F.project(xq, p["query.kernel"], p.get("query.bias"))  # (B, T, N*H)
        both = F.project(xk, p["latent.kernel"], p.get("latent.bias"))  # (B, S, C+R)
        c_new = norm_forward("latent", both[..., :C], 1, rms)  # (B, S, C)
        q, r_new = F.split_heads(qp, N), F.split_heads(np.ascontiguousarray(both[..., C:]), 1)  # (B, 1, S, R)
        if not magnitude:
            keep_rope_tables()
            inv_freq, factor = call.rope_tables(config)
            q = F.rope_last(q, F.rope_angles(call.positions, inv_freq, dtype), R, inter, factor)
            r_new = F.rope(r_new, F.rope_angles(call.key_positions, inv_freq, dtype), R, inter, factor)
        else:
            q = np.concatenate([q[..., : H - R], rope_abs(q[..., H - R:], kept["query.rope"])], axis=-1)
            r_new = rope_abs(r_new, kept["key.rope"])
        c_all = F.split_heads(c_new, 1) if past_key is None else np.concatenate([past_key, F.split_heads(c_new, 1)], 2)
        r_all = r_new if past_value is None else np.concatenate([past_value, r_new], axis=2)  # (B, 1, S_total, R)
        k_nope = F.split_heads(F.project(c_all[:, 0], p["key.kernel"], None), K)  # (B, K, S_total, H-R)
        v = F.split_heads(F.project(c_all[:, 0], p["value.kernel"], None), K)  # (B, K, S_total, V)
        k = F.join_keys(k_nope, r_all)  # (B, K, S_total, H)
    else:
        qp = F.project(xq, p["query.kernel"], p.get("query.bias"))  # (B, T, N*H)
        shared = config.kv_shared  # issue 42: k and v are the cache's last S entries (attention.share_cache)
        if shared:  # as (B, S, K*H|V), the form the stages below take; no clip, norm, rope or multiplier on them
            kp, vp = (_merge(wide(x) if magnitude else x) for x in (call.shared_key, call.shared_value))
        else:
            kp = F.project(xk, p["key.kernel"], p.get("key.bias"))  # (B, S, K*H)
            vp = F.project(xv, p["value.kernel"], p.get("value.bias"))  # (B, S, K*V)
        clip = config.qkv_clip
        if clip is not None:  # clip: the values inside [-c, c] pass (and their gradient); the rest are c
            if not magnitude:
                kept["clip"] = tuple(np.abs(y) <= F.clip_bound(clip, y.dtype) for y in (qp, kp, vp))
                qp, kp, vp = (F.clip(y, clip) for y in (qp, kp, vp))
            else:  # a clipped value's magnitude is c's (exact: no terms)
                qp, kp, vp = (ew(np.where(inside, y, ct.type(clip))) for y, inside in zip((qp, kp, vp), kept["clip"]))
        qn, kn = qp, kp
        if norm_cfg is not None and not norm_cfg.after_rope:
            qn, kn = norm_forward("query", qp, N, norm_cfg), kp if shared else norm_forward("key", kp, K, norm_cfg)
        if config.value_norm is not None:
            vp = norm_forward("value", vp, K, config.value_norm)
        km, vs = config.key_multiplier, config.value_scale  # functional.multiply (magnitudes: |factor|)
        if km != 1.0:
            kn = F.multiply(kn, abs(km) if magnitude else km)
        if vs != 1.0:
            vp = F.multiply(vp, abs(vs) if magnitude else vs)
        q, k_new, v_new = F.split_heads(qn, N), F.split_heads(kn, K), F.split_heads(vp, K)
        if rope_cfg is not None:
            R, inter = rope_cfg.rotary_dim, rope_cfg.interleaved
            if not magnitude:
                inv_freq, factor = call.rope_tables(config)
                for name, positions in (("query", call.positions), ("key", call.key_positions)):
                    angles = F.rope_angles(positions, inv_freq, dtype)
                    kept[name + ".rope"] = (np.cos(angles) * ct.type(factor), np.sin(angles) * ct.type(factor))
                q, k_new = (F.rope(x, F.rope_angles(pos, inv_freq, dtype), R, inter, factor) if x is q or not shared
                            else x for x, pos in ((q, call.positions), (k_new, call.key_positions)))
            else:
                q = rope_abs(q, kept["query.rope"])
                k_new = k_new if shared else rope_abs(k_new, kept["key.rope"])
        if norm_cfg is not None and norm_cfg.after_rope:  # the norm of the turned q and k (functional.norm_heads)
            q = F.split_heads(norm_forward("query", _merge(q), N, norm_cfg), N)
            k_new = F.split_heads(norm_forward("key", _merge(k_new), K, norm_cfg), K)
        k = k_new if past_key is None else np.concatenate([past_key, k_new], axis=2)  # (B, K, S_total, H)
        v = v_new if past_value is None else np.concatenate([past_value, v_new], axis=2)  # (B, K, S_total, V)
    temp = config.query_temperature
    if temp is not None:  # q times the temperature factor per query (positive or not: its magnitude in magnitude mode)
        if not magnitude:
            kept["temperature"] = F.temperature_factor(call.temperature_positions(config), temp.beta, temp.floor,
                                                       temp.offset, dtype)
        factor = kept["temperature"]
        q = F.temperature(q, np.abs(factor) if magnitude else factor)
    if not magnitude:
        allowed = call.allowed(config, is_causal, causal_alignment)
        if fold_scale:  # the scale (rounded) folded into the stored query, the product unscaled
            folded = ct.type(dtype.type(scale))
            kept["q_scaled"] = ew(q.astype(ct) * folded)
            x0 = F.logits(kept["q_scaled"], k, 1.0)
        else:
            x0 = F.logits(q, k, scale)  # (B, N, T, S_total)
        xc = F.softcap(x0, cap) if cap is not None else x0
        if config.alibi:
            alibi = call.alibi_bias(config)
            if fold_scale:  # a fused kernel's additive mask is in the inputs' dtype: ALiBi's bias rounded first
                alibi = alibi.astype(dtype).astype(alibi.dtype)
            xc = F.alibi(xc, alibi)
        x = F.mask(xc, allowed, call.bias4)
        # (chunked_core: the softmax of the stored logits, kept in compute dtype)
        w = F.softmax(x.astype(ct) if chunked_core else x, config.masked_row, p.get("sinks"))  # (B, N, T, S_total)
        wd = F.dropout(w, call.keep, config.dropout)
        kept.update(x0=x0, x=x, w=w, wd=wd)
    x0, x, w, wd = kept["x0"], kept["x"], kept["w"], kept["wd"]
    dif = config.differential
    if dif is not None:  # value.pair: each kv head's value joined with its pair's (undone after attend's backward)
        v = F.value_pair(v)  # (B, K, S_total, 2V)
    ctx_heads = F.attend(wd, v)  # (B, N, T, V)
    if chunked_core:  # attend in compute dtype (wd is), the context stored
        ctx_heads = ew(ctx_heads)
    if dif is not None:  # differential: its pieces kept (the true forward's in magnitude mode)
        ctx_pre = ctx_heads  # (B, N, T, 2V)
        ctx_heads = _differential_forward(config, p, ctx_pre, kept, magnitude, ct)  # (B, N/2, T, 2V)
    gate_cfg = config.output_gate
    if gate_cfg is not None:  # the gate: sigmoid(x_q Wg + bg), the true forward's in magnitude mode
        if not magnitude:
            gl = F.gate_project(xq, p["gate.kernel"], p.get("gate.bias"))  # (B, T, N*V | N)
            kept["gate"] = 1 / (1 + np.exp(-gl.astype(ct).reshape(B_, T_, N, -1).transpose(0, 2, 1, 3)))
        g = kept["gate"]  # (B, N, T, V|1), compute dtype
        ctx_pre = ctx_heads
        ctx_heads = ew(ctx_pre.astype(ct) * g)
    ctx = F.merge_heads(ctx_heads)  # (B, T, N*V)
    out = F.output(ctx, p["output.kernel"], p.get("output.bias"))
    B, T, S_total = xq.shape[0], xq.shape[1], k.shape[2]

    grads: dict[str, np.ndarray] = {}
    # output: out = ctx @ Wo + bo
    Wo = p["output.kernel"].reshape(N * V, O)
    grads["output.kernel"] = ein("BTF,BTO->FO", ctx, d_out).reshape(N, V, O)
    if config.use_output_bias:
        grads["output.bias"] = ew(d_out.astype(ct).sum(axis=(0, 1)))
    d_ctx = mm(d_out, Wo.T)  # (B, T, N*V)
    # merge_heads
    if dif is not None:  # merge_heads of (B, N/2, T, 2V), then differential undone: (B, N, T, 2V)
        d_ctx = _differential_back(config, p, d_ctx.reshape(B, T, N // 2, 2 * V).transpose(0, 2, 1, 3), ctx_pre,
                                   kept, magnitude, ct, grads)
    else:
        d_ctx = d_ctx.reshape(B, T, N, V).transpose(0, 2, 1, 3)  # (B, N, T, V)
    d_gate_input = None
    if gate_cfg is not None:
        # gate: ctx = ctx_pre * g, g = sigmoid(l): d ctx_pre = d ctx * g; d l = sum_V(d ctx * ctx_pre) * g (1 - g)
        dc = d_ctx.astype(ct)
        d_g = dc * ctx_pre.astype(ct)  # (B, N, T, V)
        if gate_cfg.scope == "head":
            d_g = d_g.sum(axis=-1, keepdims=True)  # (B, N, T, 1)
        d_l = ew(d_g * g * (1 - g)).transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B, T, N*V | N)
        Wg = p["gate.kernel"]
        grads["gate.kernel"] = ein("BLD,BLF->DF", xq, d_l).reshape(Wg.shape)
        if "gate.bias" in p:
            grads["gate.bias"] = ew(d_l.astype(ct).sum(axis=(0, 1))).reshape(p["gate.bias"].shape)
        d_gate_input = mm(d_l, Wg.reshape(Wg.shape[0], -1).T)  # (B, T, D): the query input's share
        d_ctx = ew(dc * g)
    # attend: ctx = wd @ v (grouped)
    if chunked_core:  # the weights' cotangent in compute dtype, not stored
        d_wd = np.matmul(_grouped(d_ctx, K).astype(ct), v.swapaxes(-1, -2).astype(ct)).reshape(B, N, T, S_total)
    else:
        d_wd = mm(_grouped(d_ctx, K), v.swapaxes(-1, -2)).reshape(B, N, T, S_total)
    d_v = mm(_grouped(wd, K).swapaxes(-1, -2), _grouped(d_ctx, K))  # (B, K, S_total, V)
    if dif is not None:  # value.pair undone: each half of a pair's gradient to its own kv head, both copies summed
        d_v = _value_pair_back(d_v, ct, dtype)  # (B, K, S_total, V)
    # dropout
    keep = call.keep
    d_w = d_wd if keep is None else np.where(keep, d_wd.astype(ct) / ct.type(1.0 - config.dropout), 0)
    d_w = d_w if chunked_core else ew(d_w)
    # softmax: dx = w * (dw - sum(dw * w)), in compute dtype like the forward.
    # A fully masked row's weights do not depend on its logits under "zero" and
    # "uniform" (gradient 0); under "nan" they are NaN (see the mask stage).
    # Sinks: the sink is one more logit whose weight w_sink (_sink_weight,
    # the forward's own exp(sink - max) / total) feeds nothing, so d_sink =
    # -w_sink * sum(dw * w), summed over rows.
    wc, dwc = w.astype(ct), d_w.astype(ct)
    row = (dwc * wc).sum(axis=-1, keepdims=True)  # (B, N, T, 1)
    d_x = wc * (dwc + row if magnitude else dwc - row)
    if config.masked_row == "uniform" and not config.use_sinks:
        d_x = np.where(np.isfinite(x).any(axis=-1, keepdims=True), d_x, 0)
    if config.use_sinks:
        w_sink = _sink_weight(x, p["sinks"])  # (B, N, T, 1)
        d_sink = w_sink * row
        grads["sinks"] = ew((d_sink if magnitude else -d_sink).sum(axis=(0, 2, 3)))  # (N,)
    # mask: identity on allowed positions; a masked (-inf) position gets no
    # gradient, as autodiff of a `where` gives: so a "nan" row's NaN weights
    # reach the value gradient only, not the query and key gradients.
    d_x = ew(np.where(x == -np.inf, 0, d_x))
    # alibi: x + bias, bias = -slope_n * distance: the logits pass d_x on; d slope_n = -sum(d_x * distance)
    if config.alibi and config.alibi_bias_dtype is not None:  # bias = round(round(slope_n) * round(pos_k)): the
        # roundings pass the gradient straight through (as the mirrors' stop_gradient form does): d slope_n =
        # sum(d_x * round(pos_k))
        key = call.every_key_position.astype(ct).astype(dtype_from_name(config.alibi_bias_dtype)).astype(ct)
        d_slope = (d_x.astype(ct) * (np.abs(key) if magnitude else key)[:, None, None, :]).sum(axis=(0, 2, 3))
        grads["alibi.slopes"] = ew(d_slope)
    elif config.alibi:
        distance = np.abs(call.positions[:, :, None] - call.every_key_position[:, None, :]).astype(ct)[:, None]
        d_slope = (d_x.astype(ct) * distance).sum(axis=(0, 2, 3))  # (N,)
        grads["alibi.slopes"] = ew(d_slope if magnitude else -d_slope)
    # softcap: d/dx c tanh(x / c) = 1 - tanh(x / c)^2; in magnitude mode 1 + t^2, the sum of the two terms the
    # slope is the difference of: near saturation (|x| >> c) 1 - t*t cancels, and its rounding (about u, every
    # framework's tanh backward computes it so) dwarfs the slope itself (random_case(981596): float32, cap 1,
    # logits up to 190; docs/conformance.md)
    if cap is not None:
        t = np.tanh(x0.astype(ct) / ct.type(cap))
        d_x = ew(d_x.astype(ct) * ((1 + t * t) if magnitude else (1 - t * t)))
    # logits: x = scale * q k^T (grouped)
    if fold_scale and not magnitude:  # logits = q_s k^T, q_s = q * scale: d q_s = d_x k, d q = scale d q_s
        d_s = _grouped(d_x, K)  # (B, K, G*T, S_total)
        d_q = ew(mm(d_s, k).astype(ct) * ct.type(dtype.type(scale))).reshape(B, N, T, H)
        d_k = mm(d_s.swapaxes(-1, -2), kept["q_scaled"].reshape(B, K, -1, H))  # (B, K, S_total, H)
    else:
        d_s = _grouped(ew(d_x.astype(ct) * ct.type(scale)), K)  # (B, K, G*T, S_total)
        d_q = mm(d_s, k).reshape(B, N, T, H)
        d_k = mm(d_s.swapaxes(-1, -2), q.reshape(B, K, -1, H))  # (B, K, S_total, H)
    # norm: y = xhat g + b, xhat = (x - mean) r (layer) or x r (rms), r = 1 / sqrt(mean(.^2) + eps):
    # dx = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), without the mean(dxhat) term for rms.
    def norm_back(name, dy, cfg):
        xhat, r = kept[name + ".norm"]
        if magnitude:
            xhat = kept.get(name + ".norm.terms", np.abs(xhat))  # the size of xhat's terms (norm_forward)
        dyc = dy.astype(ct).reshape(xhat.shape)  # (B, L, groups, W)
        dxhat = dyc
        if name + ".norm.scale" in p:
            scale_shape = p[name + ".norm.scale"].shape
            grads[name + ".norm.scale"] = ew((dyc * xhat).reshape(-1, *scale_shape).sum(axis=0))
            if name + ".norm.bias" in p:
                grads[name + ".norm.bias"] = ew(dyc.reshape(-1, *scale_shape).sum(axis=0))
            dxhat = dyc * per_feature(p[name + ".norm.scale"], cfg)
        inner = xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
        if cfg.type == "layer":
            inner = inner + dxhat.mean(axis=-1, keepdims=True)
        return ew((r * (dxhat + inner if magnitude else dxhat - inner)).reshape(dy.shape))

    # project: y = x @ W + b
    def project_back(prefix, x_in, d_flat):
        W = p[f"{prefix}.kernel"]
        grads[f"{prefix}.kernel"] = ein("BLD,BLF->DF", x_in, d_flat).reshape(W.shape)
        if f"{prefix}.bias" in p:
            grads[f"{prefix}.bias"] = ew(d_flat.astype(ct).sum(axis=(0, 1))).reshape(p[f"{prefix}.bias"].shape)
        return mm(d_flat, W.reshape(W.shape[0], -1).T)  # (B, L, D)

    # rope: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), so dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s
    def rope_back(dy, cs):
        R_, inter_ = rope_cfg.rotary_dim, rope_cfg.interleaved
        c, s_ = (np.abs(cs[0]), np.abs(cs[1])) if magnitude else cs
        dy1, dy2 = _rope_pair(dy.astype(ct), R_, inter_)
        dx2 = dy2 * c + dy1 * s_ if magnitude else dy2 * c - dy1 * s_
        return ew(_rope_join(dy1 * c + dy2 * s_, dx2, dy[..., R_:].astype(ct), inter_))

    # temperature: q_t = q_r * factor (after rope), so d q_r = d q_t * factor
    if latent is None and temp is not None:
        d_q = ew(d_q.astype(ct) * (np.abs(kept["temperature"]) if magnitude else kept["temperature"]))
    if latent is not None:
        # key.join: each head's nope part goes to its up-projection, the rotary part (shared) sums over heads
        d_k_nope, d_r_all = _merge(d_k[..., : H - R]), d_k[..., H - R:].astype(ct).sum(axis=1, keepdims=True)
        d_v = _merge(d_v)  # (B, S_total, K*V)
        c_flat = c_all[:, 0]  # (B, S_total, C)
        grads["key.kernel"] = ein("BLD,BLF->DF", c_flat, d_k_nope).reshape(p["key.kernel"].shape)
        grads["value.kernel"] = ein("BLD,BLF->DF", c_flat, d_v).reshape(p["value.kernel"].shape)
        d_c_all = ew(mm(d_k_nope, p["key.kernel"].reshape(C, -1).T).astype(ct)
                     + mm(d_v, p["value.kernel"].reshape(C, -1).T).astype(ct))  # (B, S_total, C)
        d_r_all = ew(d_r_all)  # (B, 1, S_total, R)
        if P:  # the cache: the latent and the rotary key
            grads["past_key"], d_c = d_c_all[:, None, :P], d_c_all[:, P:]
            grads["past_value"], d_r = d_r_all[:, :, :P], d_r_all[:, :, P:]
        else:
            d_c, d_r = d_c_all, d_r_all
        if temp is not None:
            d_q = ew(d_q.astype(ct) * (np.abs(kept["temperature"]) if magnitude else kept["temperature"]))
        d_q = np.concatenate([d_q[..., : H - R], rope_back(d_q[..., H - R:], kept["query.rope"])], axis=-1)
        d_r = rope_back(d_r, kept["key.rope"])  # (B, 1, S, R)
        d_latent = np.concatenate([norm_back("latent", d_c, rms), d_r[:, 0]], axis=-1)  # (B, S, C+R)
        grads["key"] = project_back("latent", xk, d_latent)
        grads["value"] = ew(np.zeros_like(xv))  # a latent layer reads no value input
        d_q = _merge(d_q)  # (B, T, N*H)
        if latent.query_rank is not None:
            grads["query.kernel"] = ein("BLD,BLF->DF", qdn, d_q).reshape(p["query.kernel"].shape)
            d_qd = norm_back("query.down", mm(d_q, p["query.kernel"].reshape(latent.query_rank, -1).T), rms)
            grads["query"] = project_back("query.down", xq, d_qd)
        else:
            grads["query"] = project_back("query", xq, d_q)
    else:
        # the cache: k = concat(past_key, k_new), v likewise
        if P:
            grads["past_key"], d_k = d_k[:, :, :P], d_k[:, :, P:]
            grads["past_value"], d_v = d_v[:, :, :P], d_v[:, :, P:]
        if norm_cfg is not None and norm_cfg.after_rope:  # the norm after rope, undone before rope is
            d_q = F.split_heads(norm_back("query", _merge(d_q), norm_cfg), N)
            d_k = F.split_heads(norm_back("key", _merge(d_k), norm_cfg), K)
        if config.kv_shared:  # the new keys are the cache's last S entries: their gradients are the cache's
            grads["past_key"] = d_k if not P else np.concatenate([grads["past_key"], d_k], axis=2)
            grads["past_value"] = d_v if not P else np.concatenate([grads["past_value"], d_v], axis=2)
            d_k, d_v = np.zeros_like(d_k), np.zeros_like(d_v)  # no key or value input: no projection reads them
        if rope_cfg is not None:
            d_q = rope_back(d_q, kept["query.rope"])
            d_k = d_k if config.kv_shared else rope_back(d_k, kept["key.rope"])
        d_q, d_k, d_v = _merge(d_q), _merge(d_k), _merge(d_v)  # (B, L, F): split_heads undone
        km, vs = config.key_multiplier, config.value_scale  # y = x c: dx = dy c (magnitudes: |c|)
        if km != 1.0:
            d_k = F.multiply(d_k, abs(km) if magnitude else km)
        if vs != 1.0:
            d_v = F.multiply(d_v, abs(vs) if magnitude else vs)
        # norm: y = xhat g + b, xhat = (x - mean) r (layer) or x r (rms), r = 1 / sqrt(mean(.^2) + eps):
        # dx = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), without the mean(dxhat) term for rms.
        if norm_cfg is not None and not norm_cfg.after_rope:
            d_q = norm_back("query", d_q, norm_cfg)
            d_k = d_k if config.kv_shared else norm_back("key", d_k, norm_cfg)
        if config.value_norm is not None:
            d_v = norm_back("value", d_v, config.value_norm)

        # clip: the gradient passes where the value was inside [-c, c] (autodiff of a clamp: bounds included)
        if clip is not None:
            d_q, d_k, d_v = (ew(np.where(inside, d, 0)) for d, inside in zip((d_q, d_k, d_v), kept["clip"]))

        grads["query"] = project_back("query", xq, d_q)
        if config.kv_shared:  # no key or value input (check_shared_call): xk and xv are the query, read by nothing
            grads["key"], grads["value"] = ew(np.zeros_like(xk)), ew(np.zeros_like(xv))
        else:
            grads["key"] = project_back("key", xk, d_k)
            grads["value"] = project_back("value", xv, d_v)
    if d_gate_input is not None:  # the gate reads the query input too
        grads["query"] = ew(grads["query"].astype(ct) + d_gate_input.astype(ct))
    return out, kept, grads


# -- differential attention (config.differential) ----------------------------------

def _differential_forward(config, p, ctx, kept, magnitude, ct):
    """functional.differential on ctx (B, N, T, 2V), its pieces kept: e1 = exp(q1 . k1), e2 = exp(q2 . k2),
    lambda, xhat = d r, r = 1 / sqrt(mean(d^2) + eps) of d = ctx_1 - lambda ctx_2. Magnitude mode (ctx the
    attended magnitudes): |s| r (m_1 + |lambda| m_2), the true forward's r and lambda (a norm divides upstream
    error by the RMS it divides by, as functional.norm's rule)."""
    dif, half = config.differential, ctx.shape[1] // 2
    s = ct.type(1 - dif.lambda_init)
    c = ctx.astype(ct)
    if magnitude:
        _, _, lam, _, r = kept["differential"]
        return ((c[:, :half] + np.abs(lam) * c[:, half:]) * r * np.abs(s)).astype(ctx.dtype)
    e1, e2 = (np.exp((p[f"differential.lambda_q{i}"].astype(ct) * p[f"differential.lambda_k{i}"].astype(ct)).sum())
              for i in (1, 2))
    lam = F.differential_lambda(*(p[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")),
                                dif.lambda_init, ctx.dtype)
    d = c[:, :half] - lam * c[:, half:]  # (B, N/2, T, 2V)
    r = 1 / np.sqrt((d * d).mean(axis=-1, keepdims=True) + ct.type(dif.eps))
    kept["differential"] = (e1, e2, lam, d * r, r)
    return F.differential(ctx, lam, dif.lambda_init, dif.eps)


def _differential_back(config, p, d_y, ctx, kept, magnitude, ct, grads):
    """differential undone: d_y (B, N/2, T, 2V) -> d ctx (B, N, T, 2V); grads of the four lambda vectors.
    y = s xhat, xhat = d r: dd = r (s dy - xhat mean(s dy xhat)); d ctx_1 = dd, d ctx_2 = -lambda dd;
    d lambda = -sum(dd ctx_2); lambda = e1 - e2 + lambda_init: d q1 = d lambda e1 k1, d k1 = d lambda e1 q1,
    d q2 = -d lambda e2 k2, d k2 = -d lambda e2 q2. Magnitude mode: every difference a sum."""
    e1, e2, lam, xhat, r = kept["differential"]
    half = ctx.shape[1] // 2
    s = ct.type(1 - config.differential.lambda_init)
    if magnitude:
        xhat, s, lam = np.abs(xhat), np.abs(s), np.abs(lam)
    dxh = d_y.astype(ct) * s
    inner = xhat * (dxh * xhat).mean(axis=-1, keepdims=True)
    dd = r * (dxh + inner if magnitude else dxh - inner)  # (B, N/2, T, 2V)
    d_lam = (dd * ctx[:, half:].astype(ct)).sum()
    sign = 1 if magnitude else -1
    d_lam = sign * d_lam
    for i, e, sg in ((1, e1, 1), (2, e2, sign)):
        q, k = p[f"differential.lambda_q{i}"].astype(ct), p[f"differential.lambda_k{i}"].astype(ct)
        grads[f"differential.lambda_q{i}"] = (sg * d_lam * e * k).astype(ctx.dtype)
        grads[f"differential.lambda_k{i}"] = (sg * d_lam * e * q).astype(ctx.dtype)
    return np.concatenate([dd, sign * lam * dd], axis=1).astype(ctx.dtype)  # (B, N, T, 2V)


def _value_pair_back(d_pair, ct, dtype):
    """functional.value_pair undone: d_pair (B, K, S, 2V) -> (B, K, S, V); kv head j < K/2 gets the first V
    features of both copies of its pair, j + K/2 the last V."""
    half, V = d_pair.shape[1] // 2, d_pair.shape[-1] // 2
    both = d_pair[:, :half].astype(ct) + d_pair[:, half:].astype(ct)  # (B, K/2, S, 2V)
    return np.concatenate([both[..., :V], both[..., V:]], axis=1).astype(dtype)


def _fold(config, grads, key_given, value_given, dtype):
    d_query, d_key, d_value = grads.pop("query"), grads.pop("key"), grads.pop("value")
    if not value_given:
        d_key = d_key + d_value
    if not key_given:
        d_query = d_query + d_key
    ordered = {"query": d_query}
    if key_given:
        ordered["key"] = d_key
    if value_given:
        ordered["value"] = d_value
    for name in ("past_key", "past_value"):
        if name in grads:
            ordered[name] = grads[name]
    # the indexer's tensors: zero (its selection is piecewise constant; DeepSeek trains it with a loss of its own)
    ordered.update({name: grads[name] if name in grads or not name.startswith("indexer.") else
                    np.zeros(shape, dtype) for name, shape in config.tensor_shapes().items()})
    return {name: g.astype(dtype) for name, g in ordered.items()}


def multi_head_attention_vjp(config, tensors, query, key=None, value=None, *, d_output, mask=None, bias=None,
                             is_causal=False, causal_alignment="top_left", training=False, dropout_mask=None,
                             seed=None, dtype=None, positions=None, key_positions=None, past_key=None,
                             past_value=None, segment_ids=None, key_segment_ids=None, gradient_magnitudes=False,
                             past_key_positions=None, topk_indices=None, past_index_keys=None, chunked_core=False,
                             fold_scale=False):
    """Returns (output, grads), or (output, grads, magnitudes) with
    gradient_magnitudes=True (see the module docstring). With config.indexer the selection is a constant
    (attention.run_indexer): the indexer's tensors get zero gradients. chunked_core, fold_scale: other 16-bit
    formulations' rounding (_backward), which the tolerance policy counts beside the stages' for a chunked
    path's or a fused kernel's 16-bit results (conformance.suite.compare.kernel_same_precision)."""
    call = prepare(config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
                   is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
                   return_weights=False, dtype=dtype, positions=positions, key_positions=key_positions,
                   past_key=past_key, past_value=past_value, segment_ids=segment_ids,
                   key_segment_ids=key_segment_ids, past_key_positions=past_key_positions, topk_indices=topk_indices,
                   past_index_keys=past_index_keys)
    dtype = call.dtype
    d_out = np.asarray(d_output).astype(dtype)
    B, T, O = call.shapes.B, call.shapes.T, config.out_dim
    if d_out.shape != (B, T, O):
        raise ValueError(f"d_output must have shape (B, T, O) = {(B, T, O)}: got {d_out.shape}")
    out, kept, raw = _backward(config, call, d_out, is_causal, causal_alignment, chunked_core=chunked_core,
                               fold_scale=fold_scale)
    grads = _fold(config, raw, key is not None, value is not None, dtype)
    if not gradient_magnitudes:
        return out.astype(dtype), grads
    _, _, raw_mag = _backward(config, call, d_out, is_causal, causal_alignment, magnitude=True, true_forward=kept)
    magnitudes = _fold(config, raw_mag, key is not None, value is not None, np.dtype(np.float64))  # never rounded
    return out.astype(dtype), grads, magnitudes
