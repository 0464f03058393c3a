"""Measured conventions of the native APIs' modern arguments (the second half
of `mha check --conventions`).

Every cell comes from running the API in this process against the NumPy
reference (impl_numpy) on the same inputs; "-" means the API has no argument
for the feature (read from its signature or schema, stated in the cell).

What is measured, per API:
  RoPE pairing        x of one head at positions 0..L-1 (theta 10000,
                      H = 8) rotated by the API, against the reference's
                      rope with half-split pairs (i, i + H/2) and with
                      interleaved pairs (2i, 2i + 1): which one it matches.
  window: visible     the API's window argument at a small value on T = S =
                      8 queries/keys (weights read out with V = I where the
                      API returns none); for query i = 4 the keys it sees,
                      as i-a..i+b and their count, and whether every row
                      follows the same rule counted from the top-left corner.
  softcap vs mask     softcap c with a finite bias on one key and a masked
                      key: the weights against cap-then-bias, bias-then-cap,
                      and whether the masked key stays at weight 0.
  sinks               an API's way to add a per-head sink logit to the
                      softmax denominator, against the reference's use_sinks.
  QK-norm             a norm option run end to end (identity projections,
                      float64) against the reference's qk_norm with type
                      rms|layer, scope head|all, eps 1e-6|1e-5.

Shape letters as in impl_numpy: B batch, T query length, S key length,
N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

NONE = "-"
ROPE_H, ROPE_L, ROPE_THETA = 8, 6, 10000.0
WINDOW_T = 8  # T = S for the window probe
WINDOW_ROW = 4  # the query row whose visible keys are reported
TOL = 1e-4  # float32 API against the float64 reference

KEYS = ("rope_pairing", "window", "softcap_order", "sinks", "qk_norm")
COLUMNS = (("API", "api"), ("RoPE pairing", "rope_pairing"), ("window argument: keys visible", "window"),
           ("softcap vs mask", "softcap_order"), ("sinks", "sinks"), ("QK-norm option", "qk_norm"))


@dataclasses.dataclass
class ModernApi:
    name: str
    framework: str
    modules: tuple[str, ...]
    install: str
    measure: Callable[[], dict]  # -> {key: label, ..., "evidence": {...}}; absent keys are "-"


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if " Error " in text:  # onnxruntime puts the node's signature first and the reason after "Error"
        text = text[text.rindex(" Error ") + len(" Error "):]
    return f"{type(err).__name__}: {text}"[:200]


def _err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max()) if np.isfinite(a).all() else float("inf")


# -- RoPE pairing ---------------------------------------------------------------------

def rope_inputs() -> np.ndarray:
    """x (1, 1, L, H) float32: one batch, one head, L positions."""
    return np.random.default_rng(5).standard_normal((1, 1, ROPE_L, ROPE_H)).astype(np.float32)


def rope_reference(x: np.ndarray, interleaved: bool) -> np.ndarray:
    from impl_numpy.functional import rope, rope_angles

    inv_freq = ROPE_THETA ** (-np.arange(0, ROPE_H, 2, dtype=np.float64) / ROPE_H)  # (H/2,)
    angles = rope_angles(np.arange(ROPE_L)[None], inv_freq, np.dtype(np.float64))  # (1, 1, L, H/2)
    return rope(np.asarray(x, np.float64), angles, ROPE_H, interleaved, 1.0)


def pairing_label(rotated: np.ndarray, x: np.ndarray) -> tuple[str, dict]:
    """Which pairing `rotated` (1, 1, L, H) matches: 'half-split (i, i+H/2)',
    'interleaved (2i, 2i+1)' or 'neither'."""
    errs = {"half-split": _err(rotated, rope_reference(x, False)),
            "interleaved": _err(rotated, rope_reference(x, True))}
    evidence = {f"max_err_if_{k}": v for k, v in errs.items()}
    best = min(errs, key=errs.get)
    if errs[best] > TOL:
        return f"neither (errs {errs['half-split']:.1e} / {errs['interleaved']:.1e})", evidence
    pairs = "(i, i+H/2)" if best == "half-split" else "(2i, 2i+1)"
    return f"{best} {pairs} (err {errs[best]:.1e})", evidence


# -- windows ---------------------------------------------------------------------------

def window_label(weights: np.ndarray, rule: Callable[[int, int], bool]) -> tuple[str, dict]:
    """weights (T, S) of one head: the keys query WINDOW_ROW sees, and whether
    every row sees exactly the keys `rule(i, j)` names."""
    seen = np.asarray(weights) > 1e-6
    row = np.flatnonzero(seen[WINDOW_ROW])
    lo, hi = int(row.min()) - WINDOW_ROW, int(row.max()) - WINDOW_ROW
    expected = np.array([[rule(i, j) for j in range(seen.shape[1])] for i in range(seen.shape[0])])
    same = bool((expected == seen).all())
    label = f"keys i{lo:+d}..i{hi:+d} ({len(row)})" + ("" if same else " (rows differ: see evidence)")
    return label, {"visible": seen.astype(int).tolist(), "every_row_follows_rule": same}


def _attention_inputs(T_: int, S_: int, H_: int = 4, seed: int = 3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, T_, H_)).astype(np.float32)  # (B, N, T, H)
    k = rng.standard_normal((1, 1, S_, H_)).astype(np.float32)
    return q, k


# -- softcap order ---------------------------------------------------------------------

SOFTCAP, SOFTCAP_BIAS = 1.0, 1.0
SETUP = (f"RoPE: theta {ROPE_THETA:g}, H={ROPE_H}, positions 0..{ROPE_L - 1}; windows: T=S={WINDOW_T}, keys of "
         f"query i={WINDOW_ROW}; softcap {SOFTCAP:g} with bias +{SOFTCAP_BIAS:g} on one key and one key masked; "
         "float32 against the float64 reference (QK-norm: float64)")


def softcap_inputs():
    """One query, three keys with logits 2, 2, 2 (q = (2), k = (1)), scale 1;
    key 1 gets bias +1, key 2 is masked."""
    q = np.full((1, 1, 1, 1), 2.0, np.float32)
    k = np.ones((1, 1, 3, 1), np.float32)
    bias = np.array([[0.0, SOFTCAP_BIAS, -np.inf]], np.float32)  # (T, S): key 2 masked by -inf
    return q, k, bias


def softcap_label(w: np.ndarray) -> tuple[str, dict]:
    """w (3,): the weights row of softcap_inputs under softcap SOFTCAP."""
    def soft(x):
        e = np.exp(x - np.max(x[np.isfinite(x)]))
        return e / e.sum()

    cap_first = soft(np.array([SOFTCAP * np.tanh(2 / SOFTCAP), SOFTCAP * np.tanh(2 / SOFTCAP) + SOFTCAP_BIAS, -np.inf]))
    bias_first = soft(np.array([SOFTCAP * np.tanh(2 / SOFTCAP), SOFTCAP * np.tanh((2 + SOFTCAP_BIAS) / SOFTCAP), -np.inf]))
    errs = {"cap then bias": _err(w, cap_first), "bias then cap": _err(w, bias_first)}
    masked_zero = abs(float(w[2])) <= 1e-6
    best = min(errs, key=errs.get)
    evidence = {"weights": [float(x) for x in w], **{f"max_err_if_{k}": v for k, v in errs.items()},
                "masked_key_weight": float(w[2])}
    if errs[best] > TOL:
        return f"neither (weights {np.round(w, 4).tolist()})", evidence
    order = "before bias and mask" if best == "cap then bias" and masked_zero else (
        "after bias, before mask" if masked_zero else "after the mask (masked keys get -cap)")
    return order, evidence


# -- the APIs ----------------------------------------------------------------------------

def _torch_flex() -> dict:
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    def flex(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(*args, **kwargs)

    row: dict[str, Any] = {"rope_pairing": "- (no argument)", "qk_norm": "- (no argument)",
                           "window": "- (block_mask: the caller's mask_mod)", "evidence": {}}
    # softcap in score_mod, the bias too (the caller orders them there), the masked key through block_mask
    q, k, bias = softcap_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = create_block_mask(lambda b, h, i, j: j < 2, 1, 1, 1, 3, device="cpu")
    b_t = torch.tensor(np.where(np.isfinite(bias), bias, 0.0))

    def score_mod(s, b, h, i, j):
        return SOFTCAP * torch.tanh(s / SOFTCAP) + b_t[i, j]

    eye = torch.eye(3)[None, None]  # V = I: the output is the weights row
    w = flex(torch.tensor(q), torch.tensor(k), eye, score_mod=score_mod, block_mask=block, scale=1.0)
    label, ev = softcap_label(w[0, 0, 0].numpy())
    row["softcap_order"], row["evidence"]["softcap"] = f"score_mod, then block_mask: {label}", ev
    # sinks: the output rescaled by the returned log-sum-exp, against the reference's use_sinks
    from impl_numpy import multi_head_attention
    from weights import AttentionConfig

    T_, S_, H_ = 3, 5, 4
    qh, kh = _attention_inputs(T_, S_, H_)
    vh = np.random.default_rng(4).standard_normal((1, 1, S_, H_)).astype(np.float32)
    sink = np.array([0.7], np.float32)
    out, aux = flex(*(torch.tensor(a) for a in (qh, kh, vh)), return_aux=AuxRequest(lse=True))
    got = (out * torch.sigmoid(aux.lse - torch.tensor(sink)[None, :, None])[..., None]).numpy()  # (1, 1, T, H)
    cfg = AttentionConfig(num_heads=1, query_dim=H_, head_dim=H_, use_query_bias=False, use_key_bias=False,
                          use_value_bias=False, use_output_bias=False, use_sinks=True)
    eye4 = np.eye(H_).reshape(H_, 1, H_)
    tensors = {"query.kernel": eye4, "key.kernel": eye4, "value.kernel": eye4,
               "output.kernel": np.eye(H_).reshape(1, H_, H_), "sinks": sink.astype(np.float64)}
    expected = multi_head_attention(cfg, tensors, *(a[:, 0].astype(np.float64) for a in (qh, kh, vh)))  # (1, T, H)
    err = _err(got[:, 0], expected)
    row["sinks"] = (f"return_aux lse: out * sigmoid(lse - sink) (err {err:.1e})" if err <= TOL
                    else f"lse rescale does not match (err {err:.1e})")
    row["evidence"]["sinks_max_err"] = err
    return row


def _jax_dpa() -> dict:
    import jax
    import jax.numpy as jnp

    row: dict[str, Any] = {"rope_pairing": "- (no argument)", "qk_norm": "- (no argument)",
                           "softcap_order": "- (no argument)", "sinks": "- (no argument)", "evidence": {}}
    left, right = 2, 1
    q, k = _attention_inputs(WINDOW_T, WINDOW_T, H_=WINDOW_T)  # the kernel wants V's width == K's
    eye = jnp.eye(WINDOW_T, dtype=jnp.float32)[None, :, None, :]  # (B, S, N, S): V = I
    w = jax.jit(jax.nn.dot_product_attention, static_argnames=("local_window_size",))(
        jnp.asarray(q.transpose(0, 2, 1, 3)), jnp.asarray(k.transpose(0, 2, 1, 3)), eye,
        local_window_size=(left, right))  # (B, T, N, S)
    label, ev = window_label(np.asarray(w)[0, :, 0], lambda i, j: i - left <= j <= i + right)
    row["window"] = f"local_window_size=({left}, {right}): {label}"
    row["evidence"]["window"] = ev
    return row


def _keras_mha() -> dict:
    from conformance.logs import import_keras

    keras = import_keras()
    row: dict[str, Any] = {"rope_pairing": "- (no argument)", "qk_norm": "- (no argument)",
                           "softcap_order": "- (no argument)", "sinks": "- (no argument)", "evidence": {}}
    W = 3
    labels = []
    for causal in (False, True):
        layer = keras.layers.MultiHeadAttention(num_heads=1, key_dim=4, use_bias=False, sliding_window=W)
        x = np.random.default_rng(6).standard_normal((1, WINDOW_T, 4)).astype(np.float32)
        _, w = layer(x, x, return_attention_scores=True, use_causal_mask=causal)
        rule = (lambda i, j: abs(i - j) < W and j <= i) if causal else (lambda i, j: abs(i - j) < W)
        label, ev = window_label(keras.ops.convert_to_numpy(w)[0, 0], rule)
        labels.append(("with use_causal_mask: " if causal else "") + label)
        row["evidence"][f"window_causal={causal}"] = ev
    row["window"] = f"sliding_window={W}: " + "; ".join(labels)
    return row


def _flax_nnx_qk_norm() -> dict:
    """normalize_qk=True end to end in float64 against every qk_norm candidate."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from impl_numpy import multi_head_attention
    from weights import AttentionConfig

    row: dict[str, Any] = {"rope_pairing": "- (no argument)", "window": "- (mask only)",
                           "softcap_order": "- (no argument)", "sinks": "- (no argument)", "evidence": {}}
    N_, H_, L_ = 2, 4, 5
    D_ = N_ * H_
    rng = np.random.default_rng(8)
    # small, offset inputs: the mean, the variance and eps all move the result, so the candidates separate
    x = rng.standard_normal((1, L_, D_)) * 3e-3 + rng.standard_normal((1, 1, D_)) * 1e-3
    with jax.enable_x64(True):
        def identity(key, shape, dtype=jnp.float64):
            return jnp.asarray(np.eye(D_).reshape(shape), dtype)

        module = nnx.MultiHeadAttention(num_heads=N_, in_features=D_, qkv_features=D_, out_features=D_,
                                        use_bias=False, decode=False, normalize_qk=True, kernel_init=identity,
                                        out_kernel_init=identity, param_dtype=jnp.float64, dtype=jnp.float64,
                                        rngs=nnx.Rngs(0))
        # the module's attention: flax's own weights path (sow), float64 throughout
        if hasattr(nnx, "capture"):
            _, inter = nnx.capture(module, nnx.Intermediate)(jnp.asarray(x), sow_weights=True, deterministic=True)
        else:
            module(jnp.asarray(x), sow_weights=True, deterministic=True)
            inter = nnx.pop(module, nnx.Intermediate)
        w = inter["attention_weights"]
        w = np.asarray((w.get_value() if hasattr(w, "get_value") else w.value)[0])  # (B, N, T, S)
        has_bias = module.query_ln.bias is not None
    errs = {}
    for kind in ("layer", "rms"):
        for scope in ("head", "all"):
            for eps in (1e-6, 1e-5):
                cfg = AttentionConfig(num_heads=N_, query_dim=D_, head_dim=H_, use_query_bias=False,
                                      use_key_bias=False, use_value_bias=False, use_output_bias=False,
                                      qk_norm={"type": kind, "scope": scope, "eps": eps})
                shape = (H_,) if scope == "head" else (N_, H_)
                eye = np.eye(D_).reshape(D_, N_, H_)
                tensors = {"query.kernel": eye, "key.kernel": eye, "value.kernel": eye,
                           "output.kernel": np.eye(D_).reshape(N_, H_, D_)}
                for name in ("query", "key"):
                    tensors[f"{name}.norm.scale"] = np.ones(shape)
                    if kind == "layer":
                        tensors[f"{name}.norm.bias"] = np.zeros(shape)
                _, ref_w = multi_head_attention(cfg, tensors, x, return_weights=True)
                errs[(kind, scope, eps)] = _err(w, ref_w)
    best = min(errs, key=errs.get)
    row["evidence"]["qk_norm"] = {f"{k}/{s}/eps={e:g}": v for (k, s, e), v in errs.items()}
    row["evidence"]["qk_norm_has_bias"] = has_bias
    if errs[best] > 1e-9:
        row["qk_norm"] = f"normalize_qk: no candidate matches (best {best}, err {errs[best]:.1e})"
    else:
        kind, scope, eps = best
        row["qk_norm"] = (f"normalize_qk: {'LayerNorm' if kind == 'layer' else 'RMSNorm'} per "
                          f"{'head (H)' if scope == 'head' else 'all heads (N*H)'}, eps {eps:g}, "
                          f"{'with' if has_bias else 'no'} bias (err {errs[best]:.1e})")
    return row


