"""The conformance adapter: NumPy arrays in and out (see conformance/backends.py).

The same three functions and argument names as impl_numpy/adapter.py;
`inputs` and `options` follow `mha verify`'s interface. options["use_sdpa"]
(default False) routes the attention core through SDPA where it applies.
Gradients come from torch autograd.
"""

from __future__ import annotations

import numpy as np
import torch

import weights
from weights.contract import check_input_values

from .convert import to_numpy, to_torch
from .device import devices as _devices
from .device import matmul_precision, resolve_device
from .functional import multi_head_attention

NAME = "torch"


def devices() -> list[str]:
    return _devices()


def _kwargs(inputs, options, device):
    def get(name):
        return None if inputs.get(name) is None else to_torch(inputs[name], device)

    return dict(
        mask=get("mask"), bias=get("bias"), dropout_mask=get("dropout_mask"),
        is_causal=bool(options.get("is_causal", False)),
        causal_alignment=options.get("causal_alignment", "top_left"),
        training=bool(options.get("training", False)), seed=options.get("seed"), dtype=options.get("dtype"),
        use_sdpa=bool(options.get("use_sdpa", False)),
    )


def _tensors(config, tensors, device, *, requires_grad=False):
    weights.validate_tensors(config, tensors)  # values too, once, in NumPy: the reference's own check
    return {name: to_torch(t, device).requires_grad_(requires_grad) for name, t in tensors.items()}


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    check_input_values(query=inputs.get("query"), key=inputs.get("key"), value=inputs.get("value"))
    dev = resolve_device(device)
    params = _tensors(config, tensors, dev)
    entries = [] if trace else None
    with matmul_precision(precision), torch.no_grad():
        result = multi_head_attention(
            config, params, to_torch(inputs["query"], dev), inputs.get("key"), inputs.get("value"),
            return_weights=bool(options.get("return_weights", False)), trace=entries, **_kwargs(inputs, options, dev),
        )
    out, w = result if options.get("return_weights") else (result, None)
    answer = {"output": to_numpy(out)}
    if w is not None:
        answer["weights"] = to_numpy(w)
    if trace:
        answer["trace"] = [(e.stage, to_numpy(e.value)) for e in entries]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    check_input_values(query=inputs.get("query"), key=inputs.get("key"), value=inputs.get("value"))
    dev = resolve_device(device)
    params = _tensors(config, tensors, dev, requires_grad=True)
    xs = {name: to_torch(inputs[name], dev).requires_grad_(True)
          for name in ("query", "key", "value") if inputs.get(name) is not None}
    with matmul_precision(precision):
        out = multi_head_attention(config, params, xs["query"], xs.get("key"), xs.get("value"),
                                   **_kwargs(inputs, options, dev))
        d_out = to_torch(np.asarray(d_output), dev)
        if tuple(d_out.shape) != tuple(out.shape):
            raise ValueError(f"d_output must have shape (B, T, O) = {tuple(out.shape)}: got {tuple(d_out.shape)}")
        leaves = {**xs, **params}
        grads = torch.autograd.grad(out, list(leaves.values()), grad_outputs=d_out.to(out.dtype), allow_unused=True)
    by_name = {name: (torch.zeros_like(leaf) if g is None else g) for (name, leaf), g in zip(leaves.items(), grads)}
    order = [name for name in ("query", "key", "value") if name in xs] + list(config.tensor_shapes())
    return {"output": to_numpy(out), "grads": {name: to_numpy(by_name[name].to(out.dtype)) for name in order}}
