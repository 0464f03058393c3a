"""A hand-written NumPy port of the contract, and realistic porting bugs in it.

`port(config, tensors, inputs, options, bug=None)` follows `mha verify`'s
interface. With bug=None it must pass every vector (tests/test_mutants.py
checks that, so a caught mutant is caught because of its bug). Each entry of
MUTANTS is one bug people actually make when porting attention.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def _tf32(x):
    """Round float32 to TF32's 10 explicit mantissa bits (round to nearest)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return rounded.view(np.float32)


def port(config, tensors, inputs, options, bug=None):
    dtype = np.dtype(DTYPES[options["dtype"]])
    ct = np.float64 if dtype == np.float64 else np.float32
    N, K = config["num_heads"], config["num_kv_heads"]
    H, V = config["head_dim"], config["value_head_dim"]
    G = N // K
    t = {k: v.astype(ct) for k, v in tensors.items()}
    q_in, k_in, v_in = (inputs[n].astype(ct) for n in ("query", "key", "value"))
    if bug == "key_value_swapped":
        k_in, v_in = v_in, k_in
    B, T, _ = q_in.shape
    S = k_in.shape[1]

    def mm(a, b):
        if bug == "tf32_matmul_inputs":
            a, b = _tf32(a), _tf32(b)
        return np.matmul(a, b)

    def proj(x, name, heads, width):
        kernel = t[f"{name}.kernel"].reshape(x.shape[-1], heads * width)
        if bug == "transposed_kernel" and kernel.shape[0] == kernel.shape[1]:
            kernel = kernel.T  # a torch Linear weight used without its transpose
        y = mm(x, kernel)
        if f"{name}.bias" in t:
            y = y + t[f"{name}.bias"].reshape(-1)
        if bug == "heads_split_wrong_order":
            return y.reshape(x.shape[0], x.shape[1], width, heads).transpose(0, 3, 1, 2)  # (B, heads, L, width)
        return y.reshape(x.shape[0], x.shape[1], heads, width).transpose(0, 2, 1, 3)  # (B, heads, L, width)

    q, k, v = proj(q_in, "query", N, H), proj(k_in, "key", K, H), proj(v_in, "value", K, V)
    kv_of = (np.arange(N) % K) if bug == "gqa_head_mapping_modulo" else (np.arange(N) // G)
    k, v = k[:, kv_of], v[:, kv_of]  # (B, N, S, H)
    scale = config["scale"] if config["scale"] is not None else 1.0 / np.sqrt(H)
    if bug == "wrong_scale":
        scale = 1.0 / H
    logits = mm(q, k.transpose(0, 1, 3, 2))
    if bug == "bias_before_scale" and "bias" in inputs:
        logits = (logits + inputs["bias"].astype(ct).reshape(_rank4(inputs["bias"].shape))) * scale
    else:
        logits = logits * scale
        if "bias" in inputs:
            logits = logits + inputs["bias"].astype(ct).reshape(_rank4(inputs["bias"].shape))
    allowed = np.ones((B, N, T, S), bool)
    if "mask" in inputs:
        m = inputs["mask"]
        if bug == "inverted_mask":
            m = ~m
        if m.ndim == 3 and bug == "mask_bts_broadcast_as_leading":
            allowed &= np.broadcast_to(m[None], (B, N, T, S)) if B == N else m[:, None]
        else:
            allowed &= m.reshape(_rank4(m.shape))
    if options["is_causal"]:
        offset = 0 if options["causal_alignment"] == "top_left" else S - T
        if bug == "causal_always_bottom_right":
            offset = S - T
        i, j = np.arange(T)[:, None], np.arange(S)[None, :]
        causal = (j < i + offset) if bug == "causal_off_by_one" else (j <= i + offset)
        allowed &= causal
    fill = -1e9 if bug == "mask_fill_minus_1e9" else -np.inf
    logits = np.where(allowed, logits, fill)
    axis = -2 if bug == "softmax_wrong_axis" else -1
    if bug == "no_max_subtraction":
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp(logits)
            w = e / e.sum(axis, keepdims=True)
    else:
        top = logits.max(axis, keepdims=True)
        empty = ~np.isfinite(top)
        e = np.exp(logits - np.where(empty, 0, top))
        total = e.sum(axis, keepdims=True)
        w = e / np.where(total == 0, 1, total)
        if config["masked_row"] == "uniform":
            w = np.where(empty, 1.0 / S, w)
        elif config["masked_row"] == "nan":
            w = np.where(empty, np.nan, w)
    weights_out = w
    if options["training"] and "dropout_mask" in inputs:
        rescale = 1.0 if bug == "dropout_no_rescale" else 1.0 / (1.0 - config["dropout"])
        w = np.where(inputs["dropout_mask"], w * rescale, 0.0)
        if bug == "weights_after_dropout":
            weights_out = w
    ctx = mm(w, v).transpose(0, 2, 1, 3).reshape(B, T, N * V)  # (B, T, N*V)
    out = mm(ctx, t["output.kernel"].reshape(N * V, -1))
    if "output.bias" in t and bug != "missing_output_bias":
        out = out + t["output.bias"]
    result = {"output": out.astype(dtype)}
    if options["return_weights"]:
        result["weights"] = weights_out.astype(dtype)
    return result


def _rank4(shape):
    return {2: (1, 1) + tuple(shape), 3: (shape[0], 1) + tuple(shape[1:]), 4: tuple(shape)}[len(shape)]


MUTANTS = {
    "wrong_scale": "1/H instead of 1/sqrt(H)",
    "heads_split_wrong_order": "the flat N*H axis split as (H, N) instead of (N, H)",
    "softmax_wrong_axis": "softmax over the query axis",
    "inverted_mask": "mask read as True = masked (torch nn.MultiheadAttention's polarity)",
    "causal_off_by_one": "causal mask j < i: a token cannot see itself",
    "causal_always_bottom_right": "causal alignment ignored: always bottom-right",
    "missing_output_bias": "output projection bias dropped",
    "key_value_swapped": "key and value inputs swapped",
    "transposed_kernel": "square kernels used without their transpose (torch Linear weight)",
    "tf32_matmul_inputs": "float32 matmuls with 10-bit-mantissa inputs, as TF32 does",
    "no_max_subtraction": "softmax without subtracting the row max: overflows on large logits",
    "mask_fill_minus_1e9": "masked logits filled with -1e9 (seed 003): fully masked rows become uniform",
    "gqa_head_mapping_modulo": "GQA: query head n reads key head n % K instead of n // G",
    "bias_before_scale": "additive bias added before scaling",
    "dropout_no_rescale": "dropout without the 1/(1-p) rescale",
    "weights_after_dropout": "returned weights taken after dropout",
    "mask_bts_broadcast_as_leading": "a (B, T, S) mask broadcast as (1, B, T, S) by NumPy rules",
}


class MutantAdapter:
    """The port as a conformance backend (forward only; no gradients)."""

    def __init__(self, bug=None):
        self.bug = bug

    def devices(self):
        return ["cpu"]

    def forward(self, config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
        return port(config.to_dict(), tensors, inputs, options, bug=self.bug)

    def vjp(self, *args, **kwargs):
        raise NotImplementedError("the hand port has no gradients")

    def __call__(self, config, tensors, inputs, options):  # the `mha verify` interface
        return port(config, tensors, inputs, options, bug=self.bug)
