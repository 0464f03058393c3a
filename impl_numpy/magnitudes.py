"""Forward magnitudes: the size of the terms each forward value is summed from.

The forward counterpart of backward.py's `gradient_magnitudes`. Rounding
error follows the size of the terms a value is summed from, not of the value
(Higham, "Accuracy and Stability of Numerical Algorithms", sec. 3.5: the
error of a sum is bounded by a multiple of the sum of |terms|; of a dot
product by |x|.|y|, not |x.y|). A forward value that cancels (an output of
-9e-4 summed from terms of 1e-1) or that a norm divides by its own small RMS
carries an absolute error of the size of those terms, which a scale taken
from max|reference| does not cover. `forward_magnitudes` returns, for every
stage the reference traces (the same names, the same shapes), an array that
bounds each element elementwise (|stage value| <= magnitude) and is the
scale its rounding error follows, plus the returned cache's magnitudes.

Everything runs in float64 on the call as `prepare` validates it. The rules,
stage by stage (each is a comment in the code below):

* inputs and tensors: replaced by their absolute values.
* project: |x| @ |W| + |b| (functional.project on absolute values).
* norm (qk_norm, "rms" or "layer", scope "head" or "all"): a norm divides
  upstream error by the RMS it divides by. The normed magnitude is the
  upstream magnitude times the TRUE forward's r = 1 / sqrt(mean(y^2) + eps)
  (y the true projection, minus its mean for "layer"), times |scale|, plus
  |bias|. For "layer" the centred value y = x - mean(x) has magnitude
  mag(x) + mean over the group of mag(x).
* split_heads: the same reshape.
* rope: with the true cos/sin tables (times the attention factor), the
  rotation y1 = x1 c - x2 s, y2 = x2 c + x1 s becomes m1|c| + m2|s|,
  m2|c| + m1|s| on the rotary features (interleaved or half-split as the
  config says); the rest pass through.
* the cache: past_key / past_value's magnitudes are their absolute values;
  present_key / present_value are those concatenated with the new keys' and
  values' magnitudes, (B, K, P+S, H) and (B, K, P+S, V).
* logits: |scale| * mag_q @ mag_k^T per head (functional.logits: query head n
  reads key head n // G).
* softcap: c tanh(x / c) has slope <= 1 (|c tanh(x/c)| <= |x|): the magnitude
  passes through unchanged.
* mask: masked (not allowed) entries are the reference's own mask-stage
  value there (-inf); allowed entries mag + |bias| (bias finite there).
* softmax: the TRUE forward's weights. They are nonnegative, so they are
  their own magnitude; their relative error (an absolute logit error turned
  into a relative weight error) is what the policy's (1 + z) term covers.
  Masked rows come out as the reference has them (zero, uniform, NaN), and
  with sinks the weights already hold the sink's share.
* dropout: the TRUE dropout stage (weights * keep / (1 - p), nonnegative).
* attend: true dropped weights @ mag_v (a NaN row stays NaN, a zero row 0,
  a uniform row the magnitude of the mean).
* merge_heads: the same reshape.
* output: mag_ctx @ |W_o| + |b_o|.

Logit errors (logit_errors=True, a second dict): what a relative rounding
rho of every logit does downstream of the softmax, divided by rho. A logit
l_j off by e_j, |e_j| <= rho m_j (m the mask stage's magnitude: every term
of the logit, ALiBi's bias and the additive bias), moves the weights by the
softmax's Jacobian, d w_i = w_i (e_i - e_bar), e_bar = sum_j w_j e_j, so
|d w_i| <= rho w_i (m_i + zbar), zbar = sum_j w_j m_j the row's
weight-weighted logit magnitude. The context c = sum_j wd_j v_j (wd = w
times keep / (1 - p)) moves by sum_j wd_j e_j v_j - e_bar c, so
|d c| <= rho ((wd m) @ mag_v + zbar |c|). A key of weight e^-95 adds
e^-95 m_j: the bound follows the keys that carry weight, not the largest
logit of the row. The gate multiplies it by g, merge_heads reshapes it,
the output projection sums it through |W_o| (its bias is exact). Masked
keys (no logit) and masked rows add nothing.

The true values these rules need (the norm's r, cos/sin, the mask stage,
the weights, the dropped weights) come from the reference itself: the stage
values of multi_head_attention's trace, the norm's r from backward.py's
_norm_parts (functional.norm's own steps), the rope tables from
attention.rope_tables and functional.rope_angles.
"""

