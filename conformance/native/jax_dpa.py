"""Backend jax-dpa: jax.nn.dot_product_attention around our projections.

Projections, head split/merge and the output projection are written here in
jax.numpy after impl_numpy's stages (same einsum strings, same precision
rule: float32 arithmetic for float16/bfloat16 storage); logits, mask, bias,
softmax and attend are one jax.nn.dot_product_attention(implementation="xla")
call on (B, T, N, H) / (B, S, K, H) arrays:

- GQA natively (K key/value heads), any scale (scale=);
- windows: local_window_size=(window_left, window_right) (jax's window is
  top-left: query i sees keys i - left .. i + right), so top_left alignment,
  or bottom_right with T == S; a bottom_right window over a longer key
  sequence has no argument and is refused;
- ALiBi: the `bias` argument, which jax adds to the scaled logits before the
  mask, where the contract puts ALiBi (jax has no softcap to come first):
  -slope_n * |pos_q(i) - pos_k(j)| from the tensor alibi.slopes (so its
  gradient flows) and the call's positions (`positions` / `key_positions`
  taken for it), plus the case's bias;
- the other modern and frontier features have no argument: refused with the
  reason (torch-flex builds them around its kernel). Local chunks in
  particular: local_window_size is a sliding window (i - left .. i + right),
  not absolute chunks; only the general mask could carry them, as it could
  segment ids, and this wrapper passes neither through it;
- mask (B|1, N|1, T, S) bool, True = attend (our polarity); bias added;
  causal top-left is is_causal=True (top-left), bottom-right is folded into
  the mask;
- the kernel needs value's head width == key's: for value_head_dim !=
  head_dim the query, key and value heads are zero-padded to the larger
  width (zero columns add exact zeros to q.k; the value's padding columns
  come out 0 and are dropped), with the scale passed explicitly;
- attention weights: the kernel returns none; they are read out of the same
  kernel by a second call with the value set to the identity (V = I_S, heads
  zero-padded likewise; conformance.native.identity_values).

Cannot express: an explicit dropout mask (the function has no dropout). A
query row with no allowed key gets uniform weights (masked logits are set to
-0.7 * float32 max, a finite number), so such a row runs only for
masked_row="uniform".

Measured difference (known_difference): in float64 the result is only
float32-accurate: the function computes the softmax in float32 whatever the
input dtype ("Softmax and it is always carried out in fp32"). It runs, so the
suite shows the failure and its margin.
"""

from __future__ import annotations

import numpy as np