ONNX_WINDOW_OPSET = 25


def _onnx_window_model(left: int, right: int):
    from onnx import TensorProto, helper

    info = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))  # noqa: E731
    T_ = WINDOW_T
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], left_window_size=left, right_window_size=right)
    graph = helper.make_graph([node], "window", [info("Q", (1, 1, T_, 4)), info("K", (1, 1, T_, 4)),
                                                 info("V", (1, 1, T_, T_))], [info("Y", (1, 1, T_, T_))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_WINDOW_OPSET)], ir_version=11)


def _onnx_softcap_model():
    from onnx import TensorProto, helper

    info = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))  # noqa: E731
    node = helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"], softcap=SOFTCAP, scale=1.0)
    graph = helper.make_graph([node], "softcap", [info("Q", (1, 1, 1, 1)), info("K", (1, 1, 3, 1)),
                                                  info("V", (1, 1, 3, 3)), info("M", (1, 3))],
                              [info("Y", (1, 1, 1, 3))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)


def _onnx_rope_model(interleaved: int):
    from onnx import TensorProto, helper

    info = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))  # noqa: E731
    half = ROPE_H // 2
    node = helper.make_node("RotaryEmbedding", ["X", "C", "S"], ["Y"], interleaved=interleaved)
    graph = helper.make_graph([node], "rope", [info("X", (1, 1, ROPE_L, ROPE_H)), info("C", (1, ROPE_L, half)),
                                               info("S", (1, ROPE_L, half))], [info("Y", (1, 1, ROPE_L, ROPE_H))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)


def _onnx(kind: str) -> dict:
    """kind "onnxruntime" or "reference"."""
    def run(model, feeds):
        if kind == "onnxruntime":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.log_severity_level = 3
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            return session.run(None, feeds)[0]
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(model).run(None, feeds)[0]

    row: dict[str, Any] = {"qk_norm": "- (no argument)", "sinks": "- (no input up to opset 25)", "evidence": {}}
    # window (opset 25)
    left, right = 2, 1
    q, k = _attention_inputs(WINDOW_T, WINDOW_T)
    try:
        w = run(_onnx_window_model(left, right), {"Q": q, "K": k, "V": np.eye(WINDOW_T, dtype=np.float32)[None, None]})
        label, ev = window_label(w[0, 0], lambda i, j: i - left <= j <= i + right)
        row["window"] = f"left/right_window_size=({left}, {right}): {label}"
        row["evidence"]["window"] = ev
    except Exception as err:  # noqa: BLE001 - the runtime's refusal is the measured fact
        row["window"] = f"n/a: opset {ONNX_WINDOW_OPSET} left_window_size: {_short(err)}"
    # softcap (opset 23)
    q, k, bias = softcap_inputs()
    w = run(_onnx_softcap_model(), {"Q": q, "K": k, "V": np.eye(3, dtype=np.float32)[None, None], "M": bias})
    row["softcap_order"], row["evidence"]["softcap"] = softcap_label(w[0, 0, 0])
    # RoPE (RotaryEmbedding, opset 23): cos/sin tables from the frequencies, pairing from the attribute
    x = rope_inputs()
    inv_freq = ROPE_THETA ** (-np.arange(0, ROPE_H, 2, dtype=np.float64) / ROPE_H)
    angles = np.arange(ROPE_L)[:, None] * inv_freq  # (L, H/2)
    feeds = {"X": x, "C": np.cos(angles)[None].astype(np.float32), "S": np.sin(angles)[None].astype(np.float32)}
    labels = []
    for attr in (0, 1):
        label, ev = pairing_label(run(_onnx_rope_model(attr), feeds), x)
        labels.append(f"interleaved={attr}: {label}")
        row["evidence"][f"rope_interleaved={attr}"] = ev
    row["rope_pairing"] = "RotaryEmbedding " + "; ".join(labels)
    return row


def _transformers_rope() -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=ROPE_H, num_attention_heads=1, num_key_value_heads=1, head_dim=ROPE_H)
    x = rope_inputs()
    xt = torch.tensor(x)
    cos, sin = LlamaRotaryEmbedding(config)(xt, torch.arange(ROPE_L)[None])  # default theta 10000
    rotated, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    label, ev = pairing_label(rotated.numpy(), x)
    return {"rope_pairing": f"apply_rotary_pos_emb (Llama): {label}", "evidence": {"rope": ev}}


