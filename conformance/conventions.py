"""Measured conventions of each framework's own attention API.

`mha check --conventions` prints this table. Nothing in it is typed in: every
cell comes from running the native API in this process and comparing its
output with the NumPy reference (impl_numpy) on the same q, k, v.

What is measured, per API:
  mask polarity      a bool mask with a known pattern; does the output match
                     reference(allowed=mask) ("attend") or
                     reference(allowed=~mask) ("masked")?
  fully masked row   one query row with every key masked in the API's own
                     polarity; its output is classified against the
                     reference's three masked_row policies ("0", "mean of V
                     (uniform)", "NaN") and its weights row, where the API
                     returns weights.
  causal, T != S     is_causal (or the API's equivalent) with T=2, S=4 and
                     T=4, S=2: top_left (j <= i) or bottom_right
                     (j <= i + S - T) of the reference.
  float32 matmul     a (256, 1024) x (1024, 256) float32 matmul with the
                     framework's default settings on each device present,
                     against float64: relative error near 1e-7 is float32,
                     near 1e-3 is TF32/bf16 (reduced).

The modern arguments (RoPE pairing, what a window argument's value means in
keys visible, softcap before or after the mask, sinks, the QK-norm option)
are a second table, measured by conformance/conventions_modern.py in the same
run; the native packed and sharded paths (jax's seq lengths, flex_attention
document masks, torch's context_parallel and DTensor heads on 2 gloo
processes) a third, by conformance/conventions_packed.py.

Layers get identity projections without biases (D = N*H), so their output is
the attention itself, merged over heads, and compares directly with the
reference's. JAX APIs run under jax.jit: one XLA compile per call signature
instead of one per primitive, which keeps the whole run near 10 s.

The project's recorded expectations (conventions_expected.json beside this
module: the frameworks' documented behaviour, or an earlier measurement where
they document none) never reach a cell; they only list where the measurement
disagrees with them.

Shape letters as in impl_numpy: B batch, T query length, S key length,
N heads, H head dim, D = N*H features.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.backends import import_keras, quiet_python_loggers

B, T, S, N, H = 2, 4, 5, 2, 4
D = N * H
CAUSAL_SHAPES = ((2, 4), (4, 2))  # (T, S) pairs for the causal test
EMPTY_ROW = (0, 1)  # (b, t): the query row whose keys are all masked
TOL = 1e-4  # float32 API vs float64 reference; a wrong convention misses by > 1e-2
MATMUL_SHAPE = (256, 1024, 256)  # (M, K, N) of the precision probe
FLOAT32_REL_ERR_MAX = 1e-5  # above this a float32 matmul was computed with fewer mantissa bits

POLICY_LABELS = {"zero": "0", "uniform": "mean of V (uniform)", "nan": "NaN"}
NOT_INSTALLED = "not installed"


class NotExpressible(Exception):
    """The API has no way to express what the measurement asks for."""


# -- inputs and the reference ----------------------------------------------------

def _inputs(T_: int, S_: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T_, D)).astype(np.float32)  # (B, T, D)
    k = rng.standard_normal((B, S_, D)).astype(np.float32)  # (B, S, D)
    v = rng.standard_normal((B, S_, D)).astype(np.float32)  # (B, S, D)
    return q, k, v


def full_pattern(T_: int = T, S_: int = S) -> np.ndarray:
    """(B, T, S) bool; every row holds both values, so neither the mask nor its
    complement empties a row (S >= 3)."""
    b, t, s = np.ogrid[:B, :T_, :S_]
    return (b + 2 * t + s) % 3 != 0


def key_pattern(S_: int = S) -> np.ndarray:
    """(B, S) bool, both values in every batch."""
    b, s = np.ogrid[:B, :S_]
    return (b + s) % 3 != 0


def _identity_tensors(dtype=np.float64) -> dict[str, np.ndarray]:
    eye = np.eye(D, dtype=dtype)
    return {
        "query.kernel": eye.reshape(D, N, H), "key.kernel": eye.reshape(D, N, H),
        "value.kernel": eye.reshape(D, N, H), "output.kernel": eye.reshape(N, H, D),
    }


def _config(masked_row: str = "zero"):
    from weights import AttentionConfig

    return AttentionConfig(num_heads=N, query_dim=D, head_dim=H, use_query_bias=False, use_key_bias=False,
                           use_value_bias=False, use_output_bias=False, masked_row=masked_row)


def reference(q, k, v, *, allowed=None, is_causal=False, alignment="top_left", masked_row="zero", dtype=np.float64):
    """impl_numpy's forward with identity projections: (output (B, T, D), weights (B, N, T, S))."""
    from impl_numpy import multi_head_attention

    mask4 = None if allowed is None else np.asarray(allowed, dtype=bool)[:, None]  # (B, 1, T, S)
    cast = [np.asarray(x, dtype=dtype) for x in (q, k, v)]
    return multi_head_attention(_config(masked_row), _identity_tensors(dtype), *cast, mask=mask4, is_causal=is_causal,
                                causal_alignment=alignment, return_weights=True)


def _max_err(a, b) -> float:
    """Max abs difference; NaN anywhere (in either) counts as infinitely far."""
    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    if d.size == 0:
        return 0.0
    return float("inf") if np.isnan(d).any() else float(d.max())


def _num(x: float) -> float | str:
    """JSON-safe number: non-finite values become strings."""
    x = float(x)
    return x if np.isfinite(x) else str(x)


