"""Backend flax-nnx-mha: flax.nnx.MultiHeadAttention.

The module comes from impl_jax.native.to_native(kind="nnx") (layout
flax-nnx-mha) with param_dtype = the tensors' dtype (float64 under jax x64,
for that call only), called with deterministic=True; gradients by jax.vjp
over its nnx.Param state and the inputs (nnx.split / nnx.merge), mapped back
to canonical names through the same layout table. One jitted program
computes output, weights and gradients (conformance.native.jax_jit).

Two code paths, both the module's own: the output comes from the default
call, which (no dropout, no sow) hands the attention to
jax.nn.dot_product_attention; the weights, which that path does not return,
come from a second call with sow_weights=True (inside nnx.capture), which
goes through flax's dot_product_attention_weights instead.

Masks: mask (B|1, N|1, T, S), True = attend (our polarity). Causal top-left
is is_causal=True (top-left in both paths); bottom-right is folded into the
mask. GQA natively (num_kv_heads).

QK-norm: normalize_qk=True is LayerNorm over each head's H features with a
scale and no bias, epsilon 1e-6 (measured by `mha check --conventions`): a
qk_norm config of exactly that form (type layer, scope head, eps 1e-6) whose
bias tensors are zero runs with the module's LayerNorms (set on the module
as its constructor builds them, the canonical scales loaded); any other norm
or a nonzero bias is refused, and so are its gradients (the canonical bias
has no parameter in the module). The other modern features have no
argument (nnx's decode cache is not the contract's past_key/past_value).

Cannot express: value_head_dim != head_dim, key_dim != value_dim (one
in_kv_features), mixed bias flags (one use_bias), a scale other than
1/sqrt(head_dim), an additive bias (no argument for one), an explicit dropout
mask. A query row with no allowed key gets uniform weights in both paths
(finite large negative fills), so such a row runs only for
masked_row="uniform".

Measured difference (known_difference): in float64 the output is only
float32-accurate, because jax.nn.dot_product_attention computes the softmax
in float32 whatever the input dtype (jax/_src/nn/functions.py: "Softmax and
it is always carried out in fp32"). It is run, not refused, so the suite
shows the failure and its margin; the weights (flax's own path) are float64.
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

NAME = "flax-nnx-mha"
WHY = ("nnx.MultiHeadAttention has no argument for them but its own decode cache, which is not the contract's "
       "past_key/past_value; QK-norm goes to normalize_qk where the config is that norm")
LAYOUT = "flax-nnx-mha"

FLOAT64_SOFTMAX = ("float64: the output is float32-accurate: the module's default path calls "
                   "jax.nn.dot_product_attention, which computes the softmax in float32 whatever the input dtype")


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    if dtype == "float64" and case.S > 1:  # with one key the softmax is exactly 1 in any precision
        return FLOAT64_SOFTMAX
    return None


def devices() -> list[str]:
    return jax_devices()


# What normalize_qk=True builds (measured by `mha check --conventions`): LayerNorm over each head's H features,
# a scale (H,) and no bias, epsilon 1e-6.
NORMALIZE_QK = {"type": "layer", "scope": "head", "eps": 1e-6}


def normalize_qk(config) -> bool:
    """Whether the config's qk_norm is what normalize_qk=True computes (its
    bias tensors must then be zero: checked on the values)."""
    n = config.qk_norm
    return n is not None and (n.type, n.scope, n.eps) == tuple(NORMALIZE_QK.values())


def _check_norm(config, tensors) -> None:
    if config.qk_norm is None:
        return
    n = config.qk_norm
    if not normalize_qk(config):
        raise NotImplementedError(
            f"{NAME}: normalize_qk is LayerNorm per head (H), eps 1e-6, no bias (measured by mha check "
            f"--conventions); the case asks qk_norm type={n.type}, scope={n.scope}, eps={n.eps:g}")
    nonzero = [name for name in ("query.norm.bias", "key.norm.bias") if np.any(np.asarray(tensors[name]) != 0)]
    if nonzero:
        raise NotImplementedError(f"{NAME}: normalize_qk's LayerNorm has no bias; the case's {', '.join(nonzero)} "
                                  "is not zero")


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                                  expresses=("qk_norm",), why=why_each(config, inputs, options, WHY, {"topk_indices": SELECTION_WHY}))
    _check_norm(config, tensors)
    check_layout(NAME, LAYOUT, config)
    check_default_scale(NAME, config)
    check_dropout(NAME, config, inputs, options)
    if inputs.get("bias") is not None:
        raise NotImplementedError(f"{NAME}: MultiHeadAttention takes no additive attention bias (its mask is boolean)")
    check_masked_rows(NAME, config, shapes, inputs, options, "uniform",
                      "masked logits are set to a finite large negative number")
    top_left = bool(options.get("is_causal")) and options.get("causal_alignment", "top_left") == "top_left"
    mask = allowed4(shapes, inputs, options, causal=bool(options.get("is_causal")) and not top_left)
    return dtype, tensors, inputs, mask, top_left


def _weights(module, q, k, v, m, top_left):
    """The sow_weights=True path's weights (B, N, T, S)."""
    from flax import nnx

    kwargs = dict(mask=m, is_causal=top_left, deterministic=True, sow_weights=True)
    if hasattr(nnx, "capture"):  # flax >= 0.12: sow only inside nnx.capture
        _, inter = nnx.capture(module, nnx.Intermediate)(q, k, v, **kwargs)
    else:
        module(q, k, v, **kwargs)
        inter = nnx.pop(module, nnx.Intermediate)
    w = inter["attention_weights"]
    w = w.get_value() if hasattr(w, "get_value") else w.value
    return w[0]