def _keras_hub_rope() -> dict:
    from conformance.logs import import_keras

    keras = import_keras()
    from keras_hub.layers import RotaryEmbedding

    x = rope_inputs()
    layer = RotaryEmbedding(max_wavelength=int(ROPE_THETA))
    rotated = keras.ops.convert_to_numpy(layer(x.transpose(0, 2, 1, 3)))  # (B, L, heads, H): sequence_axis=1
    label, ev = pairing_label(rotated.transpose(0, 2, 1, 3), x)
    return {"rope_pairing": f"RotaryEmbedding: {label}", "evidence": {"rope": ev}}


def _torchtune_rope() -> dict:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchtune.modules import RotaryPositionalEmbeddings

    x = rope_inputs()
    module = RotaryPositionalEmbeddings(dim=ROPE_H, max_seq_len=ROPE_L, base=int(ROPE_THETA))
    rotated = module(torch.tensor(x.transpose(0, 2, 1, 3))).numpy()  # (B, L, heads, H)
    label, ev = pairing_label(rotated.transpose(0, 2, 1, 3), x)
    return {"rope_pairing": f"RotaryPositionalEmbeddings: {label}", "evidence": {"rope": ev}}


TORCH_EXTRA = "pip install -c constraints/cpu.txt '.[torch]'"
TF_EXTRA = "pip install -c constraints/cpu.txt '.[tf]'"
JAX_EXTRA = "pip install -c constraints/cpu.txt '.[jax]'"
ONNX_EXTRA = "pip install -c constraints/cpu.txt '.[onnx]'"