def _short(err: BaseException) -> str:
    """The exception's type and first sentence."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= 160 else text[:157] + "..."


# -- the APIs ----------------------------------------------------------------------

@dataclasses.dataclass
class Runner:
    """A native API wrapped to take (B, T, D) float32 q, k, v and native masks.

    run(q, k, v, masks, causal) -> (output (B, T, D), weights (B, N, T, S) or None).
    masks maps an argument name of `mask_args` to a native bool mask: (B, T, S)
    for kind "full", (B, S) for kind "key". The first argument is the one the
    fully-masked-row test uses.
    """

    run: Callable[..., tuple[np.ndarray, np.ndarray | None]]
    mask_args: dict[str, str]
    returns_weights: bool
    self_attention_only: bool = False  # q, k, v must be one tensor (so T == S)
    extra: Callable[[], dict] | None = None  # API-specific extra measurements (notes, evidence)
    tolerance: float = TOL  # a half-precision kernel's rows are judged with its own (conventions_kernels.py)


@dataclasses.dataclass
class Api:
    name: str
    framework: str  # the framework key of versions / matmul precision
    modules: tuple[str, ...]  # importable modules it needs; missing -> "not installed"
    install: str  # the extra that installs it
    build: Callable[[], Runner]


# torch ------------------------------------------------------------------------

def _torch_mha(fast_path: bool) -> Runner:
    import torch

    # Fast path (torch._native_multi_head_attention) needs self-attention, eval,
    # no grad, and in_proj_bias present; the default call (need_weights=True)
    # takes the Python path.
    mha = torch.nn.MultiheadAttention(D, N, bias=fast_path, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(D).repeat(3, 1))  # [Wq; Wk; Wv] = [I; I; I], (3D, D)
        mha.out_proj.weight.copy_(torch.eye(D))
        if fast_path:
            mha.in_proj_bias.zero_()
            mha.out_proj.bias.zero_()
    mha.eval()
    calls = {"native": 0}

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        masks = masks or {}
        kwargs: dict[str, Any] = {}
        if "attn_mask" in masks:
            m = torch.as_tensor(masks["attn_mask"])  # (B, T, S)
            kwargs["attn_mask"] = m.repeat_interleave(N, dim=0)  # (B*N, T, S), index b*N + n
        if "key_padding_mask" in masks:
            kwargs["key_padding_mask"] = torch.as_tensor(masks["key_padding_mask"])  # (B, S)
        if causal:
            kwargs["is_causal"] = True  # with no attn_mask: what torch does with it is the measurement
        if fast_path:
            x = torch.as_tensor(q)
            native = torch._native_multi_head_attention

            def counting(*a, **kw):
                calls["native"] += 1
                return native(*a, **kw)

            torch._native_multi_head_attention = counting
            try:
                with torch.inference_mode():
                    out, w = mha(x, x, x, need_weights=False, **kwargs)
            finally:
                torch._native_multi_head_attention = native
            return out.numpy(), None
        with torch.no_grad():
            out, w = mha(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), need_weights=True,
                         average_attn_weights=False, **kwargs)
        return out.numpy(), w.numpy()

    def extra():
        if not fast_path:
            return {}
        taken = (f"taken: torch._native_multi_head_attention called {calls['native']} times" if calls["native"]
                 else "NOT taken: torch._native_multi_head_attention never called")
        return {"evidence": {"fast_path_calls": calls["native"]},
                "notes": [f"self-attention, eval, inference_mode, need_weights=False; fast path {taken}"]}

    return Runner(run, {"attn_mask": "full", "key_padding_mask": "key"}, returns_weights=not fast_path,
                  self_attention_only=fast_path, extra=extra)


def _split(x: np.ndarray) -> np.ndarray:
    Bx, L, _ = x.shape
    return x.reshape(Bx, L, N, H)  # (B, L, N, H)


def _merge(x: np.ndarray) -> np.ndarray:
    Bx, L = x.shape[:2]
    return x.reshape(Bx, L, N * H)  # (B, L, D)


def _torch_sdpa() -> Runner:
    import torch
    import torch.nn.functional as F

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        qt, kt, vt = (torch.as_tensor(_split(x)).transpose(1, 2) for x in (q, k, v))  # (B, N, L, H)
        mask = None
        if masks and "attn_mask" in masks:
            mask = torch.as_tensor(masks["attn_mask"])[:, None]  # (B, 1, T, S)
        with torch.no_grad():
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal)  # (B, N, T, H)
        return _merge(out.transpose(1, 2).numpy()), None

    return Runner(run, {"attn_mask": "full"}, returns_weights=False)


# keras --------------------------------------------------------------------------

def _keras_mha(return_scores: bool) -> Runner:
    keras = import_keras()

    layer = keras.layers.MultiHeadAttention(num_heads=N, key_dim=H, use_bias=False)
    layer.build((B, T, D), (B, S, D), (B, S, D))
    eye = np.eye(D, dtype=np.float32)
    for dense, kernel in ((layer.query_dense, eye.reshape(D, N, H)), (layer.key_dense, eye.reshape(D, N, H)),
                          (layer.value_dense, eye.reshape(D, N, H)), (layer.output_dense, eye.reshape(N, H, D))):
        if tuple(dense.kernel.shape) != kernel.shape:
            raise RuntimeError(f"unexpected keras kernel shape {tuple(dense.kernel.shape)}, expected {kernel.shape}")
        dense.kernel.assign(kernel)

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        mask = None if not masks else masks.get("attention_mask")  # (B, T, S)
        result = layer(q, v, key=k, attention_mask=mask, return_attention_scores=return_scores,
                       use_causal_mask=causal)
        if return_scores:
            out, w = result
            return keras.ops.convert_to_numpy(out), keras.ops.convert_to_numpy(w)
        return keras.ops.convert_to_numpy(result), None

    return Runner(run, {"attention_mask": "full"}, returns_weights=return_scores)


# jax / flax -----------------------------------------------------------------------

def _flax_linen() -> Runner:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    module = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=D, out_features=D, use_bias=False)
    eye = np.eye(D, dtype=np.float32)
    params = {"query": {"kernel": eye.reshape(D, N, H)}, "key": {"kernel": eye.reshape(D, N, H)},
              "value": {"kernel": eye.reshape(D, N, H)}, "out": {"kernel": eye.reshape(N, H, D)}}
    evidence: dict[str, Any] = {}

    # jit: one XLA compile per call signature instead of one per primitive (eager JAX)
    @functools.partial(jax.jit, static_argnames=("sow",))
    def call(q, k, v, mask, sow):
        if not sow:
            return module.apply({"params": params}, q, k, v, mask=mask), None
        out, state = module.apply({"params": params}, q, k, v, mask=mask, sow_weights=True, mutable=["intermediates"])
        return out, state["intermediates"]["attention_weights"][0]  # (B, N, T, S)

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        if causal:
            raise NotExpressible("no causal flag; mask only (nn.make_causal_mask is square, from one sequence)")
        mask = None
        if masks and "mask" in masks:
            mask = jnp.asarray(masks["mask"])[:, None]  # (B, 1, T, S)
        out, _ = call(q, k, v, mask, sow=False)
        if not want_weights:
            return np.asarray(out), None
        out_sow, w = call(q, k, v, mask, sow=True)
        evidence["sow_weights_vs_default_output_max_err"] = _num(_max_err(out_sow, out))
        return np.asarray(out), np.asarray(w)

    return Runner(run, {"mask": "full"}, returns_weights=True, extra=lambda: {"evidence": dict(evidence)})


def _flax_nnx() -> Runner:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    eye = np.eye(D, dtype=np.float32)

    def identity(key, shape, dtype=jnp.float32):  # no random init: the kernels are the identity
        if int(np.prod(shape)) != D * D:
            raise RuntimeError(f"unexpected nnx kernel shape {shape}, expected D*D = {D * D} elements")
        return jnp.asarray(eye.reshape(shape), dtype)

    module = nnx.MultiHeadAttention(num_heads=N, in_features=D, qkv_features=D, out_features=D, use_bias=False,
                                    decode=False, kernel_init=identity, out_kernel_init=identity, rngs=nnx.Rngs(0))
    for dense, shape in ((module.query, (D, N, H)), (module.key, (D, N, H)), (module.value, (D, N, H)),
                         (module.out, (N, H, D))):
        if tuple(dense.kernel.shape) != shape:
            raise RuntimeError(f"unexpected nnx kernel shape {tuple(dense.kernel.shape)}, expected {shape}")
    graphdef, state = nnx.split(module)
    evidence: dict[str, Any] = {}

    @functools.partial(jax.jit, static_argnames=("causal", "sow"))
    def call(state, q, k, v, mask, causal, sow):
        m = nnx.merge(graphdef, state)
        # without sow_weights the module calls jax.nn.dot_product_attention; with it, flax's own weights path
        if not sow:
            return m(q, k, v, mask=mask, is_causal=causal), None
        if hasattr(nnx, "capture"):  # flax >= 0.12: sow only inside nnx.capture
            out, inter = nnx.capture(m, nnx.Intermediate)(q, k, v, mask=mask, is_causal=causal, sow_weights=True)
        else:
            out = m(q, k, v, mask=mask, is_causal=causal, sow_weights=True)
            inter = nnx.pop(m, nnx.Intermediate)
        return out, inter["attention_weights"].get_value()[0]  # (B, N, T, S)

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        mask = None
        if masks and "mask" in masks:
            mask = jnp.asarray(masks["mask"])[:, None]  # (B, 1, T, S)
        out, _ = call(state, q, k, v, mask, causal=causal, sow=False)
        if not want_weights:
            return np.asarray(out), None
        out_sow, w = call(state, q, k, v, mask, causal=causal, sow=True)
        evidence["sow_weights_vs_default_output_max_err"] = _num(_max_err(out_sow, out))
        return np.asarray(out), np.asarray(w)

    return Runner(run, {"mask": "full"}, returns_weights=True, extra=lambda: {"evidence": dict(evidence)})


def _jax_dpa() -> Runner:
    import jax
    import jax.numpy as jnp

    call = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal",))

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        mask = None
        if masks and "mask" in masks:
            mask = jnp.asarray(masks["mask"])[:, None]  # (B, 1, T, S)
        out = call(_split(q), _split(k), _split(v), mask=mask, is_causal=causal)  # (B, T, N, H)
        return _merge(np.asarray(out)), None

    return Runner(run, {"mask": "full"}, returns_weights=False)


# onnx -------------------------------------------------------------------------------

ONNX_OPSET = 23
ONNX_IR_VERSION = 11  # the IR of opset 23; onnx 1.23 writes IR 14 by default, which onnxruntime 1.30 refuses (max 13)


def _onnx_attention_model(T_: int, S_: int, *, has_mask: bool, is_causal: bool, past: int = 0):
    """One opset-23 Attention node on 4-D (B, N, L, H) inputs; qk_matmul_output_mode=3 returns the weights.
    past > 0: that many of the S keys come as past_key/past_value (a cache), the rest as K/V."""
    from onnx import TensorProto, helper

    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, list(shape))

    new = S_ - past
    inputs = [info("Q", TensorProto.FLOAT, (B, N, T_, H)), info("K", TensorProto.FLOAT, (B, N, new, H)),
              info("V", TensorProto.FLOAT, (B, N, new, H))]
    names = ["Q", "K", "V", ""]
    if has_mask:
        inputs.append(info("attn_mask", TensorProto.BOOL, (B, 1, T_, S_)))
        names[3] = "attn_mask"
    if past:
        inputs += [info("past_key", TensorProto.FLOAT, (B, N, past, H)), info("past_value", TensorProto.FLOAT, (B, N, past, H))]
        names += ["past_key", "past_value"]
    while names[-1] == "":
        names.pop()
    out_names = ["Y", "present_key" if past else "", "present_value" if past else "", "W"]
    outputs = [info("Y", TensorProto.FLOAT, (B, N, T_, H)), info("W", TensorProto.FLOAT, (B, N, T_, S_))]
    if past:
        outputs += [info("present_key", TensorProto.FLOAT, (B, N, S_, H)), info("present_value", TensorProto.FLOAT, (B, N, S_, H))]
    node = helper.make_node("Attention", names, out_names, is_causal=int(is_causal), qk_matmul_output_mode=3)
    graph = helper.make_graph([node], "attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)], ir_version=ONNX_IR_VERSION)


def _onnx_runner(kind: str) -> Runner:
    """kind "onnxruntime" (CPUExecutionProvider) or "reference" (onnx.reference.ReferenceEvaluator)."""
    import onnx

    sessions: dict = {}

    def session(T_, S_, has_mask, is_causal, past):
        key = (T_, S_, has_mask, is_causal, past)
        if key not in sessions:
            model = _onnx_attention_model(T_, S_, has_mask=has_mask, is_causal=is_causal, past=past)
            onnx.checker.check_model(model)
            if kind == "onnxruntime":
                import onnxruntime as ort

                sessions[key] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            else:
                from onnx.reference import ReferenceEvaluator

                sessions[key] = ReferenceEvaluator(model)
        return sessions[key]

    def run(q, k, v, masks=None, causal=False, want_weights=True, past=0):
        T_, S_ = q.shape[1], k.shape[1]
        feeds = {}
        qh, kh, vh = (np.ascontiguousarray(_split(x).transpose(0, 2, 1, 3)) for x in (q, k, v))  # (B, N, L, H)
        feeds["Q"] = qh
        feeds["K"], feeds["V"] = kh[:, :, past:], vh[:, :, past:]
        if past:
            feeds["past_key"], feeds["past_value"] = kh[:, :, :past], vh[:, :, :past]
        has_mask = bool(masks and "attn_mask" in masks)
        if has_mask:
            feeds["attn_mask"] = np.asarray(masks["attn_mask"])[:, None]  # (B, 1, T, S)
        sess = session(T_, S_, has_mask, causal, past)
        results = sess.run(None, feeds)
        names = [o.name for o in (sess.get_outputs() if kind == "onnxruntime" else sess.proto_.graph.output)]
        got = dict(zip(names, results))
        return _merge(got["Y"].transpose(0, 2, 1, 3)), got["W"]  # (B, T, D), (B, N, T, S)

    try:  # can this runtime run an opset-23 Attention node at all?
        run(*_inputs(T, S, seed=0))
    except Exception as err:  # noqa: BLE001
        raise NotExpressible(f"{kind} cannot run an opset-{ONNX_OPSET} Attention node: {_short(err)}") from None

    def extra():
        # ONNX's T != S comes from a cache: 2 keys as past_key/past_value + 2 new, T = 2 queries.
        T_, S_ = 2, 4
        q, k, v = _inputs(T_, S_, seed=13)
        try:
            out, _ = run(q, k, v, causal=True, want_weights=False, past=S_ - T_)
            label, ev = _causal_label(out, q, k, v)
        except Exception as err:  # noqa: BLE001 - any failure is the measured fact
            label, ev = f"n/a: {_short(err)}", {}
        return {"causal_T2_S4_past_cache": label,
                "notes": [f"is_causal with past_key/past_value (2 cached + 2 new keys, T=2): {label}"],
                "evidence": {"causal_T2_S4_past_cache": ev}}

    return Runner(run, {"attn_mask": "full"}, returns_weights=True, extra=extra)


# numpy reference -----------------------------------------------------------------------

def _numpy_reference(policy: str) -> Runner:
    def run(q, k, v, masks=None, causal=False, want_weights=True):
        allowed = None if not masks else masks.get("mask")
        return reference(q, k, v, allowed=allowed, is_causal=causal, masked_row=policy, dtype=np.float32)

    return Runner(run, {"mask": "full"}, returns_weights=True)


TORCH_EXTRA = "pip install -c constraints/cpu.txt '.[torch]'"
TF_EXTRA = "pip install -c constraints/cpu.txt '.[tf]'"
JAX_EXTRA = "pip install -c constraints/cpu.txt '.[jax]'"
ONNX_EXTRA = "pip install -c constraints/cpu.txt '.[onnx]'"

APIS: tuple[Api, ...] = (
    Api("torch nn.MultiheadAttention", "torch", ("torch",), TORCH_EXTRA, lambda: _torch_mha(fast_path=False)),
    Api("torch nn.MultiheadAttention (fast path)", "torch", ("torch",), TORCH_EXTRA, lambda: _torch_mha(fast_path=True)),
    Api("torch F.scaled_dot_product_attention", "torch", ("torch",), TORCH_EXTRA, _torch_sdpa),
    Api("keras MultiHeadAttention (fused)", "keras", ("keras", "tensorflow"), TF_EXTRA,
        lambda: _keras_mha(return_scores=False)),
    Api("keras MultiHeadAttention (return_attention_scores=True)", "keras", ("keras", "tensorflow"), TF_EXTRA,
        lambda: _keras_mha(return_scores=True)),
    Api("flax.linen.MultiHeadDotProductAttention", "jax", ("jax", "flax"), JAX_EXTRA, _flax_linen),
    Api("flax.nnx.MultiHeadAttention", "jax", ("jax", "flax"), JAX_EXTRA, _flax_nnx),
    Api("jax.nn.dot_product_attention", "jax", ("jax",), JAX_EXTRA, _jax_dpa),
    Api("onnxruntime Attention (opset 23, CPU)", "onnxruntime", ("onnx", "onnxruntime"), ONNX_EXTRA,
        lambda: _onnx_runner("onnxruntime")),
    Api("onnx.reference Attention (opset 23)", "onnx", ("onnx",), ONNX_EXTRA, lambda: _onnx_runner("reference")),
    *(Api(f"numpy reference (masked_row={p})", "numpy", ("numpy",), "(always installed)",
          lambda p=p: _numpy_reference(p)) for p in ("zero", "uniform", "nan")),
)

# The project's recorded expectations, a data file shipped beside this module
# (package data) so a clone or an installed wheel has them; see its "about".
EXPECTED_FILE = "conventions_expected.json"
EXPECTED_SOURCE = f"the recorded expectations (conformance/{EXPECTED_FILE})"
# Row keys an expectation may name: the table's columns and the extra
# measurements some runners add (ONNX's past-cache causal alignment).
EXPECTED_KEYS = ("mask_true_means", "fully_masked_row", "fully_masked_weights", "causal_T2_S4", "causal_T4_S2",
                 "causal_T2_S4_past_cache", "rope_pairing", "window", "softcap_order", "sinks", "qk_norm",
                 "keys_visible", "empty_row", "packing")


def parse_expected(text: str) -> dict[str, dict[str, str]]:
    """API name -> {row key: expected value} from EXPECTED_FILE's text; a
    malformed file is a one-line ValueError."""
    import json

    try:
        apis = json.loads(text)["apis"]
        table = {str(api): {str(k): str(v) for k, v in entry["expect"].items()} for api, entry in apis.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"conformance/{EXPECTED_FILE}: malformed: {type(err).__name__}: {err}") from None
    for api, expect in table.items():
        unknown = sorted(set(expect) - set(EXPECTED_KEYS))
        if unknown:
            raise ValueError(f"conformance/{EXPECTED_FILE}: {api!r} names unknown keys {unknown} "
                             f"(known: {', '.join(EXPECTED_KEYS)})")
    return table


@functools.cache
def expected() -> dict[str, dict[str, str]]:
    """The recorded expectations, read once from the package's data file.
    Only used to list disagreements."""
    import importlib.resources

    resource = importlib.resources.files("conformance") / EXPECTED_FILE
    try:
        text = resource.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"conformance/{EXPECTED_FILE}: cannot read: {err}") from None
    return parse_expected(text)


# -- the measurements ------------------------------------------------------------------

def _polarity(runner: Runner, arg: str, kind: str, q, k, v) -> tuple[str, dict]:
    if kind == "full":
        pattern = full_pattern(q.shape[1], k.shape[1])  # (B, T, S)
        as_allowed = lambda m: m  # noqa: E731
    else:
        pattern = key_pattern(k.shape[1])  # (B, S)
        as_allowed = lambda m: np.broadcast_to(m[:, None, :], (B, q.shape[1], k.shape[1]))  # noqa: E731
    out, _ = runner.run(q, k, v, masks={arg: pattern}, want_weights=False)
    errs = {
        "attend": _max_err(out, reference(q, k, v, allowed=as_allowed(pattern))[0]),
        "masked": _max_err(out, reference(q, k, v, allowed=as_allowed(~pattern))[0]),
        "ignored": _max_err(out, reference(q, k, v)[0]),
    }
    return _pick(errs, runner.tolerance), {f"max_err_if_true_{name}": _num(e) for name, e in errs.items()}


def _pick(errs: dict[str, float], tol: float = TOL) -> str:
    """The one candidate within tol; "other" if none, "ambiguous: a / b" if several."""
    hits = [name for name, err in errs.items() if err <= tol]
    if not hits:
        return "other"
    return hits[0] if len(hits) == 1 else "ambiguous: " + " / ".join(hits)


def _classify_row(row: np.ndarray, candidates: dict[str, np.ndarray], tol: float = TOL) -> tuple[str, float | str]:
    """row vs the reference's masked_row policies: (label, max error of the match)."""
    row = np.asarray(row, dtype=np.float64)
    if np.isnan(row).all():
        return POLICY_LABELS["nan"], 0.0
    if np.isnan(row).any():
        return f"partly NaN ({int(np.isnan(row).sum())} of {row.size})", "nan"
    errs = {policy: _max_err(row, ref) for policy, ref in candidates.items() if policy != "nan"}
    best = min(errs, key=errs.get)
    if errs[best] <= tol:
        return POLICY_LABELS[best], _num(errs[best])
    values = " ".join(f"{x:.3g}" for x in row.reshape(-1)[:4])
    return f"other ({values} ...)", _num(errs[best])


