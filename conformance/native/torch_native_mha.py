"""Backend torch-native-mha: torch nn.MultiheadAttention(batch_first=True).

The module is built from the canonical tensors by impl_torch.native.to_native
(layout torch-mha) and called in eval mode; weights with need_weights=True,
average_attn_weights=False (B, N, T, S); gradients by autograd, mapped back
to canonical names through the same layout table.

Mask translation: torch's bool masks mean True = NOT allowed. A padding mask
(B, 1, 1, S) without causal becomes key_padding_mask (B, S) = ~mask; any
other mask and every causal mask (both alignments) becomes attn_mask
(B*N, T, S) = ~allowed, row b*N + n. A bias becomes a float attn_mask
(added to the logits) with -inf where not allowed.

Cannot express: GQA, value_head_dim != head_dim, out_dim != query_dim or
query_dim != num_heads*head_dim, mixed bias flags, a scale other than
1/sqrt(head_dim), an explicit dropout mask.

A query row with no allowed key: NaN (output and weights) with
need_weights=True, but 0 with need_weights=False, where torch routes the
call through F.scaled_dot_product_attention (measured on CPU, torch 2.13).
So the call uses need_weights = the case's return_weights (forward and vjp
alike), and a case with such a row runs only where that path's answer, as
measured by a probe call (`native_masked_row`), is the case's masked_row.
"""

from __future__ import annotations

import numpy as np

from . import (
    SELECTION_WHY,
    allowed4,
    bias4,
    case_has_empty_rows,
    check_default_scale,
    check_dropout,
    check_layout,
    check_masked_rows,
    classify_row,
    grads_to_canonical,
    order_grads,
    prepare_call,
    qkv,
    require,
    torch_vjp,
    why_each,
)

require("torch")

NAME = "torch-native-mha"
WHY = "nn.MultiheadAttention has no argument for any of them"
LAYOUT = "torch-mha"


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    if case.config.masked_row == "nan" and case.return_weights and case_has_empty_rows(case):
        return ("gradients: the NaN of a query row with no allowed key (need_weights=True) reaches the query and key "
                "gradients and every projection's through softmax's backward; the reference's masked_row='nan' keeps "
                "it to the value path (the row's query gets gradient 0)")
    return None


def devices() -> list[str]:
    from impl_torch.device import devices as torch_devices

    return torch_devices()


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                              why=why_each(config, inputs, options, WHY, {"topk_indices": SELECTION_WHY}))
    check_layout(NAME, LAYOUT, config)
    check_default_scale(NAME, config)
    check_dropout(NAME, config, inputs, options)
    need_weights = bool(options.get("return_weights", False))
    check_masked_rows(NAME, config, shapes, inputs, options, native_masked_row(device, dtype, need_weights),
                      f"nn.MultiheadAttention with need_weights={need_weights} on {device}, {dtype}")
    return dtype, tensors, inputs, shapes


_ROWS: dict[tuple, str] = {}


def native_masked_row(device: str, dtype: str, need_weights: bool) -> str:
    """What nn.MultiheadAttention gives for a query row with no allowed key,
    measured: identity projections, one head, row 0 fully masked."""
    key = (device, dtype, need_weights)
    if key not in _ROWS:
        import torch

        from impl_torch.device import resolve_device

        dev, dt = resolve_device(device), getattr(torch, dtype)
        m = torch.nn.MultiheadAttention(2, 1, bias=False, batch_first=True, device=dev, dtype=dt).eval()
        with torch.no_grad():
            m.in_proj_weight.copy_(torch.eye(2).repeat(3, 1))  # [Wq; Wk; Wv] = [I; I; I]
            m.out_proj.weight.copy_(torch.eye(2))
            q = torch.ones(1, 2, 2, device=dev, dtype=dt)  # (B, T, E)
            v = torch.tensor([[[0.0, 2.0], [2.0, 4.0], [4.0, 0.0]]], device=dev, dtype=dt)  # (B, S, E)
            masked = torch.zeros(2, 3, dtype=torch.bool, device=dev)
            masked[0] = True  # query 0: every key masked
            out, _ = m(q, v, v, attn_mask=masked, need_weights=need_weights)
        _ROWS[key] = classify_row(out[0, 0].float().cpu().numpy(), v[0].float().cpu().numpy())
    return _ROWS[key]


def _build(config, tensors, device):
    from impl_torch.device import resolve_device
    from impl_torch.native import to_native

    module = to_native(config, tensors).to(resolve_device(device))
    return module.eval()  # no dropout: the weights are deterministic


def _masks(config, shapes, inputs, options, dtype, dev) -> dict:
    """Our masks (True = attend) and bias in nn.MultiheadAttention's arguments."""
    import torch

    from impl_torch.native import to_torch

    B, N, T, S = shapes.B, config.num_heads, shapes.T, shapes.S
    allowed = allowed4(shapes, inputs, options)  # (B|1, N|1, T, S) or None
    bias = bias4(shapes, inputs)
    if bias is None:
        if allowed is None:
            return {}
        if not options.get("is_causal") and allowed.shape[1:3] == (1, 1) and allowed.shape[0] == B:
            return {"key_padding_mask": to_torch(~allowed[:, 0, 0, :]).to(dev)}  # (B, S), True = padding
        masked = ~np.broadcast_to(allowed, (B, N, T, S))
        return {"attn_mask": to_torch(masked.reshape(B * N, T, S)).to(dev)}  # (B*N, T, S), True = masked
    full = np.broadcast_to(bias, (B, N, T, S)).astype(np.float64)
    if allowed is not None:
        full = np.where(np.broadcast_to(allowed, (B, N, T, S)), full, -np.inf)
    float_mask = to_torch(np.ascontiguousarray(full.reshape(B * N, T, S)))  # (B*N, T, S), added to the logits
    return {"attn_mask": float_mask.to(device=dev, dtype=getattr(torch, dtype))}


def _call(module, q, k, v, masks, need_weights):
    out, w = module(q, k, v, need_weights=need_weights, average_attn_weights=False, **masks)
    return out, w  # (B, T, E), (B, N, T, S) or None


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    import torch

    from impl_torch.convert import to_numpy, to_torch
    from impl_torch.device import matmul_precision

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    module = _build(config, tensors, device)
    dev = next(module.parameters()).device
    q, k, v = (to_torch(x).to(dev) for x in qkv(inputs))
    masks = _masks(config, shapes, inputs, options, dtype, dev)
    want = bool(options.get("return_weights", False))
    with matmul_precision(precision), torch.no_grad():
        out, w = _call(module, q, k, v, masks, want)
    answer = {"output": to_numpy(out)}
    if want:
        answer["weights"] = to_numpy(w)
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):

    from impl_torch.convert import to_torch
    from impl_torch.device import matmul_precision

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    module = _build(config, tensors, device)
    dev = next(module.parameters()).device
    xs = {name: to_torch(x).to(dev).requires_grad_(True) for name, x in zip(("query", "key", "value"), qkv(inputs))}
    masks = _masks(config, shapes, inputs, options, dtype, dev)
    params = dict(module.named_parameters())
    with matmul_precision(precision):
        need_weights = bool(options.get("return_weights", False))  # the forward's path (see the docstring)
        out, _ = _call(module, xs["query"], xs["key"], xs["value"], masks, need_weights)
        out, grads = torch_vjp(out, {**xs, **params}, d_output)
    canonical = grads_to_canonical(LAYOUT, {n: grads[n] for n in params}, num_heads=config.num_heads)
    canonical.update({n: grads[n] for n in xs})
    return {"output": out, "grads": order_grads(config, canonical)}