APIS: tuple[ModernApi, ...] = (
    ModernApi("torch flex_attention", "torch", ("torch",), TORCH_EXTRA, _torch_flex),
    ModernApi("keras MultiHeadAttention", "keras", ("keras", "tensorflow"), TF_EXTRA, _keras_mha),
    ModernApi("flax.nnx.MultiHeadAttention", "jax", ("jax", "flax"), JAX_EXTRA, _flax_nnx_qk_norm),
    ModernApi("jax.nn.dot_product_attention", "jax", ("jax",), JAX_EXTRA, _jax_dpa),
    ModernApi("onnxruntime (Attention, RotaryEmbedding; CPU)", "onnxruntime", ("onnx", "onnxruntime"), ONNX_EXTRA,
              lambda: _onnx("onnxruntime")),
    ModernApi("onnx.reference (Attention, RotaryEmbedding)", "onnx", ("onnx",), ONNX_EXTRA, lambda: _onnx("reference")),
    ModernApi("transformers (Llama rotary)", "transformers", ("transformers", "torch"),
              "pip install -c constraints/cpu.txt '.[hf,torch]'", _transformers_rope),
    ModernApi("keras-hub", "keras", ("keras_hub",), "pip install -c constraints/cpu.txt '.[keras-hub]'",
              _keras_hub_rope),
    ModernApi("torchtune", "torch", ("torchtune",), "pip install -c constraints/cpu.txt '.[torchtune]'",
              _torchtune_rope),
)