from . import (
    SELECTION_WHY,
    alibi_distance,
    allowed4,
    bias4,
    check_dropout,
    check_masked_rows,
    identity_values,
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

require("jax")

NAME = "jax-dpa"

PROJECT = "BLD,DF->BLF"  # as impl_numpy
OUTPUT = "BTF,FO->BTO"

FLOAT64_SOFTMAX = ("float64: the result is float32-accurate: jax.nn.dot_product_attention computes the softmax in "
                   "float32 whatever the input dtype")


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    if dtype == "float64" and case.S > 1:  # with one key the softmax is exactly 1 in any precision
        return FLOAT64_SOFTMAX
    return None


def devices() -> list[str]:
    return jax_devices()


WINDOW_WHY = ("jax.nn.dot_product_attention takes local_window_size and bias (ALiBi's) and nothing else of the "
              "modern contract; this wrapper builds only the projections around it")
WHY = {
    "topk_indices": SELECTION_WHY,
    "local_chunk": "jax.nn.dot_product_attention has no chunk argument: local_window_size is a sliding window "
                   "(query i sees i - left .. i + right), not absolute chunks of C positions",
    "query_temperature": "jax.nn.dot_product_attention takes one scale for every query, not one per position",
    "output_gate": "jax.nn.dot_product_attention returns the context with no gate argument",
    "past_key_positions": "this wrapper takes no cache (past_key/past_value), whose keys these would place",
}
ALIBI_INPUTS = ("alibi", "positions", "key_positions")  # the positions only feed ALiBi here (RoPE is refused)


def window_size(config, shapes, options) -> tuple[int, int] | None:
    """local_window_size=(left, right) for the config's window, None without one.
    jax's window lets query i see key j iff i - left <= j <= i + right (query i
    at i: top-left, measured by `mha check --conventions`), the contract's
    window_left/window_right for top_left alignment, or bottom_right when T == S;
    an unbounded side (-1) becomes T + S, past every key."""
    if config.window_left < 0 and config.window_right < 0:
        return None
    alignment = options.get("causal_alignment", "top_left")
    if alignment == "bottom_right" and shapes.T != shapes.S_total:
        raise NotImplementedError(
            f"{NAME}: local_window_size counts from the top-left corner (query i against key i); a bottom_right "
            f"window over T={shapes.T} queries and S={shapes.S_total} keys has no argument (it would need an offset)")
    unbounded = shapes.T + shapes.S_total
    return tuple(w if w >= 0 else unbounded for w in (config.window_left, config.window_right))


def _prepare(config, tensors, inputs, options, device, precision):
    expresses = ("window_left", "window_right") + (ALIBI_INPUTS if config.alibi else ())
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                                  expresses=expresses, why=why_each(config, inputs, options, WINDOW_WHY, WHY))
    window = window_size(config, shapes, options)
    check_dropout(NAME, config, inputs, options)
    check_masked_rows(NAME, config, shapes, inputs, options, "uniform",
                      "masked logits are set to -0.7 * float32 max, a finite number", by_bias="nan")
    top_left = bool(options.get("is_causal")) and options.get("causal_alignment", "top_left") == "top_left"
    mask = allowed4(shapes, inputs, options, causal=bool(options.get("is_causal")) and not top_left)
    bias = bias4(shapes, inputs)
    if bias is not None and dtype in ("float16", "bfloat16"):
        bias = bias.astype(np.float32)  # the logits' dtype; the values are the case's
    distance = alibi_distance(shapes, inputs)[:, None] if config.alibi else None  # (B|1, 1, T, S) int64
    return dtype, tensors, inputs, {"mask": mask, "bias": bias, "distance": distance}, top_left, window


def _compute_dtype(dtype):
    import jax.numpy as jnp

    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def _project(x, kernel, bias):
    """PROJECT: x (B, L, D), kernel (D, heads, width) -> (B, L, heads, width)."""
    import jax.numpy as jnp

    D, heads, width = kernel.shape
    ct = _compute_dtype(x.dtype)
    y = jnp.einsum(PROJECT, x.astype(ct), kernel.reshape(D, heads * width).astype(ct))  # (B, L, F)
    if bias is not None:
        y = y + bias.reshape(-1).astype(ct)
    return y.astype(x.dtype).reshape(*x.shape[:2], heads, width)  # (B, L, heads, width)


