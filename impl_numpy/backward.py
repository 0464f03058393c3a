"""Hand-written vector-Jacobian product of multi_head_attention.

Given the output cotangent d_output (B, T, O), returns the gradient of
sum(output * d_output) with respect to query, key, value (those passed) and
every canonical tensor. It walks functional.py's stages in reverse; each
block names the stage it undoes. Checked against finite differences in
float64 (tests/test_numpy_backward.py).

Precision follows the forward rule: each backward stage's result is stored in
the storage dtype and its arithmetic runs in compute dtype (float32 for 16-bit
storage), as autodiff in the frameworks does. Where a key defaults to the query (self
attention), the key and value gradients are folded into "query".

`gradient_magnitudes` runs the same backward pass on absolute values (every
difference turned into a sum, the softmax weights kept): the size of the
terms each gradient element is summed from. Rounding errors are proportional
to that, not to the gradient, which can cancel to nearly nothing (the key
bias gradient is exactly zero); the tolerance policy scales by it.
"""

from __future__ import annotations

import numpy as np

from weights import compute_dtype

from . import functional as F


def _grouped(x, K):  # (B, N, T, X) -> (B, K, G*T, X)
    B, N, T, X = x.shape
    return x.reshape(B, K, (N // K) * T, X)


def _prepare(config, tensors, query, key, value, d_output, options):
    shapes, p, (xq, xk, xv), mask4, bias_r4, keep, dtype = F.prepare(
        config, tensors, query, key, value, return_weights=False, **options
    )
    allowed = F.allowed_mask(mask4, shapes.T, shapes.S, options["is_causal"], options["causal_alignment"])
    ct = compute_dtype(dtype)
    del ct
    d_out = np.asarray(d_output).astype(dtype)
    B, T, O = shapes.B, shapes.T, config.out_dim
    if d_out.shape != (B, T, O):
        raise ValueError(f"d_output must have shape (B, T, O) = {(B, T, O)}: got {d_out.shape}")
    return shapes, p, [xq, xk, xv], allowed, bias_r4, keep, dtype, d_out


def _backward(config, p, xq, xk, xv, allowed, bias_r4, keep, d_out, *, magnitude=False):
    """The forward pass kept for backward, then the backward pass.

    magnitude=True: inputs, tensors and d_out are replaced by their absolute
    values and the softmax backward's subtraction by an addition, while the
    softmax weights come from the true forward pass."""
    N, K, H, V, O = config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim, config.out_dim
    scale = config.effective_scale
    dtype = xq.dtype
    ct = compute_dtype(dtype)

    def mm(a, b):  # a matmul: accumulate in compute dtype, store in dtype
        return np.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False)).astype(dtype, copy=False)

    def ein(spec, a, b):
        return np.einsum(spec, a.astype(ct, copy=False), b.astype(ct, copy=False)).astype(dtype, copy=False)

    def ew(a):  # an elementwise result, stored
        return a.astype(dtype, copy=False)

    # forward, keeping what the backward pass needs (compute dtype throughout)
    q = F.split_heads(F.project(xq, p["query.kernel"], p.get("query.bias")), N)  # (B, N, T, H)
    k = F.split_heads(F.project(xk, p["key.kernel"], p.get("key.bias")), K)  # (B, K, S, H)
    v = F.split_heads(F.project(xv, p["value.kernel"], p.get("value.bias")), K)  # (B, K, S, V)
    x = F.mask(F.logits(q, k, scale), allowed, bias_r4)
    w = F.softmax(x, config.masked_row)  # (B, N, T, S)
    wd = F.dropout(w, keep, config.dropout)
    ctx = F.merge_heads(F.attend(wd, v))  # (B, T, N*V)
    out = F.output(ctx, p["output.kernel"], p.get("output.bias"))
    if magnitude:
        w_true, wd_true = yield  # the caller sends the real weights
        ab = {name: np.abs(t) for name, t in p.items()}
        q = F.split_heads(F.project(np.abs(xq), ab["query.kernel"], ab.get("query.bias")), N)
        k = F.split_heads(F.project(np.abs(xk), ab["key.kernel"], ab.get("key.bias")), K)
        v = F.split_heads(F.project(np.abs(xv), ab["value.kernel"], ab.get("value.bias")), K)
        w, wd = w_true, wd_true
        ctx = F.merge_heads(F.attend(wd, v))
        p, xq, xk, xv, d_out, scale = ab, np.abs(xq), np.abs(xk), np.abs(xv), np.abs(d_out), abs(scale)
    else:
        yield out, w, wd
    B, T, S = xq.shape[0], xq.shape[1], xk.shape[1]

    grads: dict[str, np.ndarray] = {}
    # output: out = ctx @ Wo + bo
    Wo = p["output.kernel"].reshape(N * V, O)
    grads["output.kernel"] = ein("BTF,BTO->FO", ctx, d_out).reshape(N, V, O)
    if config.use_output_bias:
        grads["output.bias"] = ew(d_out.astype(ct).sum(axis=(0, 1)))
    d_ctx = mm(d_out, Wo.T)  # (B, T, N*V)
    # merge_heads
    d_ctx = d_ctx.reshape(B, T, N, V).transpose(0, 2, 1, 3)  # (B, N, T, V)
    # attend: ctx = wd @ v (grouped)
    d_wd = mm(_grouped(d_ctx, K), v.swapaxes(-1, -2)).reshape(B, N, T, S)
    d_v = mm(_grouped(wd, K).swapaxes(-1, -2), _grouped(d_ctx, K))  # (B, K, S, V)
    # dropout
    d_w = d_wd if keep is None else ew(np.where(keep, d_wd.astype(ct) / ct.type(1.0 - config.dropout), 0))
    # softmax: dx = w * (dw - sum(dw * w)), in compute dtype like the forward.
    # A fully masked row's weights do not depend on its logits under "zero" and
    # "uniform" (gradient 0); under "nan" they are NaN (see the mask stage).
    wc, dwc = w.astype(ct), d_w.astype(ct)
    row = (dwc * wc).sum(axis=-1, keepdims=True)
    d_x = wc * (dwc + row if magnitude else dwc - row)
    if config.masked_row == "uniform":
        d_x = np.where(np.isfinite(x).any(axis=-1, keepdims=True), d_x, 0)
    # mask: identity on allowed positions; a masked (-inf) position gets no
    # gradient, as autodiff of a `where` gives: so a "nan" row's NaN weights
    # reach the value gradient only, not the query and key gradients.
    d_x = ew(np.where(x == -np.inf, 0, d_x))
    # logits: x = scale * q k^T (grouped)
    d_s = _grouped(ew(d_x.astype(ct) * ct.type(scale)), K)  # (B, K, G*T, S)
    d_q = mm(d_s, k).reshape(B, N, T, H)
    d_k = mm(d_s.swapaxes(-1, -2), q.reshape(B, K, -1, H))  # (B, K, S, H)

    # split_heads, then project: y = x @ W + b
    def project_back(prefix, x_in, d_heads):
        d_flat = d_heads.transpose(0, 2, 1, 3).reshape(x_in.shape[0], x_in.shape[1], -1)  # (B, L, F)
        W = p[f"{prefix}.kernel"]
        grads[f"{prefix}.kernel"] = ein("BLD,BLF->DF", x_in, d_flat).reshape(W.shape)
        if f"{prefix}.bias" in p:
            grads[f"{prefix}.bias"] = ew(d_flat.astype(ct).sum(axis=(0, 1))).reshape(p[f"{prefix}.bias"].shape)
        return mm(d_flat, W.reshape(W.shape[0], -1).T)  # (B, L, D)

    grads["query"] = project_back("query", xq, d_q)
    grads["key"] = project_back("key", xk, d_k)
    grads["value"] = project_back("value", xv, d_v)
    yield grads


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
    ordered.update({name: grads[name] for name in config.tensor_shapes()})
    return {name: g.astype(dtype) for name, g in ordered.items()}