def measure_row(api: ModernApi, keys: tuple[str, ...] = KEYS, evidence: Callable[[Any], Any] = lambda e: e) -> dict:
    """One row; never raises (a missing package is "not installed", a failure is recorded). keys: the
    table's columns; evidence: applied to the probe's evidence (conventions_packed makes it JSON-safe)."""
    row: dict[str, Any] = {"api": api.name, "framework": api.framework, "evidence": {}}
    missing = [m for m in api.modules if importlib.util.find_spec(m) is None]
    if missing:
        row.update(status="not installed", reason=f"{', '.join(missing)} not installed ({api.install})")
        return row
    started = time.perf_counter()
    try:
        got = api.measure()
    except Exception as err:  # noqa: BLE001
        row.update(status="error", reason=_short(err))
        return row
    row["status"] = "measured"
    row["evidence"] = evidence(got.pop("evidence", {}))
    row.update({key: got.get(key, NONE) for key in keys})
    row["seconds"] = round(time.perf_counter() - started, 3)
    return row


def measure(apis: tuple[ModernApi, ...] | None = None) -> list[dict]:
    from conformance.logs import quiet_python_loggers

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    rows = []
    for api in APIS if apis is None else apis:
        rows.append(measure_row(api))
        quiet_python_loggers()
    return rows


def cells(rows: list[dict], columns: tuple[tuple[str, str], ...] = COLUMNS) -> list[list[str]]:
    out = []
    for row in rows:
        if row.get("status") != "measured":
            first = row["status"] if row["status"] == "not installed" else f"{row['status']}: {row.get('reason', '')}"
            out.append([row["api"], first] + [""] * (len(columns) - 2))
        else:
            out.append([str(row.get(key, NONE)) for _, key in columns])
    return out


def notes(rows: list[dict]) -> list[str]:
    return [f"{row['api']}: {row.get('reason', '')}" for row in rows if row.get("status") == "not installed"]


def versions() -> dict[str, str]:
    found = {}
    for name in ("transformers", "keras_hub", "torchtune"):
        if name in sys.modules:
            found[name.replace("_", "-")] = getattr(sys.modules[name], "__version__", "?")
    return found