def _classify_weights(row: np.ndarray, S_: int, tol: float = TOL) -> tuple[str, float | str]:
    row = np.asarray(row, dtype=np.float64)  # (N, S)
    if np.isnan(row).all():
        return "NaN", 0.0
    if np.isnan(row).any():
        return f"partly NaN ({int(np.isnan(row).sum())} of {row.size})", "nan"
    for label, target in (("0", 0.0), ("uniform (1/S)", 1.0 / S_)):
        err = _max_err(row, np.full_like(row, target))
        if err <= tol:
            return label, _num(err)
    return "other (" + " ".join(f"{x:.3g}" for x in row.reshape(-1)[:4]) + " ...)", "n/a"


def _fully_masked(runner: Runner, arg: str, kind: str, polarity: str, q, k, v) -> dict:
    b0, t0 = EMPTY_ROW
    T_, S_ = q.shape[1], k.shape[1]
    if kind == "full":
        allowed = full_pattern(T_, S_)
        allowed[b0, t0, :] = False
        empty = np.zeros((B, T_), bool)
        empty[b0, t0] = True
        native = allowed
        allowed_full = allowed
    else:
        allowed = key_pattern(S_)
        allowed[b0, :] = False  # every key of batch b0 is padding: all its rows are empty
        empty = np.zeros((B, T_), bool)
        empty[b0, :] = True
        native = allowed
        allowed_full = np.broadcast_to(allowed[:, None, :], (B, T_, S_))
    if polarity == "masked":
        native = ~native
    out, w = runner.run(q, k, v, masks={arg: native})
    refs = {p: reference(q, k, v, allowed=allowed_full, masked_row=p) for p in POLICY_LABELS}
    label, err = _classify_row(out[b0, t0], {p: r[0][b0, t0] for p, r in refs.items()}, runner.tolerance)
    result = {"output": label, "evidence": {"row_max_err": err,
                                            "other_rows_max_err": _num(_max_err(out[~empty], refs["zero"][0][~empty]))}}
    if w is None or not runner.returns_weights:
        result["weights"] = "n/a: returns no weights"
    else:
        wlabel, werr = _classify_weights(w[b0, :, t0], S_, runner.tolerance)
        result["weights"] = wlabel
        result["evidence"]["weights_row_max_err"] = werr
        keep = ~empty[:, None, :].repeat(N, axis=1)  # (B, N, T)
        result["evidence"]["other_weights_max_err"] = _num(_max_err(w[keep], refs["zero"][1][keep]))
    return result