def multi_head_attention_vjp(config, tensors, query, key=None, value=None, *, d_output, mask=None, bias=None,
                             is_causal=False, causal_alignment="top_left", training=False, dropout_mask=None,
                             seed=None, dtype=None, gradient_magnitudes=False):
    """Returns (output, grads), or (output, grads, magnitudes) with
    gradient_magnitudes=True (see the module docstring)."""
    options = dict(mask=mask, bias=bias, dropout_mask=dropout_mask, is_causal=is_causal,
                   causal_alignment=causal_alignment, training=training, seed=seed, dtype=dtype)
    shapes, p, (xq, xk, xv), allowed, bias_r4, keep, dtype, d_out = _prepare(config, tensors, query, key, value, d_output, options)
    walk = _backward(config, p, xq, xk, xv, allowed, bias_r4, keep, d_out)
    out, w, wd = next(walk)
    grads = _fold(config, next(walk), key is not None, value is not None, dtype)
    if not gradient_magnitudes:
        return out.astype(dtype), grads
    mag_walk = _backward(config, p, xq, xk, xv, allowed, bias_r4, keep, d_out, magnitude=True)
    next(mag_walk)
    magnitudes = _fold(config, mag_walk.send((w, wd)), key is not None, value is not None, dtype)
    return out.astype(dtype), grads, magnitudes