def pad_heads(x, width):
    """Zero-pad the head features (last axis) to `width` (zero features add exact zeros to q.k)."""
    import jax.numpy as jnp

    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _attention(p, query, key, value, mask, bias, distance=None, *, config, is_causal, want_weights, window=None):
    """Our projections around the kernel: output (B, T, O) and weights (B, N, T, S) or None.
    distance: ALiBi's |pos_q - pos_k| (B|1, 1, T, S), joined to `bias` as -slope_n times it."""
    import jax
    import jax.numpy as jnp

    if distance is not None:
        ct = _compute_dtype(query.dtype)
        alibi = -p["alibi.slopes"].astype(ct).reshape(1, -1, 1, 1) * distance.astype(ct)  # (B|1, N, T, S)
        bias = alibi if bias is None else alibi + bias.astype(ct)  # the contract's order: ALiBi, then bias
    q = _project(query, p["query.kernel"], p.get("query.bias"))  # (B, T, N, H)
    k = _project(key, p["key.kernel"], p.get("key.bias"))  # (B, S, K, H)
    v = _project(value, p["value.kernel"], p.get("value.bias"))  # (B, S, K, V)
    H, V = q.shape[-1], v.shape[-1]
    common = dict(scale=config.effective_scale, implementation="xla", is_causal=is_causal, mask=mask, bias=bias,
                  local_window_size=window)
    width = max(H, V)
    ctx = jax.nn.dot_product_attention(pad_heads(q, width), pad_heads(k, width), pad_heads(v, width), **common)  # (B, T, N, width)
    B, T, N = ctx.shape[:3]
    ctx = ctx[..., :V].reshape(B, T, N * V)  # (B, T, N*V)
    ct = _compute_dtype(ctx.dtype)
    out = jnp.einsum(OUTPUT, ctx.astype(ct), p["output.kernel"].reshape(N * V, -1).astype(ct))  # (B, T, O)
    if p.get("output.bias") is not None:
        out = out + p["output.bias"].astype(ct)
    out = out.astype(ctx.dtype)
    weights = None
    if want_weights:
        S, K = k.shape[1], k.shape[2]
        width = max(H, S)
        eye = jnp.asarray(identity_values(S, width), dtype=v.dtype)  # (S, width) = [I_S | 0]
        eye = jnp.broadcast_to(eye[None, :, None, :], (B, S, K, width))  # (B, S, K, width)
        w = jax.nn.dot_product_attention(pad_heads(q, width), pad_heads(k, width), eye, **common)  # (B, T, N, width)
        weights = jnp.transpose(w[..., :S], (0, 2, 1, 3))  # (B, N, T, S)
    return out, weights


def _masks(masks):
    return {n: None if a is None else jax_array(a) for n, a in masks.items()}


@jax_jit(static_argnames=("config", "is_causal", "want_weights", "window"))
def _everything(p, query, key, value, mask, bias, distance, d_out, *, config, is_causal, want_weights, window):
    """(output, weights or None, gradients for d_out): one compiled program for
    the case, shared by forward (d_out zero) and vjp (see jax_jit)."""
    import jax

    def f(p, q, k, v):
        return _attention(p, q, k, v, mask, bias, distance, config=config, is_causal=is_causal, want_weights=False,
                          window=window)[0]

    out, pullback = jax.vjp(f, p, query, key, value)
    weights = None
    if want_weights:
        weights = _attention(p, query, key, value, mask, bias, distance, config=config, is_causal=is_causal,
                             want_weights=True, window=window)[1]
    return out, weights, pullback(d_out.astype(out.dtype))


def _run(config, tensors, inputs, options, d_out, device, precision):
    dtype, tensors, inputs, masks, top_left, window = _prepare(config, tensors, inputs, options, device, precision)
    expected = (*np.shape(inputs["query"])[:2], config.out_dim)
    d_out = np.zeros(expected) if d_out is None else np.asarray(d_out)
    if d_out.shape != expected:
        raise ValueError(f"d_output must have shape (B, T, O) = {expected}: got {d_out.shape}")
    with jax_context(device, dtype, precision):
        p = {n: jax_array(t) for n, t in tensors.items()}
        out, w, (d_p, dq, dk, dv) = _everything(
            p, *(jax_array(x) for x in qkv(inputs)), **_masks(masks), d_out=jax_array(d_out, dtype), config=config,
            is_causal=top_left, want_weights=bool(options.get("return_weights", False)), window=window)
        grads = {n: np.asarray(g) for n, g in d_p.items()}
        grads.update(query=np.asarray(dq), key=np.asarray(dk), value=np.asarray(dv))
        return np.asarray(out), None if w is None else np.asarray(w), grads


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    out, w, _ = _run(config, tensors, inputs, options, None, device, precision)
    return {"output": out} if w is None else {"output": out, "weights": w}


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    out, _, grads = _run(config, tensors, inputs, options, d_output, device, precision)
    return {"output": out, "grads": order_grads(config, grads)}