def _causal_label(out, q, k, v, tol: float = TOL) -> tuple[str, dict]:
    from impl_numpy.masks import causal_mask

    T_, S_ = q.shape[1], k.shape[1]
    errs = {}
    for alignment in ("top_left", "bottom_right"):
        # rows this alignment leaves without a key (bottom_right when T > S) are the
        # fully-masked-row question, measured separately: compare the others
        rows = causal_mask(T_, S_, alignment).any(-1)  # (T,)
        ref = reference(q, k, v, is_causal=True, alignment=alignment)[0]
        errs[alignment] = _max_err(out[:, rows], ref[:, rows])
    errs["not causal"] = _max_err(out, reference(q, k, v)[0])
    return _pick(errs, tol), {f"max_err_if_{a.replace(' ', '_')}": _num(e) for a, e in errs.items()}


def _causal(runner: Runner, T_: int, S_: int) -> tuple[str, dict]:
    if runner.self_attention_only and T_ != S_:
        return "n/a: self-attention only (T == S)", {}
    q, k, v = _inputs(T_, S_, seed=7)
    try:
        out, _ = runner.run(q, k, v, causal=True, want_weights=False)
    except NotExpressible as why:
        return f"n/a: {why}", {}
    except Exception as err:  # noqa: BLE001 - the API refusing is the measured fact
        return f"n/a: {_short(err)}", {}
    return _causal_label(out, q, k, v, runner.tolerance)


