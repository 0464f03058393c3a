"""The per-API runners of the conventions table: each framework's own
attention API wrapped as a harness Runner, and APIS, the table's rows."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from conformance.logs import import_keras
from conformance.native.conventions.harness import (
    Api,
    B,
    D,
    H,
    N,
    NotExpressible,
    Runner,
    S,
    T,
    _causal_label,
    _inputs,
    _max_err,
    _merge,
    _num,
    _short,
    _split,
    reference,
)

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


# mlx --------------------------------------------------------------------------------

def _mlx_sdpa() -> Runner:
    import mlx.core as mx

    def run(q, k, v, masks=None, causal=False, want_weights=True):
        mask = "causal" if causal else None
        if masks and "mask" in masks:
            mask = mx.array(masks["mask"])[:, None]  # (B, 1, T, S)
        heads = [mx.array(_split(x)).transpose(0, 2, 1, 3) for x in (q, k, v)]  # (B, N, L, H)
        out = mx.fast.scaled_dot_product_attention(*heads, scale=1.0 / np.sqrt(H), mask=mask)
        return _merge(np.array(out.transpose(0, 2, 1, 3))), None

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
MLX_EXTRA = "pip install -c constraints/cpu.txt '.[mlx]' (Linux x86-64, macOS arm64)"

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
    Api("mx.fast.scaled_dot_product_attention", "mlx", ("mlx",), MLX_EXTRA, _mlx_sdpa),
    Api("onnxruntime Attention (opset 23, CPU)", "onnxruntime", ("onnx", "onnxruntime"), ONNX_EXTRA,
        lambda: _onnx_runner("onnxruntime")),
    Api("onnx.reference Attention (opset 23)", "onnx", ("onnx",), ONNX_EXTRA, lambda: _onnx_runner("reference")),
    *(Api(f"numpy reference (masked_row={p})", "numpy", ("numpy",), "(always installed)",
          lambda p=p: _numpy_reference(p)) for p in ("zero", "uniform", "nan")),
)

