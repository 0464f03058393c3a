"""Backend torch-sdpa: F.scaled_dot_product_attention around our projections.

Projections, head split/merge and the output projection are impl_torch's
stages (impl_torch.functional, which mirror impl_numpy); logits, mask,
softmax and attend are one SDPA call:

- GQA natively (enable_gqa=True), value_head_dim != head_dim, any scale
  (scale=);
- a bool mask (True = attend, SDPA's own polarity) as attn_mask
  (B|1, N|1, T, S); a bias as a float attn_mask (added) with -inf where not
  allowed;
- causal top-left alone: is_causal=True (SDPA's causal is top-left); any
  other causal (bottom-right, or with a mask or bias) folded into attn_mask,
  since SDPA refuses is_causal together with attn_mask;
- attention weights: SDPA returns none; they are read out of the same
  kernel by a second call with the value set to the identity (V = I_S,
  weights @ I = weights; conformance.native.identity_values).

Cannot express: an explicit dropout mask (dropout_p draws its own). A query
row with no allowed key gives what the kernel gives: 0 on CPU (torch 2.13,
bool and -inf float masks); measured per device and dtype by a probe call
(`native_masked_row`), and expressible only where that is the case's
masked_row.
"""

from __future__ import annotations

import numpy as np

from . import (
    SELECTION_WHY,
    allowed4,
    bias4,
    check_dropout,
    check_masked_rows,
    classify_row,
    order_grads,
    prepare_call,
    qkv,
    require,
    torch_vjp,
    why_each,
)

require("torch")

NAME = "torch-sdpa"
WHY = ("SDPA takes q, k, v, a mask and a scale: no RoPE, cache, window, softcap, QK-norm, sinks or segment-id "
       "argument (torch-flex builds them around flex_attention)")


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    return None


def devices() -> list[str]:
    from impl_torch.device import devices as torch_devices

    return torch_devices()


_ROWS: dict[tuple, str] = {}


def native_masked_row(device: str, dtype: str, float_mask: bool) -> str:
    """What SDPA gives for a query row with no allowed key (bool mask, or a
    float mask of -inf), measured on a small call."""
    key = (device, dtype, float_mask)
    if key not in _ROWS:
        import torch
        import torch.nn.functional as F

        from impl_torch.device import resolve_device

        dev, dt = resolve_device(device), getattr(torch, dtype)
        q = torch.ones(1, 1, 2, 2, device=dev, dtype=dt)  # (B, N, T, H)
        v = torch.tensor([[[[0.0, 2.0], [2.0, 4.0], [4.0, 0.0]]]], device=dev, dtype=dt)  # (B, N, S, H)
        allowed = torch.ones(2, 3, dtype=torch.bool, device=dev)
        allowed[0] = False  # query 0: no key
        mask = allowed if not float_mask else torch.zeros(2, 3, device=dev, dtype=dt).masked_fill(~allowed, float("-inf"))
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, v, v, attn_mask=mask)
        _ROWS[key] = classify_row(out[0, 0, 0].float().cpu().numpy(), v[0, 0].float().cpu().numpy())
    return _ROWS[key]


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                              why=why_each(config, inputs, options, WHY, {"topk_indices": SELECTION_WHY}))
    check_dropout(NAME, config, inputs, options)
    float_mask = inputs.get("bias") is not None
    check_masked_rows(NAME, config, shapes, inputs, options, native_masked_row(device, dtype, float_mask),
                      f"F.scaled_dot_product_attention with a {'float' if float_mask else 'bool'} attn_mask on "
                      f"{device}, {dtype}")
    return dtype, tensors, inputs, shapes