from __future__ import annotations

import numpy as np

from weights.config import QKNorm

from . import functional as F
from .attention import multi_head_attention, prepare
from .backward import _norm_parts, _rope_join, _rope_pair

CACHE_NAMES = ("present_key", "present_value")


def _differential_magnitude(config, p, true_ctx, mag_ctx):
    """|1 - lambda_init| r (m_1 + |lambda| m_2) for mag_ctx (B, N, T, 2V) -> (B, N/2, T, 2V): r the true
    differential's 1 / sqrt(mean(d^2) + eps), d = ctx_1 - lambda ctx_2 of the true attended context; lambda
    the true one (p: the call's own tensors, not their magnitudes)."""
    dif, half = config.differential, true_ctx.shape[1] // 2
    lam = F.differential_lambda(*(p[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")),
                                dif.lambda_init, np.float64)
    d = true_ctx[:, :half] - lam * true_ctx[:, half:]
    r = 1 / np.sqrt((d * d).mean(axis=-1, keepdims=True) + dif.eps)
    # Twice that: the context is stored (rounded) before the subtraction, and the norm turns a rounding of the
    # context's size into one of d's unit RMS. Two correct 16-bit paths round it at different places (the stages
    # round the weights and the context, the fused and chunked cores the context alone), up to 3.5 roundings of
    # the pair's magnitude apart at the output (weights, both contexts, both normed results, both outputs), where
    # the 16-bit policy grants two (2u relative); elsewhere the same-precision reference's error covers that, but
    # not where r is large (the sweep of differential seeds 993100-993599: random_differential_993253, chunked
    # float16 margin 1.05 with the pair's magnitude once)
    return 2 * abs(1 - dif.lambda_init) * r * (mag_ctx[:, :half] + abs(lam) * mag_ctx[:, half:])


def forward_magnitudes(config, tensors, query, key=None, value=None, *, mask=None, bias=None, is_causal=False,
                       causal_alignment="top_left", training=False, dropout_mask=None, seed=None, positions=None,
                       key_positions=None, past_key=None, past_value=None, segment_ids=None,
                       key_segment_ids=None, past_key_positions=None, logit_errors=False, topk_indices=None,
                       past_index_keys=None):
    """Magnitude bounds of every traced forward stage, in float64 (module docstring).

    Arguments as impl_numpy.multi_head_attention's (without return_weights,
    return_cache, trace, chunk_size, cache_length, dtype). Returns a dict
    keyed by the reference's trace stage names (query.project, key.project,
    value.project, [query.norm, key.norm], query.split_heads, ...,
    [query.rope, key.rope], logits, [softcap], mask, softmax, dropout,
    attend, merge_heads, output), each of its stage's shape, plus
    present_key (B, K, P+S, H) and present_value (B, K, P+S, V).

    logit_errors: also return, as a second dict, what a relative rounding
    of the logits does downstream of the softmax (the module docstring's
    "logit error" rule), keyed by the stages it reaches: softmax, dropout,
    attend, [gate], merge_heads, output."""
    options = dict(mask=mask, bias=bias, is_causal=is_causal, causal_alignment=causal_alignment, training=training,
                   seed=seed, positions=positions, key_positions=key_positions, past_key=past_key,
                   past_value=past_value, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                   past_key_positions=past_key_positions, topk_indices=topk_indices, past_index_keys=past_index_keys)
    call = prepare(config, tensors, query, key, value, dropout_mask=dropout_mask, return_weights=False,
                   dtype="float64", **options)
    # The true forward, stage by stage, from the reference's own trace. The
    # keep-mask prepare drew (or was given) is passed on, so both see the same one.
    entries: list = []
    multi_head_attention(config, tensors, query, key, value, dropout_mask=call.keep if training else dropout_mask,
                         dtype="float64", trace=entries, **options)
    # The indexer's stages (weights.call.INDEXER_STAGES, first in a trace) get no magnitude here: a trace
    # comparison (conformance.suite.compare.localise) judges them by their own size, the selection by the top-k
    # rule; from the selection on, the attention is the layer given that selection.
    true = {e.stage: np.asarray(e.value) for e in entries if not e.stage.startswith("indexer.")}

    N, K = config.num_heads, config.num_kv_heads
    mags: dict[str, np.ndarray] = {}

    def rec(stage, value):
        mags[stage] = value
        return value

    # inputs and tensors: replaced by their absolute values
    p = {name: np.abs(t) for name, t in call.params.items()}
    xq, xk, xv = np.abs(call.query), np.abs(call.key), np.abs(call.value)

    # norm: a norm divides upstream error by the RMS it divides by. mag(y) r |scale| + |bias|, r the
    # TRUE forward's 1 / sqrt(mean(y^2) + eps); for "layer" y = x - mean(x), of magnitude
    # mag(x) + mean over the group of mag(x). before: the true value the norm read (B, L, F).
    def norm(name, m, heads, cfg, before):
        _, r = _norm_parts(before, cfg.type, cfg.eps, heads, cfg.scope, np.dtype(np.float64))  # (B, L, groups, 1)
        B, L, Fw = m.shape
        y = m.reshape(r.shape[:-1] + (Fw // r.shape[-2],))  # (B, L, groups, W)
        if cfg.type == "layer":
            y = y + y.mean(axis=-1, keepdims=True)
        y = y * r
        for part in ("scale", "bias"):
            if f"{name}.norm.{part}" in p:
                t = p[f"{name}.norm.{part}"]
                t = t.reshape(-1) if cfg.scope == "all" else t  # as functional.norm lays it on the groups
                y = y * t if part == "scale" else y + t
        return y.reshape(B, L, Fw)

    if config.rope is not None:
        inv_freq, factor = call.rope_tables(config)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved

    # rope: with the true cos/sin (times the attention factor), (x1 c - x2 s, x2 c + x1 s) becomes
    # (m1|c| + m2|s|, m2|c| + m1|s|) on the first R features; the rest pass through
    def rope(m, positions):
        angles = F.rope_angles(positions, inv_freq, call.dtype)  # (B|1, 1, L, R/2)
        c, s = np.abs(np.cos(angles) * factor), np.abs(np.sin(angles) * factor)
        m1, m2 = _rope_pair(m, R, interleaved)
        return _rope_join(m1 * c + m2 * s, m2 * c + m1 * s, m[..., R:], interleaved)

    # temperature: q times the factor (its magnitude: the factor may be below 0 for beta < 0)
    def temperature():
        nonlocal q
        if config.query_temperature is not None:
            t = config.query_temperature
            factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
            q = rec("query.temperature", q * np.abs(factor))

    # project: |x| @ |W| + |b|
    latent = config.latent
    if latent is not None:  # latent.py's expanded form, stage by stage, by the same rules
        C, R_, H = latent.kv_rank, latent.rope_dim, config.head_dim
        rms = QKNorm(type="rms", eps=latent.eps)
        if latent.query_rank is not None:
            q = rec("query.down", F.project(xq, p["query.down.kernel"], p.get("query.down.bias")))  # (B, T, Qr)
            q = rec("query.down_norm", norm("query.down", q, 1, rms, true["query.down"]))
            q = rec("query.project", F.project(q, p["query.kernel"], None))  # (B, T, N*H)
        else:
            q = rec("query.project", F.project(xq, p["query.kernel"], p.get("query.bias")))
        both = rec("latent.project", F.project(xk, p["latent.kernel"], p.get("latent.bias")))  # (B, S, C+R)
        c_new = rec("latent.norm", norm("latent", both[..., :C], 1, rms, true["latent.project"][..., :C]))
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
        q = rec("query.rope", np.concatenate([q[..., : H - R_], rope(q[..., H - R_:], call.positions)], axis=-1))
        r_new = rec("key.rope", rope(F.split_heads(np.ascontiguousarray(both[..., C:]), 1), call.key_positions))
        temperature()
        c_all = F.split_heads(c_new, 1)  # (B, 1, S, C); the cache's magnitudes are its absolute values
        if call.past_key is not None:
            c_all = np.concatenate([np.abs(call.past_key), c_all], axis=2)  # (B, 1, P+S, C)
            r_new = np.concatenate([np.abs(call.past_value), r_new], axis=2)  # (B, 1, P+S, R)
        k = rec("key.project", F.project(c_all[:, 0], p["key.kernel"], None))
        v = rec("value.project", F.project(c_all[:, 0], p["value.kernel"], None))
        k, v = rec("key.split_heads", F.split_heads(k, K)), rec("value.split_heads", F.split_heads(v, K))
        k = rec("key.join", F.join_keys(k, r_new))  # (B, K, P+S, H)
        mags["present_key"], mags["present_value"] = c_all, r_new
    elif config.kv_shared:  # issue 42: the query's stages by the rules above; k and v the given cache's |values|
        q = rec("query.project", F.project(xq, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
        n = config.qk_norm
        if n is not None:
            q = rec("query.norm", norm("query", q, N, n, true["query.project"]))
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
        if config.rope is not None:
            q = rec("query.rope", rope(q, call.positions))
        temperature()
        if call.cache_length is not None:  # in place: the buffers' first P + S positions
            k, v = (np.abs(x[:, :, :call.shapes.S_total]) for x in (call.past_key, call.past_value))
        else:  # the cache before the shared entries, then them: the given cache whole
            k = np.abs(np.concatenate([call.past_key, call.shared_key], axis=2))  # (B, K, P+S, H)
            v = np.abs(np.concatenate([call.past_value, call.shared_value], axis=2))  # (B, K, P+S, V)
        mags["present_key"], mags["present_value"] = k, v  # (B, K, P+S, H|V)
    else:
        q = rec("query.project", F.project(xq, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
        k = rec("key.project", F.project(xk, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
        v = rec("value.project", F.project(xv, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
        # clip: a value the clip replaced is c exactly (no terms); the others pass through
        if config.qkv_clip is not None:
            c = config.qkv_clip
            q, k, v = (rec(f"{name}.clip", np.where(np.abs(true[f"{name}.project"]) <= c, m, c))
                       for name, m in (("query", q), ("key", k), ("value", v)))
        n = config.qk_norm
        upstream = ".clip" if config.qkv_clip is not None else ".project"
        if n is not None and not n.after_rope:
            q = rec("query.norm", norm("query", q, N, n, true["query" + upstream]))
            k = rec("key.norm", norm("key", k, K, n, true["key" + upstream]))
        if config.value_norm is not None:
            v = rec("value.norm", norm("value", v, K, config.value_norm, true["value" + upstream]))
        # the key multiplier and the value scale: a product by |c| (one rounding, no sum)
        if config.key_multiplier != 1.0:
            k = rec("key.multiplier", F.multiply(k, abs(config.key_multiplier)))
        if config.value_scale != 1.0:
            v = rec("value.scale", F.multiply(v, abs(config.value_scale)))
        # split_heads: the same reshape
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
        k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
        v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
        if config.rope is not None:
            q, k = rec("query.rope", rope(q, call.positions)), rec("key.rope", rope(k, call.key_positions))
        # a norm after RoPE: the rule above on the flat view of the turned q and k (functional.norm_heads)
        if n is not None and n.after_rope:
            def flat(x):  # (B, heads, L, W) -> (B, L, heads*W)
                return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)

            turned = ".rope" if config.rope is not None else ".split_heads"  # without RoPE: right after split_heads
            q = rec("query.norm", F.split_heads(norm("query", flat(q), N, n, flat(true["query" + turned])), N))
            k = rec("key.norm", F.split_heads(norm("key", flat(k), K, n, flat(true["key" + turned])), K))
        temperature()
        # the cache: past_key / past_value's magnitudes are their absolute values, the new keys' appended
        if call.past_key is not None:
            k = np.concatenate([np.abs(call.past_key), k], axis=2)  # (B, K, P+S, H)
            v = np.concatenate([np.abs(call.past_value), v], axis=2)  # (B, K, P+S, V)
        mags["present_key"], mags["present_value"] = k, v
    # value.pair (differential): the same join of each kv head's value magnitudes with its pair's
    if config.differential is not None:
        v = rec("value.pair", F.value_pair(v))  # (B, K, P+S, 2V)
    # logits: |scale| * mag_q @ mag_k^T, query head n reading key head n // G
    x = rec("logits", F.logits(q, k, abs(config.effective_scale)))  # (B, N, T, P+S)
    # softcap: c tanh(x / c) has slope <= 1, so |softcap(x)| <= |x|: the magnitude passes through
    if config.logit_softcap is not None:
        x = rec("softcap", x)
    # alibi: the bias is computed (a product, one rounding): magnitude + |bias|
    if config.alibi:
        x = rec("alibi", x + np.abs(call.alibi_bias(config)))
    # mask: masked entries as the reference has them (-inf); allowed ones mag + |bias| (finite there)
    if call.bias4 is not None:
        with np.errstate(invalid="ignore"):
            x = x + np.abs(call.bias4)
    x = rec("mask", np.where(true["mask"] == -np.inf, true["mask"], x))
    # softmax: the true weights (nonnegative: their own magnitude; masked rows and sinks as the reference has them)
    w = rec("softmax", true["softmax"])
    # dropout: the true dropped weights (weights * keep / (1 - p), nonnegative)
    wd = rec("dropout", true["dropout"])
    # attend: true dropped weights @ mag_v (a NaN row stays NaN, a zero row 0, a uniform row the mean's magnitude)
    ctx = rec("attend", F.attend(wd, v))  # (B, N, T, V)
    # logit error: logit j off by e_j, |e_j| <= rho m_j (m: the mask stage's magnitude, every term of the logit
    # and its bias), moves weight i by w_i (e_i - sum_j w_j e_j) and the context by sum_j wd_j e_j v_j - e_bar c:
    # |d w_i| <= rho w_i (m_i + zbar), |d c| <= rho ((wd m) @ mag_v + zbar |c|), zbar = sum_j w_j m_j per row
    errs: dict[str, np.ndarray] = {}
    if logit_errors:
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(x) & np.isfinite(w) & (w > 0)  # masked keys and masked rows: no logit to round
            m = np.where(finite, x, 0.0)
            wm = np.where(finite, w * m, 0.0)
            zbar = wm.sum(axis=-1, keepdims=True)  # (B, N, T, 1): the row's weight-weighted logit magnitude
            keep = np.where(finite, np.nan_to_num(wd) / np.where(finite, w, 1.0), 0.0)  # keep / (1 - p), or 1
            errs["softmax"] = np.where(finite, w * (m + zbar), 0.0)
            errs["dropout"] = errs["softmax"] * keep
            err_ctx = F.attend(wm * keep, v) + zbar * np.nan_to_num(np.abs(true["attend"]))
        errs["attend"] = err_ctx
    # differential: d = ctx_1 - lambda ctx_2 has magnitude m_1 + |lambda| m_2; the RMS norm divides it by the TRUE
    # d's RMS (1 / r, as the norm rule) and (1 - lambda_init) scales it: |1 - lambda_init| r (m_1 + |lambda| m_2),
    # counted twice (_differential_magnitude says why).
    # lambda's own rounding (a dot product of H terms and two exps) rides on |lambda| m_2. The logit error the
    # same way (the norm's own rounding, a few ulps of r, is of y's size, covered by the magnitude)
    if config.differential is not None:
        ctx = rec("differential", _differential_magnitude(config, call.params, true["attend"], ctx))
        if logit_errors:
            err_ctx = errs["differential"] = _differential_magnitude(config, call.params, true["attend"], err_ctx)
    # gate: |x| @ |Wg| + |bg| for its logits; the gated context g * mag(ctx) plus the gate's own error carried
    # by the context: |ctx| g (1 - g) mag(logits) (sigmoid's slope g (1 - g), g the TRUE gate)
    if config.output_gate is not None:
        gl = rec("gate.project", F.gate_project(xq, p["gate.kernel"], p.get("gate.bias")))
        B, _, T, _ = ctx.shape
        g = 1 / (1 + np.exp(-true["gate.project"].reshape(B, T, N, -1).transpose(0, 2, 1, 3)))
        m_gl = gl.reshape(B, T, N, -1).transpose(0, 2, 1, 3)
        ctx = rec("gate", ctx * g + np.abs(true["attend"]) * g * (1 - g) * m_gl)
        if logit_errors:  # the gate multiplies the context's error by g
            err_ctx = errs["gate"] = err_ctx * g
    # merge_heads: the same reshape
    ctx = rec("merge_heads", F.merge_heads(ctx))  # (B, T, N*V)
    # output: mag_ctx @ |W_o| + |b_o|
    rec("output", F.output(ctx, p["output.kernel"], p.get("output.bias")))  # (B, T, O)
    if logit_errors:  # the same reshape, then |W_o| (the bias is exact)
        errs["merge_heads"] = F.merge_heads(err_ctx)
        errs["output"] = F.output(errs["merge_heads"], p["output.kernel"], None)
    missing = set(true) ^ (set(mags) - set(CACHE_NAMES))
    if missing:  # the reference traced a stage this module does not know, or the other way round
        raise AssertionError(f"forward_magnitudes and the reference's trace disagree on stages {sorted(missing)}")
    mags = {name: mags[name] for name in (*true, *CACHE_NAMES)}
    return (mags, errs) if logit_errors else mags
