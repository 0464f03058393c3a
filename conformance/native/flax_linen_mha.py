"""Backend flax-linen-mha: flax.linen.MultiHeadDotProductAttention.

The module and its params come from impl_jax.native.to_native(kind="linen")
(layout flax-linen-mha) with param_dtype = the tensors' dtype (float64 under
jax x64, for that call only); applied with deterministic=True; weights from
the same call with sow_weights=True (the "intermediates" collection);
gradients by jax.vjp over params and inputs, mapped back to canonical names
through the same layout table. Eager, not jax.jit: the grid's cases share
shapes, so eager dispatch reuses each primitive's compile across cases,
where a jit compiles each case's whole call anew (slower over the grid on
CPU). Linen always computes the weights itself
(flax.linen.dot_product_attention_weights: softmax in the call's dtype).

Masks: mask (B|1, N|1, T, S), True = attend (our polarity). Linen has no
causal flag: both causal alignments are folded into the mask.

Cannot express: GQA, value_head_dim != head_dim, mixed bias flags (one
use_bias), a scale other than 1/sqrt(head_dim), an additive bias (no
argument for one), an explicit dropout mask. A query row with no allowed key
gets uniform weights (masked logits are set to finfo(dtype).min, a finite
number), so such a row runs only for masked_row="uniform".
"""

from __future__ import annotations

import numpy as np

from . import (
    allowed4,
    call_shapes,
    cast,
    check_default_scale,
    check_device,
    check_dropout,
    check_layout,
    check_masked_rows,
    check_precision,
    dtype_name,
    flatten_tree,
    grads_to_canonical,
    jax_array,
    jax_context,
    jax_devices,
    order_grads,
    qkv,
    require,
)

require("jax", "flax")

NAME = "flax-linen-mha"
LAYOUT = "flax-linen-mha"


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    return None


def devices() -> list[str]:
    return jax_devices()


def _prepare(config, tensors, inputs, options, device, precision):
    check_precision(precision)
    check_device(NAME, device, devices())
    dtype = dtype_name(tensors, options)
    tensors, inputs = cast(tensors, inputs, dtype)
    shapes = call_shapes(config, inputs, options)
    check_layout(NAME, LAYOUT, config)
    check_default_scale(NAME, config)
    check_dropout(NAME, config, inputs, options)
    if inputs.get("bias") is not None:
        raise NotImplementedError(f"{NAME}: MultiHeadDotProductAttention takes no additive attention bias (its mask "
                                  "is boolean)")
    check_masked_rows(NAME, config, shapes, inputs, options, "uniform",
                      "masked logits are set to finfo(dtype).min, a finite number")
    mask = allowed4(shapes, inputs, options)  # (B|1, N|1, T, S), causal folded in
    return dtype, tensors, inputs, mask


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    from impl_jax.native import to_native

    dtype, tensors, inputs, mask = _prepare(config, tensors, inputs, options, device, precision)
    with jax_context(device, dtype, precision):
        module, variables = to_native(config, tensors, kind="linen")
        q, k, v = (jax_array(x) for x in qkv(inputs))
        m = None if mask is None else jax_array(mask)
        if not options.get("return_weights"):
            return {"output": np.asarray(module.apply(variables, q, k, v, mask=m, deterministic=True))}
        out, state = module.apply(variables, q, k, v, mask=m, deterministic=True, sow_weights=True,
                                  mutable=["intermediates"])
        w = state["intermediates"]["attention_weights"][0]  # (B, N, T, S)
        return {"output": np.asarray(out), "weights": np.asarray(w)}


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    import jax

    from impl_jax.native import to_native

    dtype, tensors, inputs, mask = _prepare(config, tensors, inputs, options, device, precision)
    with jax_context(device, dtype, precision):
        module, variables = to_native(config, tensors, kind="linen")
        xs = {n: jax_array(x) for n, x in zip(("query", "key", "value"), qkv(inputs))}
        m = None if mask is None else jax_array(mask)

        def f(params, q, k, v):
            return module.apply({"params": params}, q, k, v, mask=m, deterministic=True)

        def out_and_grads(params, q, k, v, d_out):
            out, pullback = jax.vjp(f, params, q, k, v)
            return out, pullback(d_out.astype(out.dtype))

        d_out = np.asarray(d_output)
        expected = (*np.shape(xs["query"])[:2], config.out_dim)
        if d_out.shape != expected:
            raise ValueError(f"d_output must have shape (B, T, O) = {expected}: got {d_out.shape}")
        out, (d_params, dq, dk, dv) = out_and_grads(variables["params"], xs["query"], xs["key"], xs["value"],
                                                    jax_array(d_out, dtype))
        grads = grads_to_canonical(LAYOUT, flatten_tree(d_params))
        grads.update(query=np.asarray(dq), key=np.asarray(dk), value=np.asarray(dv))
        return {"output": np.asarray(out), "grads": order_grads(config, grads)}