def measure_api(api: Api) -> dict:
    """One row of the table. Never raises: a missing framework is "not installed",
    an API that cannot run at all is "n/a", anything else that fails is recorded
    in the row. float32_matmul is filled in by measure()."""
    row: dict[str, Any] = {"api": api.name, "framework": api.framework, "evidence": {}, "notes": []}
    missing = [m for m in api.modules if importlib.util.find_spec(m) is None]
    if missing:
        row.update(status=NOT_INSTALLED, reason=f"{', '.join(missing)} not installed ({api.install})")
        return row
    started = time.perf_counter()
    try:
        runner = api.build()
    except NotExpressible as why:
        row.update(status="n/a", reason=str(why))
        return row
    except Exception as err:  # noqa: BLE001
        row.update(status="error", reason=_short(err))
        return row
    row["status"] = "measured"
    if api.framework == "keras":
        row["framework"] = f"keras ({sys.modules['keras'].backend.backend()})"
    T_, S_ = (T, T) if runner.self_attention_only else (T, S)
    q, k, v = _inputs(T_, S_, seed=0)
    if runner.self_attention_only:
        k = v = q
    polarities = {}
    for arg, kind in runner.mask_args.items():
        try:
            polarities[arg], row["evidence"][f"polarity[{arg}]"] = _polarity(runner, arg, kind, q, k, v)
        except Exception as err:  # noqa: BLE001
            polarities[arg] = f"error: {_short(err)}"
    values = set(polarities.values())
    row["mask_true_means"] = values.pop() if len(values) == 1 else "; ".join(f"{a}: {p}" for a, p in polarities.items())
    row["mask_true_means_by_argument"] = polarities
    first, kind = next(iter(runner.mask_args.items()))
    if polarities[first] in ("attend", "masked"):
        for arg, kind in runner.mask_args.items():
            try:
                fm = _fully_masked(runner, arg, kind, polarities[arg], q, k, v)
            except Exception as err:  # noqa: BLE001
                fm = {"output": f"error: {_short(err)}", "weights": "n/a", "evidence": {}}
            if arg == first:
                row["fully_masked_row"], row["fully_masked_weights"] = fm["output"], fm["weights"]
                row["evidence"][f"fully_masked[{arg}]"] = fm["evidence"]
            else:
                row["evidence"][f"fully_masked[{arg}]"] = {"output": fm["output"], **fm["evidence"]}
                row["notes"].append(f"{arg} masking every key of a batch: output {fm['output']}")
    else:
        row["fully_masked_row"] = row["fully_masked_weights"] = f"n/a: polarity of {first} is {polarities[first]}"
    for T_c, S_c in CAUSAL_SHAPES:
        key = f"causal_T{T_c}_S{S_c}"
        row[key], row["evidence"][key] = _causal(runner, T_c, S_c)
    if runner.extra is not None:
        try:
            extra = runner.extra()
        except Exception as err:  # noqa: BLE001
            extra = {"notes": [f"extra measurement failed: {_short(err)}"]}
        row["notes"] += extra.pop("notes", [])
        row["evidence"].update(extra.pop("evidence", {}))
        row.update(extra)
    row["float32_matmul"] = {}
    row["seconds"] = round(time.perf_counter() - started, 3)
    return row