@jax_jit(static_argnames=("graphdef", "top_left", "want_weights"))
def _everything(params, rest, query, key, value, mask, d_out, *, graphdef, top_left, want_weights):
    """(output, weights or None, gradients for d_out): one compiled program for
    the case, shared by forward (d_out zero) and vjp (see jax_jit)."""
    import jax
    from flax import nnx

    def f(params, q, k, v):
        return nnx.merge(graphdef, params, rest)(q, k, v, mask=mask, is_causal=top_left, deterministic=True)

    out, pullback = jax.vjp(f, params, query, key, value)
    weights = None
    if want_weights:
        weights = _weights(nnx.merge(graphdef, params, rest), query, key, value, mask, top_left)
    return out, weights, pullback(d_out.astype(out.dtype))


def _module(config, tensors):
    """impl_jax.native.to_native's module; for a QK-norm config, the same
    module with normalize_qk's two LayerNorms set on it (what the constructor
    builds for normalize_qk=True: LayerNorm(head_dim, use_bias=False)) and
    the canonical norm scales loaded."""
    import dataclasses

    from flax import nnx

    from impl_jax.native import to_native

    if config.qk_norm is None:
        return to_native(config, tensors, kind="nnx")
    plain = {n: t for n, t in tensors.items() if ".norm." not in n}
    module = to_native(dataclasses.replace(config, qk_norm=None), plain, kind="nnx")
    dtype = np.dtype(next(iter(tensors.values())).dtype)
    for name, attr in (("query", "query_ln"), ("key", "key_ln")):
        ln = nnx.LayerNorm(config.head_dim, use_bias=False, epsilon=NORMALIZE_QK["eps"], param_dtype=dtype,
                           rngs=nnx.Rngs(0))
        ln.scale.set_value(jax_array(tensors[f"{name}.norm.scale"]))
        setattr(module, attr, ln)
    module.normalize_qk = True
    return module


def _run(config, tensors, inputs, options, d_out, device, precision):
    from flax import nnx

    dtype, tensors, inputs, mask, top_left = _prepare(config, tensors, inputs, options, device, precision)
    expected = (*np.shape(inputs["query"])[:2], config.out_dim)
    d_out = np.zeros(expected) if d_out is None else np.asarray(d_out)
    if d_out.shape != expected:
        raise ValueError(f"d_output must have shape (B, T, O) = {expected}: got {d_out.shape}")
    with jax_context(device, dtype, precision):
        graphdef, params, rest = nnx.split(_module(config, tensors), nnx.Param, ...)
        out, w, (d_params, dq, dk, dv) = _everything(
            params, rest, *(jax_array(x) for x in qkv(inputs)), None if mask is None else jax_array(mask),
            jax_array(d_out, dtype), graphdef=graphdef, top_left=top_left,
            want_weights=bool(options.get("return_weights", False)))
        flat = {"/".join(map(str, path)): np.asarray(leaf.get_value() if hasattr(leaf, "get_value") else leaf)
                for path, leaf in nnx.to_flat_state(d_params)}
        norms = {n: flat.pop(f"{n}_ln/scale") for n in ("query", "key") if f"{n}_ln/scale" in flat}
        grads = grads_to_canonical(LAYOUT, flat)
        grads.update({f"{n}.norm.scale": g for n, g in norms.items()})
        grads.update(query=np.asarray(dq), key=np.asarray(dk), value=np.asarray(dv))
        return np.asarray(out), None if w is None else np.asarray(w), grads


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    out, w, _ = _run(config, tensors, inputs, options, None, device, precision)
    return {"output": out} if w is None else {"output": out, "weights": w}


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    if config.qk_norm is not None:
        raise NotImplementedError(f"{NAME}: normalize_qk's LayerNorm has no bias parameter, so the canonical "
                                  "query.norm.bias / key.norm.bias have no gradient in the module")
    out, _, grads = _run(config, tensors, inputs, options, d_output, device, precision)
    return {"output": out, "grads": order_grads(config, grads)}