def _sdpa_masks(shapes, inputs, options, dtype, dev) -> dict:
    """SDPA keyword arguments for the case's mask, bias and causal flag."""
    import torch

    from impl_torch.native import to_torch

    bias = bias4(shapes, inputs)
    top_left_only = (options.get("is_causal") and options.get("causal_alignment", "top_left") == "top_left"
                     and inputs.get("mask") is None and bias is None)
    if top_left_only:
        return {"is_causal": True}
    allowed = allowed4(shapes, inputs, options)  # (B|1, N|1, T, S), causal folded in
    if bias is None:
        return {} if allowed is None else {"attn_mask": to_torch(allowed).to(dev)}
    full = bias.astype(np.float64) if allowed is None else np.where(allowed, bias.astype(np.float64), -np.inf)
    return {"attn_mask": to_torch(np.ascontiguousarray(full)).to(device=dev, dtype=getattr(torch, dtype))}


def _run(config, params, x, kwargs, *, want_weights, trace):
    """Our projections around SDPA. Returns output (B, T, O), weights or None, trace entries."""
    import torch
    import torch.nn.functional as F

    from impl_torch import functional as f

    entries = []
    rec = lambda stage, value: (entries.append((stage, value)) if trace else None, value)[1]  # noqa: E731
    q = rec("query.project", f.project(x["query"], params["query.kernel"], params.get("query.bias")))  # (B, T, N*H)
    k = rec("key.project", f.project(x["key"], params["key.kernel"], params.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", f.project(x["value"], params["value.kernel"], params.get("value.bias")))  # (B, S, K*V)
    q = rec("query.split_heads", f.split_heads(q, config.num_heads))  # (B, N, T, H)
    k = rec("key.split_heads", f.split_heads(k, config.num_kv_heads))  # (B, K, S, H)
    v = rec("value.split_heads", f.split_heads(v, config.num_kv_heads))  # (B, K, S, V)
    gqa = config.num_kv_heads != config.num_heads
    common = dict(scale=config.effective_scale, enable_gqa=gqa, **kwargs)
    weights = None
    if want_weights or trace:
        B, K, S = v.shape[0], v.shape[1], v.shape[2]
        eye = torch.eye(S, dtype=v.dtype, device=v.device).expand(B, K, S, S)  # (B, K, S, S): V = I
        with torch.no_grad():
            weights = rec("softmax", F.scaled_dot_product_attention(q, k, eye, **common))  # (B, N, T, S)
    ctx = rec("attend", F.scaled_dot_product_attention(q, k, v, **common))  # (B, N, T, V)
    ctx = rec("merge_heads", f.merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", f.output(ctx, params["output.kernel"], params.get("output.bias")))  # (B, T, O)
    return out, weights, entries


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    import torch

    from impl_torch.convert import to_numpy, to_torch
    from impl_torch.device import matmul_precision, resolve_device

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    dev = resolve_device(device)
    params = {n: to_torch(t).to(dev) for n, t in tensors.items()}
    x = {n: to_torch(a).to(dev) for n, a in zip(("query", "key", "value"), qkv(inputs))}
    want = bool(options.get("return_weights", False))
    with matmul_precision(precision), torch.no_grad():
        out, w, entries = _run(config, params, x, _sdpa_masks(shapes, inputs, options, dtype, dev),
                               want_weights=want, trace=trace)
    answer = {"output": to_numpy(out)}
    if want:
        answer["weights"] = to_numpy(w)
    if trace:
        answer["trace"] = [(stage, to_numpy(value)) for stage, value in entries]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):

    from impl_torch.convert import to_torch
    from impl_torch.device import matmul_precision, resolve_device

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    dev = resolve_device(device)
    params = {n: to_torch(t).to(dev).requires_grad_(True) for n, t in tensors.items()}
    x = {n: to_torch(a).to(dev).requires_grad_(True) for n, a in zip(("query", "key", "value"), qkv(inputs))}
    with matmul_precision(precision):
        out, _, _ = _run(config, params, x, _sdpa_masks(shapes, inputs, options, dtype, dev),
                         want_weights=False, trace=False)
        out, grads = torch_vjp(out, {**x, **params}, d_output)
    return {"output": out, "grads": order_grads(config, grads)}