# -- float32 matmul precision ----------------------------------------------------------------

def _precision_inputs():
    M, K, Nn = MATMUL_SHAPE
    rng = np.random.default_rng(1)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, Nn)).astype(np.float32)
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _precision_label(c, exact) -> dict:
    c = np.asarray(c, dtype=np.float64)
    rel = float(np.linalg.norm(c - exact) / np.linalg.norm(exact))
    label = "float32" if rel <= FLOAT32_REL_ERR_MAX else "TF32/bf16-like (reduced)"
    return {"label": label, "rel_err": _num(rel)}


def _matmul_torch(a, b, exact, devices):
    import torch

    out = {"cpu": _precision_label(torch.as_tensor(a) @ torch.as_tensor(b), exact)}
    devices["torch"] = {"cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        out["gpu"] = _precision_label((torch.as_tensor(a, device="cuda") @ torch.as_tensor(b, device="cuda")).cpu(), exact)
        devices["torch"]["gpu"] = torch.cuda.get_device_name(0)
    return out


def _matmul_keras(a, b, exact, devices):
    keras = import_keras()
    backend = keras.backend.backend()
    if backend != "tensorflow":
        c = keras.ops.convert_to_numpy(keras.ops.matmul(a, b))
        devices["keras"] = {"default": backend}
        return {"default": _precision_label(c, exact)}
    import tensorflow as tf

    out, names = {}, {}
    for dev in tf.config.list_logical_devices():
        if dev.device_type not in ("CPU", "GPU"):
            continue
        key = dev.device_type.lower()
        key = key if key not in out else dev.name  # a second GPU goes by its own name
        with tf.device(dev.name):
            out[key] = _precision_label(tf.matmul(a, b).numpy(), exact)
        names[key] = dev.name
    devices["keras"] = names
    return out


def _matmul_jax(a, b, exact, devices):
    import jax
    import jax.numpy as jnp

    out, names = {}, {}
    seen = {d for platform_ in ("cpu", None) for d in (jax.devices(platform_) if platform_ else jax.devices())}
    for d in sorted(seen, key=lambda d: (d.platform != "cpu", d.id)):
        key = "cpu" if d.platform == "cpu" else "gpu" if d.platform in ("gpu", "cuda", "rocm") else d.platform
        if key in out:
            continue
        out[key] = _precision_label(jnp.matmul(jax.device_put(a, d), jax.device_put(b, d)), exact)
        names[key] = d.device_kind
    devices["jax"] = names
    return out


def _onnx_matmul_model():
    from onnx import TensorProto, helper

    M, K, Nn = MATMUL_SHAPE
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"])], "mm",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, [M, K]),
                               helper.make_tensor_value_info("B", TensorProto.FLOAT, [K, Nn])],
                              [helper.make_tensor_value_info("C", TensorProto.FLOAT, [M, Nn])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=ONNX_IR_VERSION)


