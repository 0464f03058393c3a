"""A port of multi-head attention to plain NumPy, in the shape `mha verify`
and `pytest --mha-impl` call: copy this file and put your own code in it.

    attention(config, tensors, inputs, options) -> {"output", "weights", "grads"}

config   the AttentionConfig's fields as a dict (num_heads, head_dim, scale ...)
tensors  canonical weights: query.kernel (D, N, H), query.bias (N, H), key.*
         (Dk, K, H), value.* (Dv, K, V), output.kernel (N, V, O), output.bias (O,)
inputs   query (B, T, D), key (B, S, Dk), value (B, S, Dv); mask (bool, True =
         may attend), bias (added to the logits), dropout_mask (bool, True =
         keep), each of rank 2 (T, S), 3 (B, T, S) or 4 (B, N|1, T, S)
options  is_causal, causal_alignment, return_weights, training, dtype, and
         cotangent (B, T, O) when the vector carries gradients

It returns the gradients of sum(output * cotangent) too (a hand-written
backward pass), so the vectors check them. Features it does not implement
raise NotImplementedError: the vector is reported "unsupported" (a skip
under pytest), never a silent pass.
"""

from __future__ import annotations

import math

import numpy as np

INPUTS = {"query", "key", "value", "mask", "bias", "dropout_mask"}
# Config fields this port does not implement, and the value that switches each off.
OFF = {"rope": None, "logit_softcap": None, "window_left": -1, "window_right": -1, "qk_norm": None, "use_sinks": False,
       "alibi": False, "local_chunk": None, "query_temperature": None, "qkv_clip": None, "output_gate": None,
       "value_norm": None, "latent": None, "alibi_bias_dtype": None, "indexer": None}
OFF["differential"] = None  # differential attention (docs/differential-attention.md)
OFF.update(key_multiplier=1.0, value_scale=1.0, kv_shared=False)  # issue 42's fields
OFF["compressed"] = None  # DeepSeek V4's layer (issue 41)


def _rank4(x):  # (T, S) | (B, T, S) | (B, N, T, S) -> rank 4, broadcastable to (B, N, T, S)
    return x.reshape({2: (1, 1), 3: (x.shape[0], 1)}.get(x.ndim, ()) + x.shape[-2:]) if x.ndim < 4 else x


def attention(config, tensors, inputs, options):
    missing = [f"{name}={config[name]!r}" for name, off in OFF.items() if config.get(name, off) != off]
    missing += [f"input {name}" for name in inputs if name not in INPUTS]
    missing += [name for name in ("return_cache",) if options.get(name)]
    if missing:
        raise NotImplementedError(f"this port does not implement {', '.join(missing)}")
    dtype = inputs["query"].dtype  # the storage dtype: float64, float32, float16 or bfloat16
    ct = np.float64 if dtype == np.float64 else np.float32  # 16-bit inputs are computed in float32
    p = {name: t.astype(ct) for name, t in tensors.items()}
    xq, xk, xv = (inputs[name].astype(ct) for name in ("query", "key", "value"))
    N, K, H = config["num_heads"], config["num_kv_heads"], config["head_dim"]
    G = N // K  # query heads per key/value head
    B, T, S = xq.shape[0], xq.shape[1], xk.shape[1]
    scale = config["scale"] if config["scale"] is not None else 1.0 / math.sqrt(H)

    def project(x, name, heads):
        y = np.einsum("BLD,DNH->BNLH", x, p[f"{name}.kernel"])  # (B, heads, L, width)
        return y + p[f"{name}.bias"][None, :, None, :] if f"{name}.bias" in p else y

    q, k, v = project(xq, "query", N), project(xk, "key", K), project(xv, "value", K)
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # query head n reads key/value head n // G
    logits = scale * (q @ kk.transpose(0, 1, 3, 2))  # (B, N, T, S)
    if "bias" in inputs:
        logits = logits + _rank4(inputs["bias"].astype(ct))
    allowed = np.ones((B, N, T, S), bool)
    if "mask" in inputs:
        allowed &= _rank4(inputs["mask"])
    if options.get("is_causal"):
        offset = S - T if options.get("causal_alignment") == "bottom_right" else 0
        allowed &= np.arange(S)[None, :] <= np.arange(T)[:, None] + offset
    logits = np.where(allowed, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    empty = ~np.isfinite(top)  # rows with no key to attend to
    e = np.exp(logits - np.where(empty, 0.0, top))
    w = e / np.where(empty, 1.0, e.sum(-1, keepdims=True))  # (B, N, T, S); zero on empty rows
    w = np.where(empty, {"zero": 0.0, "uniform": 1.0 / S, "nan": np.nan}[config["masked_row"]], w)
    keep_scale = None
    if options.get("training") and config["dropout"] > 0:
        if "dropout_mask" not in inputs:
            raise NotImplementedError("random dropout (no dropout_mask given)")
        keep_scale = np.where(_rank4(inputs["dropout_mask"]), 1.0 / (1.0 - config["dropout"]), 0.0).astype(ct)
    wd = w if keep_scale is None else w * keep_scale
    ctx = (wd @ vv).transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B, T, N*V)
    wo = p["output.kernel"].reshape(ctx.shape[-1], -1)  # (N*V, O)
    out = ctx @ wo + p.get("output.bias", 0.0)
    result = {"output": out.astype(dtype)}
    if options.get("return_weights"):
        result["weights"] = w.astype(dtype)
    if "cotangent" not in options:
        return result

    # backward: the gradient of sum(output * cotangent), stage by stage in reverse
    g = options["cotangent"].astype(ct)  # (B, T, O)
    grads = {"output.kernel": np.einsum("BTC,BTO->CO", ctx, g).reshape(p["output.kernel"].shape)}
    if "output.bias" in p:
        grads["output.bias"] = g.sum((0, 1))
    d_ctx = (g @ wo.T).reshape(B, T, N, -1).transpose(0, 2, 1, 3)  # (B, N, T, V)
    d_wd = d_ctx @ vv.transpose(0, 1, 3, 2)  # (B, N, T, S)
    d_vv = wd.transpose(0, 1, 3, 2) @ d_ctx  # (B, N, S, V)
    d_w = d_wd if keep_scale is None else d_wd * keep_scale
    d_logits = w * (d_w - (d_w * w).sum(-1, keepdims=True))
    d_logits = np.where(empty, 0.0, d_logits)  # an empty row's weights are a constant: no gradient flows back
    d_q = scale * (d_logits @ kk)  # (B, N, T, H)
    d_k = (scale * (d_logits.transpose(0, 1, 3, 2) @ q)).reshape(B, K, G, S, H).sum(2)  # (B, K, S, H)
    d_v = d_vv.reshape(B, K, G, S, -1).sum(2)  # (B, K, S, V)
    for name, x, d in (("query", xq, d_q), ("key", xk, d_k), ("value", xv, d_v)):
        grads[f"{name}.kernel"] = np.einsum("BLD,BNLH->DNH", x, d)
        if f"{name}.bias" in p:
            grads[f"{name}.bias"] = d.sum((0, 2))
        grads[name] = np.einsum("BNLH,DNH->BLD", d, p[f"{name}.kernel"])
    result["grads"] = {name: grad.astype(dtype) for name, grad in grads.items()}
    return result
