"""Backend flax-linen-mha: flax.linen.MultiHeadDotProductAttention.

The module and its params come from impl_jax.native.to_native(kind="linen")
(layout flax-linen-mha) with param_dtype = the tensors' dtype (float64 under
jax x64, for that call only); applied with deterministic=True; weights from
the same call with sow_weights=True (the "intermediates" collection);
gradients by jax.vjp over params and inputs, mapped back to canonical names
through the same layout table. One jitted program computes output, weights
and gradients, so forward and vjp share one XLA compile (conformance.native.
jax_jit). Linen always computes the weights itself
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
    SELECTION_WHY,
    allowed4,
    check_default_scale,
    check_dropout,
    check_layout,
    check_masked_rows,
    flatten_tree,
    grads_to_canonical,
    jax_array,
    jax_context,
    jax_devices,
    jax_jit,
    order_grads,
    prepare_call,
    qkv,
    require,
    why_each,
)

require("jax", "flax")

NAME = "flax-linen-mha"
WHY = ("linen.MultiHeadDotProductAttention takes none of them but its own decode cache, which is not the "
       "contract's past_key/past_value")
LAYOUT = "flax-linen-mha"


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    return None


def devices() -> list[str]:
    return jax_devices()


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                              why=why_each(config, inputs, options, WHY, {"topk_indices": SELECTION_WHY}))
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


@jax_jit(static_argnames=("module", "want_weights"))
def _everything(params, query, key, value, mask, d_out, *, module, want_weights):
    """(output, weights or None, gradients for d_out): one compiled program for
    the case, shared by forward (d_out zero) and vjp (see jax_jit)."""
    import jax

    def f(params, q, k, v):
        return module.apply({"params": params}, q, k, v, mask=mask, deterministic=True)

    out, pullback = jax.vjp(f, params, query, key, value)
    weights = None
    if want_weights:
        _, state = module.apply({"params": params}, query, key, value, mask=mask, deterministic=True,
                                sow_weights=True, mutable=["intermediates"])
        weights = state["intermediates"]["attention_weights"][0]  # (B, N, T, S)
    return out, weights, pullback(d_out.astype(out.dtype))


def _run(config, tensors, inputs, options, d_out, device, precision):
    from impl_jax.native import to_native

    dtype, tensors, inputs, mask = _prepare(config, tensors, inputs, options, device, precision)
    expected = (*np.shape(inputs["query"])[:2], config.out_dim)
    d_out = np.zeros(expected) if d_out is None else np.asarray(d_out)
    if d_out.shape != expected:
        raise ValueError(f"d_output must have shape (B, T, O) = {expected}: got {d_out.shape}")
    with jax_context(device, dtype, precision):
        module, variables = to_native(config, tensors, kind="linen")
        out, w, (d_params, dq, dk, dv) = _everything(
            variables["params"], *(jax_array(x) for x in qkv(inputs)), None if mask is None else jax_array(mask),
            jax_array(d_out, dtype), module=module, want_weights=bool(options.get("return_weights", False)))
        grads = grads_to_canonical(LAYOUT, flatten_tree(d_params))
        grads.update(query=np.asarray(dq), key=np.asarray(dk), value=np.asarray(dv))
        return np.asarray(out), None if w is None else np.asarray(w), grads


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    out, w, _ = _run(config, tensors, inputs, options, None, device, precision)
    return {"output": out} if w is None else {"output": out, "weights": w}


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    out, _, grads = _run(config, tensors, inputs, options, d_output, device, precision)
    return {"output": out, "grads": order_grads(config, grads)}