def _matmul_onnxruntime(a, b, exact, devices):
    import onnxruntime as ort

    model = _onnx_matmul_model().SerializeToString()
    out, names = {}, {}
    for provider, key in (("CPUExecutionProvider", "cpu"), ("CUDAExecutionProvider", "gpu")):
        if provider in ort.get_available_providers():
            sess = ort.InferenceSession(model, providers=[provider])
            out[key] = _precision_label(sess.run(None, {"A": a, "B": b})[0], exact)
            names[key] = provider
    devices["onnxruntime"] = names
    return out


def _matmul_onnx_reference(a, b, exact, devices):
    from onnx.reference import ReferenceEvaluator

    devices["onnx"] = {"cpu": "onnx.reference.ReferenceEvaluator"}
    return {"cpu": _precision_label(ReferenceEvaluator(_onnx_matmul_model()).run(None, {"A": a, "B": b})[0], exact)}


def _matmul_numpy(a, b, exact, devices):
    devices["numpy"] = {"cpu": platform.processor() or platform.machine()}
    return {"cpu": _precision_label(a @ b, exact)}


# framework key of APIS -> its default-settings float32 matmul on every device present
MATMUL_PROBES = {"torch": _matmul_torch, "keras": _matmul_keras, "jax": _matmul_jax, "onnxruntime": _matmul_onnxruntime,
                 "onnx": _matmul_onnx_reference, "numpy": _matmul_numpy}


def _versions(frameworks) -> dict[str, str]:
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "onnx", "onnxruntime"):
        if name in sys.modules or name in frameworks:
            try:
                versions[name] = importlib.import_module(name).__version__
            except Exception:  # noqa: BLE001
                continue
    return versions


def measure(console=None, apis: tuple[Api, ...] | None = None, modern_apis=None, packed_apis=None) -> dict:
    """Measure every API (default APIS), every modern API (default
    conventions_modern.APIS) and every packed/sharded path (default
    conventions_packed.APIS; either none when `apis` is given). JSON-serialisable."""
    from conformance import conventions_modern, conventions_packed

    if modern_apis is None:
        modern_apis = conventions_modern.APIS if apis is None else ()
    if packed_apis is None:
        packed_apis = conventions_packed.APIS if apis is None else ()
    apis = APIS if apis is None else apis
    started = time.perf_counter()
    a, b, exact = _precision_inputs()
    matmul: dict[str, dict] = {}
    devices: dict[str, dict] = {}
    rows = []
    status = console.status("measuring conventions") if console is not None else None
    if status is not None:
        status.start()
    try:
        for api in apis:
            if status is not None:
                status.update(f"measuring conventions: {api.name}")
            row = measure_api(api)
            quiet_python_loggers()  # under the CLI: the framework this API imported logs errors only
            if row["status"] == "measured" and api.framework not in matmul and api.framework in MATMUL_PROBES:
                try:
                    matmul[api.framework] = MATMUL_PROBES[api.framework](a, b, exact, devices)
                except Exception as err:  # noqa: BLE001
                    matmul[api.framework] = {"error": {"label": f"error: {_short(err)}", "rel_err": "n/a"}}
            if row["status"] == "measured":
                row["float32_matmul"] = matmul.get(api.framework, {})
            rows.append(row)
    finally:
        if status is not None:
            status.stop()
    if status is not None:
        status.start()
        status.update("measuring conventions: the modern arguments")
    try:
        modern_rows = conventions_modern.measure(modern_apis)
        if status is not None:
            status.update("measuring conventions: the packed and sharded paths")
        packed_rows = conventions_packed.measure(packed_apis)
    finally:
        if status is not None:
            status.stop()
    present = {r["framework"].split(" ")[0] for r in rows if r["status"] == "measured"}
    versions = {**_versions(present), **conventions_modern.versions()}
    return {"versions": versions, "devices": devices, "rows": rows, "modern_rows": modern_rows,
            "packed_rows": packed_rows,
            "shapes": {"B": B, "T": T, "S": S, "N": N, "H": H, "causal_T_S": [list(p) for p in CAUSAL_SHAPES]},
            "tolerance": TOL, "matmul_shape": list(MATMUL_SHAPE),
            "seconds": round(time.perf_counter() - started, 2)}


# -- rendering ---------------------------------------------------------------------------------

COLUMNS = (
    ("API", "api"), ("bool True means", "mask_true_means"), ("fully masked row: output", "fully_masked_row"),
    ("its weights", "fully_masked_weights"), ("causal T=2, S=4", "causal_T2_S4"),
    ("causal T=4, S=2", "causal_T4_S2"), ("default float32 matmul", "float32_matmul"),
)


def _cell(row: dict, key: str) -> str:
    if row.get("status") != "measured" and key != "api":
        if key != "mask_true_means":
            return ""
        return row["status"] if row["status"] == NOT_INSTALLED else f"{row['status']}: {row.get('reason', '')}"
    value = row.get(key, "")
    if key == "float32_matmul":
        return "; ".join(f"{dev}: {m['label']} ({_fmt(m['rel_err'])})" for dev, m in value.items()) or "-"
    if key == "mask_true_means" and value in ("attend", "masked"):
        errs = [ev.get(f"max_err_if_true_{value}") for name, ev in row["evidence"].items() if name.startswith("polarity[")]
        worst = max((e for e in errs if isinstance(e, float)), default=None)
        return f"{value} (err {_fmt(worst)})" if worst is not None else value
    return str(value)


def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


FOOTNOTE_OVER = 24  # an "n/a: why" longer than this becomes "n/a [k]" with the why below the table


def table_cells(data: dict) -> tuple[list[list[str]], list[str]]:
    """The table's rows of cell strings, and its footnotes ("[k] why")."""
    rows, footnotes = [], []
    for row in data["rows"]:
        cells = []
        for _, key in COLUMNS:
            text = _cell(row, key)
            if text.startswith("n/a: ") and len(text) > FOOTNOTE_OVER:
                why = text[len("n/a: "):]
                if why not in footnotes:
                    footnotes.append(why)
                text = f"n/a [{footnotes.index(why) + 1}]"
            cells.append(text)
        rows.append(cells)
    return rows, [f"[{i}] {why}" for i, why in enumerate(footnotes, 1)]


def _notes(data: dict) -> list[str]:
    from conformance import conventions_modern, conventions_packed

    notes = conventions_modern.notes(data.get("modern_rows", [])) + conventions_packed.notes(data.get("packed_rows", []))
    for row in data["rows"]:
        if row.get("status") not in ("measured", NOT_INSTALLED):
            notes.append(f"{row['api']}: {row['status']}: {row.get('reason', '')}")
        elif row.get("status") == NOT_INSTALLED:
            notes.append(f"{row['api']}: {row.get('reason', '')}")
        notes += [f"{row['api']}: {note}" for note in row.get("notes", [])]
    return notes


def disagreements(data: dict) -> list[str]:
    """One line per measured fact that differs from the recorded expectations."""
    import re

    lines = []
    table = expected()
    from conformance.conventions_modern import KEYS as MODERN_KEYS
    from conformance.conventions_packed import KEYS as PACKED_KEYS

    tables = ([(row, ()) for row in data["rows"]] + [(row, MODERN_KEYS) for row in data.get("modern_rows", [])]
              + [(row, PACKED_KEYS) for row in data.get("packed_rows", [])])
    for row, own in tables:
        if row.get("status") != "measured":
            continue
        for key, want in table.get(row["api"], {}).items():
            # an API may have a row in each table: each checks its own keys (the first table: the rest)
            if not ((key in own) if own else (key not in MODERN_KEYS and key not in PACKED_KEYS)):
                continue
            got = row.get(key)
            if isinstance(got, str):  # a modern cell's "(err 1.2e-07)" is evidence, not the convention
                got = re.sub(r" \(err [^)]*\)", "", got)
            if got != want:
                lines.append(f"{row['api']}: {key} expected {want!r}, measured {got!r}")
    return lines


def _setup_line(data: dict) -> str:
    shapes = data["shapes"]
    return (f"Measured in this run ({data['seconds']} s): B={shapes['B']} T={shapes['T']} S={shapes['S']} "
            f"N={shapes['N']} H={shapes['H']}, identity projections, float32 inputs vs the float64 NumPy reference, "
            f"match tolerance {data['tolerance']:g}; matmul probe {'x'.join(map(str, data['matmul_shape']))} "
            "(M x K x N) against float64, normwise relative error.")


def _second_tables(data: dict):
    """The tables after the first that this run measured: (name, module with SETUP/COLUMNS/cells, rows)."""
    from conformance import conventions_modern, conventions_packed

    for name, table, key in (("Modern arguments", conventions_modern, "modern_rows"),
                             ("Packed and sharded paths", conventions_packed, "packed_rows")):
        if data.get(key) is not None:
            yield name, table, data[key]


def to_markdown(data: dict) -> str:
    """The table (Markdown), its footnotes and notes, versions, and one line per
    disagreement with the recorded expectations."""
    rows, footnotes = table_cells(data)
    out = ["| " + " | ".join(title for title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in rows]
    out += ["", *[f"{line}  " for line in footnotes]] if footnotes else []
    for name, table, rows_ in _second_tables(data):
        out += ["", f"{name} ({table.SETUP}):", "",
                "| " + " | ".join(title for title, _ in table.COLUMNS) + " |", "|" + "---|" * len(table.COLUMNS)]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in table.cells(rows_)]
    notes = _notes(data)
    if notes:
        out += ["", "Notes:", *[f"- {note}" for note in notes]]
    out += ["", _setup_line(data), "", "Versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()) + "."]
    lines = disagreements(data)
    out += ["", f"Disagreements with {EXPECTED_SOURCE}:" if lines else f"No disagreement with {EXPECTED_SOURCE}."]
    out += [f"- {line}" for line in lines]
    return "\n".join(out) + "\n"


def render_terminal(data: dict, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title="Native attention APIs: conventions measured in this run", show_lines=True)
    for title, key in COLUMNS:
        table.add_column(title, overflow="fold", min_width=12 if key == "api" else None)
    rows, footnotes = table_cells(data)
    for row, cells in zip(data["rows"], rows):
        table.add_row(*[Text(cell) for cell in cells], style=None if row.get("status") == "measured" else "dim")
    console.print(table)
    for name, table, rows_ in _second_tables(data):
        extra = Table(title=f"{name}: measured in this run ({table.SETUP})", show_lines=True)
        for title, key in table.COLUMNS:
            extra.add_column(title, overflow="fold", min_width=12 if key == "api" else None)
        for row, cells in zip(rows_, table.cells(rows_)):
            extra.add_row(*[Text(cell) for cell in cells], style=None if row.get("status") == "measured" else "dim")
        console.print(extra)
    for line in [*footnotes, *_notes(data), _setup_line(data),
                 "versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items())]:
        console.print(escape(line))
    lines = disagreements(data)
    if lines:
        console.print(f"[bold]disagreements with {escape(EXPECTED_SOURCE)}:[/]")
        for line in lines:
            console.print(escape(f"  {line}"))
    else:
        console.print(f"no disagreement with {escape(EXPECTED_SOURCE)}")


def main(argv: list[str] | None = None) -> int:
    """python -m conformance.conventions [--json | --markdown]"""
    import json

    from conformance.cli import OneLineParser, full_width_output, guarded

    def command() -> int:
        parser = OneLineParser(
            prog="python -m conformance.conventions",
            description="Measure the conventions of each framework's own attention API (bool mask polarity, the "
                        "output and weights of a fully masked row, causal alignment when T != S, the default float32 "
                        "matmul precision on each device; RoPE pairing, window meaning, softcap order, sinks and the QK-norm "
                        "option of the APIs that have them) against the NumPy reference, and print the tables with "
                        f"every disagreement with {EXPECTED_SOURCE}. Frameworks that are not installed are rows "
                        "saying so. `mha check --conventions` prints the same table after the main job.")
        form = parser.add_mutually_exclusive_group()
        form.add_argument("--json", action="store_true", help="print the whole measurement, evidence included, as JSON")
        form.add_argument("--markdown", action="store_true", help="print the table as Markdown")
        args = parser.parse_args(argv)
        with full_width_output():
            result = measure()
            if args.json:
                print(json.dumps(result, indent=1))
            elif args.markdown:
                print(to_markdown(result))
            else:
                render_terminal(result)
        return 0

    return guarded(command)


if __name__ == "__main__":
    raise SystemExit(main())
