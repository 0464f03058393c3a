"""Backend onnxruntime: our layer exported to an ONNX graph, run by onnxruntime.

The graph (opset 23, IR version 11: onnx writes a newer IR than onnxruntime
1.30 reads) holds the canonical tensors as initializers and has two forms:

- "attention" (the default): MatMul (+ Add) projections, Reshape/Transpose
  to (B, heads, L, width), ONE opset-23 `Attention` node (scale=, GQA from
  K/V's head count, value_head_dim != head_dim, a bool attn_mask with True =
  attend, a bias as a float attn_mask with -inf where not allowed, is_causal
  for top-left causal without a mask, qk_matmul_output_mode=3 for the
  weights after softmax), then merge and the output MatMul (+ Add).
  Bottom-right causal is folded into attn_mask (the node's is_causal is
  top-left; with a KV cache ONNX means bottom-right, see conventions).
- "plain" (only where the Attention node cannot express the case): the same
  projections around MatMul, Mul (scale), Add (bias), Where (mask, -inf),
  Softmax, Where (a fully masked row -> the case's masked_row policy), Where
  (dropout with the case's keep-mask), MatMul. Used for an explicit dropout
  mask (the node has none) and for a query row with no allowed key when the
  node's own answer for it, measured per dtype by a probe (`native_masked_row`),
  is not the case's masked_row: onnxruntime 1.30 CPU gives 0 in float32 and
  float16 but NaN in float64 (see below).

Measured (onnxruntime 1.30, CPU): the Attention node rejects an attn_mask
whose query axis is broadcast ((B, 1, 1, S): "inconsistent q_sequence_length
(between attn_mask and Q)", which onnx.reference accepts), so the exported
mask is expanded to (B|1, N|1, T, S). onnxruntime's CPU kernel covers float
and float16 only; for float64 it runs the ONNX function body of Attention,
which (a) scales q and k each by Sqrt(scale) computed in float32, so results
are float32-accurate unless sqrt(scale) is exact in float32 (scale 1 or 1/4
are; 1/sqrt(4) = 0.5 is not), see `known_difference`, and (b) gives NaN for
a query row with no allowed key (softmax over -inf), where the float kernel
gives 0.

The modern contract, at the highest opset onnxruntime 1.30 runs:

- softcap: the Attention node's `softcap` attribute (opset 23; measured by
  `mha check --conventions`: onnxruntime caps before the mask and the bias,
  as the contract does); the plain form writes Div, Tanh, Mul;
- KV cache: the node's past_key / past_value inputs and present_key /
  present_value outputs (the plain form: Concat);
- RoPE: the RotaryEmbedding op (opset 23) on q and k, with cos/sin tables
  (B, L, R/2) computed from weights.rope in float64 (the YaRN attention
  factor folded in) and rounded to the storage dtype, `interleaved` and
  `rotary_embedding_dim` from the config. ONNX defines RotaryEmbedding for
  float, float16 and bfloat16 only: in float64 onnxruntime refuses the graph
  ("Type 'tensor(double)' of input parameter (X) of operator
  (RotaryEmbedding) ... is invalid"), reported unsupported in its words;
- QK-norm: RMSNormalization / LayerNormalization (opset 23) over the last
  axis (scope "head") or the last two (scope "all") of (B, L, heads, H);
- segment ids and local chunks (pos_q // C == pos_k // C): folded into the
  bool attn_mask (the node has no segment or chunk argument);
- ALiBi: -slope_n * |pos_q - pos_k| (from alibi.slopes and the call's
  positions, the cache's keys at 0..P-1) joins the case's bias in the float
  attn_mask, which the node adds after its softcap, where the contract puts
  ALiBi;
- LongRoPE and proportional RoPE: RotaryEmbedding's cos_cache / sin_cache
  inputs are the tables of the rule (LongRoPE's short or long table picked by
  the call's largest position, as weights.rope.rope_tables does);
- windows: the node's left_window_size / right_window_size (opset 25), never
  emulated by the mask: onnxruntime 1.30 refuses them ("Unrecognized
  attribute: left_window_size for operator Attention"), reported unsupported
  in its words, and would run them once it knows them;
- sinks: no input for them up to opset 25: refused.

Refused, each with its reason (FRONTIER_WHY): the QKV clip, the query
temperature, the output gate, the value norm, the later QK-norm forms
(weightless, per head, after RoPE) and latent attention: the Attention node
and the ops this graph uses for the modern contract (RotaryEmbedding,
RMSNormalization, LayerNormalization) have no argument for them.

`graph_form(...)` says which form a call uses. Forward only: vjp raises
NotImplementedError (onnxruntime's inference sessions compute no gradients).
bfloat16: onnxruntime's CPU provider has no bfloat16 kernels for these ops,
reported as unsupported with its own message.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from impl_numpy.functional import default_positions

from . import (
    SELECTION_WHY,
    alibi_distance,
    allowed4,
    bias4,
    call_shapes,
    classify_row,
    empty_rows,
    prepare_call,
    qkv,
    require,
)

require("onnx", "onnxruntime")

NAME = "onnxruntime"
OPSET = 23
WINDOW_OPSET = 25  # the first opset whose Attention has left_window_size / right_window_size
EXPRESSES = ("rope", "logit_softcap", "window_left", "window_right", "qk_norm", "positions", "key_positions",
             "past_key", "past_value", "segment_ids", "key_segment_ids", "return_cache", "alibi", "local_chunk",
             "rope.scaling longrope", "rope.scaling proportional", "past_key_positions")
SINKS_WHY = "ONNX Attention has no sinks input up to opset 25"
_NO_ARGUMENT = "ONNX Attention (opset 23-25) has no argument for it"
FRONTIER_WHY = {
    "topk_indices": SELECTION_WHY,
    "use_sinks": SINKS_WHY,
    "qkv_clip": f"{_NO_ARGUMENT}: the clamp of q, k, v comes before the node",
    "query_temperature": f"{_NO_ARGUMENT}: its scale attribute is one number for every query",
    "output_gate": f"{_NO_ARGUMENT}: the node returns the context ungated",
    "value_norm": f"{_NO_ARGUMENT}: the node takes v as given",
    "latent": f"{_NO_ARGUMENT}: latent attention's up-projections come before the node",
    "qk_norm.weight": "RMSNormalization / LayerNormalization always take a scale input (this graph passes the "
                      "case's scale tensors, which a weightless norm has none of)",
    "qk_norm.per_head": "RMSNormalization / LayerNormalization take one scale over the normalised axes, not one "
                        "per head",
    "qk_norm.after_rope": "this graph normalises q and k before RotaryEmbedding (the QK-norm of the modern contract)",
}
IR_VERSION = 11


FLOAT64_ATTENTION = (
    "float64: onnxruntime has no CPU Attention kernel for double and runs the ONNX function body, which multiplies q "
    "and k each by Sqrt(scale) computed in float32 (the scale attribute is a 32-bit float): a relative error of "
    "about 1e-8 in every logit unless sqrt(scale) is exact in float32")


def _sqrt_scale_exact(scale: float) -> bool:
    root = np.sqrt(np.float32(scale), dtype=np.float32)
    return float(np.float32(scale)) == scale and float(root) * float(root) == scale


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    if dtype != "float64" or case.S == 1:  # with one key the softmax is exactly 1 in any precision
        return None
    if _sqrt_scale_exact(case.config.effective_scale):
        return None
    from conformance.suite.cases import cast_inputs, make_inputs

    inputs = cast_inputs(make_inputs(case), dtype)
    shapes = call_shapes(case.config, inputs, case.options(dtype))
    if graph_form(case.config, shapes, inputs, case.options(dtype), "cpu", dtype) == "attention":
        return FLOAT64_ATTENTION
    return None


def devices() -> list[str]:
    import onnxruntime as ort

    return ["cpu"] + (["gpu"] if "CUDAExecutionProvider" in ort.get_available_providers() else [])


def _elem(dtype: str) -> int:
    from onnx import TensorProto

    return {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE, "float16": TensorProto.FLOAT16,
            "bfloat16": TensorProto.BFLOAT16}[dtype]


def _session(model, device: str, precision: str, *, exact_scalars: bool = False):
    """exact_scalars: turn off onnxruntime's MatMulScaleFusion, which folds a
    scalar Mul/Div after a MatMul into FusedMatMul's alpha, a 32-bit float
    attribute: in float64 that rounds the scale (measured: the plain form's
    scale 0.5 then softcap division by 5 became alpha 0.1 in float32, errors
    of 5e-9). The plain form stands in for the reference's ops, so in float64
    it runs without that fusion."""
    import onnxruntime as ort

    if device == "gpu":
        providers = [("CUDAExecutionProvider", {"use_tf32": "1" if precision == "tf32" else "0"})]
    else:
        providers = ["CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors reach us as exceptions; no copy on stderr
    try:
        extra = {"disabled_optimizers": ["MatMulScaleFusion"]} if exact_scalars else {}
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers, **extra)
    except Exception as err:  # noqa: BLE001 - onnxruntime's own error types
        if type(err).__name__ in ("NotImplemented", "InvalidGraph", "Fail"):
            text = str(err).splitlines()[0] if str(err) else type(err).__name__
            if ", Error " in text:  # onnxruntime puts the node's signature between the error code and the reason
                code = " : ".join(text.split(" : ")[:3])  # "[ONNXRuntimeError] : 10 : INVALID_GRAPH"
                text = f"{code} : {text[text.rindex(', Error ') + len(', Error '):]}"
            raise NotImplementedError(f"{NAME}: onnxruntime cannot run this graph on {device}: {text}") from None
        raise


# -- the probe ---------------------------------------------------------------------------

_ROWS: dict[tuple, str] = {}


def native_masked_row(device: str, dtype: str, float_mask: bool) -> str:
    """What the Attention node gives for a query row with no allowed key
    (a bool mask, or a float mask of -inf), measured on a small graph."""
    key = (device, dtype, float_mask)
    if key not in _ROWS:
        from onnx import TensorProto, helper

        np_dtype = np.dtype(dtype)
        info = lambda n, t, s: helper.make_tensor_value_info(n, t, list(s))  # noqa: E731
        mask_type = _elem(dtype) if float_mask else TensorProto.BOOL
        graph = helper.make_graph(
            [helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"])], "probe",
            [info("Q", _elem(dtype), (1, 1, 2, 2)), info("K", _elem(dtype), (1, 1, 3, 2)),
             info("V", _elem(dtype), (1, 1, 3, 2)), info("M", mask_type, (2, 3))],
            [info("Y", _elem(dtype), (1, 1, 2, 2))])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
        v = np.array([[[[0.0, 2.0], [2.0, 4.0], [4.0, 0.0]]]], dtype=np_dtype)  # (B, N, S, H)
        allowed = np.ones((2, 3), dtype=bool)
        allowed[0] = False  # query 0: no key
        m = np.where(allowed, 0.0, -np.inf).astype(np_dtype) if float_mask else allowed
        y = _session(model, device, "highest").run(None, {"Q": np.ones((1, 1, 2, 2), np_dtype), "K": v, "V": v, "M": m})[0]
        _ROWS[key] = classify_row(y[0, 0, 0], v[0, 0])
    return _ROWS[key]


# -- the graph ---------------------------------------------------------------------------

class _Graph:
    """A small helper to write an ONNX graph node by node."""

    def __init__(self, dtype: str):
        self.dtype, self.np_dtype = dtype, np.dtype(dtype)
        self.nodes, self.inits, self.inputs, self.feeds = [], [], [], {}
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def const(self, stem: str, array) -> str:
        from onnx import numpy_helper

        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def input(self, name: str, array) -> str:
        from onnx import TensorProto, helper

        array = np.asarray(array)
        elem = TensorProto.BOOL if array.dtype == bool else _elem(array.dtype.name)
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(array.shape)))
        self.feeds[name] = array
        return name

    def op(self, op_type: str, inputs, stem=None, outputs=1, **attrs):
        from onnx import helper

        names = [self.name(stem or op_type.lower()) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if len(names) == 1 else names

    def model(self, outputs: dict[str, tuple], opset: int = 23):
        from onnx import helper

        outs = [helper.make_tensor_value_info(name, _elem(self.dtype), list(shape)) for name, shape in outputs.items()]
        graph = helper.make_graph(self.nodes, "multi_head_attention", self.inputs, outs, initializer=self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


def _project(g: _Graph, x: str, kernel, bias, heads: int, norm=None, rope=None) -> str:
    """(B, L, D) @ kernel (D, heads, width) (+ bias) [-> QK-norm] -> (B, heads,
    L, width) [-> RotaryEmbedding]. norm: (qk_norm, scale, bias or None);
    rope: (cos, sin (B, L, R/2) with the attention factor in, R, interleaved)."""
    D, _, width = kernel.shape
    y = g.op("MatMul", [x, g.const("kernel", kernel.reshape(D, heads * width))])  # (B, L, heads*width)
    if bias is not None:
        y = g.op("Add", [y, g.const("bias", bias.reshape(-1))])
    y = g.op("Reshape", [y, g.const("shape", np.array([0, 0, heads, width], np.int64))])  # (B, L, heads, width)
    if norm is not None:
        y = _norm(g, y, heads, width, *norm)
    y = g.op("Transpose", [y], perm=[0, 2, 1, 3])  # (B, heads, L, width)
    if rope is not None:
        cos, sin, R, interleaved = rope
        attrs = {"interleaved": int(interleaved)} | ({"rotary_embedding_dim": R} if R < width else {})
        y = g.op("RotaryEmbedding", [y, g.const("cos", cos), g.const("sin", sin)], **attrs)  # (B, heads, L, width)
    return y


def _norm(g: _Graph, y: str, heads: int, width: int, qk_norm, scale, bias) -> str:
    """QK-norm on (B, L, heads, width) with ONNX's RMSNormalization /
    LayerNormalization (opset 23; eps inside the root, as the contract): scope
    "head" normalises the last axis (scale (H,)), "all" the last two (scale
    (heads, H))."""
    axis = -1 if qk_norm.scope == "head" else -2
    if qk_norm.type == "rms":
        return g.op("RMSNormalization", [y, g.const("scale", scale)], axis=axis, epsilon=float(qk_norm.eps))
    return g.op("LayerNormalization", [y, g.const("scale", scale), g.const("bias", bias)], axis=axis,
                epsilon=float(qk_norm.eps))


def _rope_tables(config, positions, B: int, L: int, P: int, dtype: str, max_position: int | None = None):
    """cos and sin (B, L, R/2) for RotaryEmbedding: angle = position x
    frequency in float64 (weights.rope), times the attention factor, then
    rounded to the storage dtype. max_position: the call's largest position
    (of its queries and new keys), which picks LongRoPE's table."""
    from weights.rope import rope_tables

    pos = np.broadcast_to(default_positions(positions, P, L), (B, L)).astype(np.float64)  # (B, L)
    inv_freq, factor = rope_tables(config.rope, max_position)
    angles = pos[..., None] * inv_freq  # (B, L, R/2)
    return ((np.cos(angles) * factor).astype(dtype), (np.sin(angles) * factor).astype(dtype),
            config.rope.rotary_dim, config.rope.interleaved)


def graph_form(config, shapes, inputs, options, device: str, dtype: str) -> str:
    """"attention" (one Attention node) or "plain" (MatMul/Softmax ops): see the module docstring."""
    if options.get("training") and (config.dropout > 0 or inputs.get("dropout_mask") is not None):
        return "plain"
    if config.window_left >= 0 or config.window_right >= 0:  # the node's own window attributes, never emulated
        return "attention"
    if empty_rows(shapes, inputs, options, config)[1]:
        float_mask = inputs.get("bias") is not None or config.alibi
        if native_masked_row(device, dtype, float_mask) != config.masked_row:
            return "plain"
    return "attention"


def _build(config, tensors, inputs, options, shapes, form: str, want_weights: bool):
    B, T, S, N, K = shapes.B, shapes.T, shapes.S_total, config.num_heads, config.num_kv_heads
    V, O = config.value_head_dim, config.out_dim
    dtype = np.dtype(next(iter(tensors.values())).dtype).name
    want_cache = bool(options.get("return_cache", False))
    g = _Graph(dtype)
    query, key, value = (g.input(n, x) for n, x in zip(("query", "key", "value"), qkv(inputs)))
    norms = [None, None]
    if config.qk_norm is not None:
        norms = [(config.qk_norm, tensors[f"{n}.norm.scale"], tensors.get(f"{n}.norm.bias")) for n in ("query", "key")]
    ropes = [None, None]
    if config.rope is not None:
        largest = max(int(default_positions(inputs.get(n), shapes.P, L).max(initial=0))
                      for n, L in (("positions", T), ("key_positions", shapes.S)))
        ropes = [_rope_tables(config, inputs.get("positions"), B, T, shapes.P, dtype, largest),
                 _rope_tables(config, inputs.get("key_positions"), B, shapes.S, shapes.P, dtype, largest)]
    q = _project(g, query, tensors["query.kernel"], tensors.get("query.bias"), N, norms[0], ropes[0])  # (B, N, T, H)
    k = _project(g, key, tensors["key.kernel"], tensors.get("key.bias"), K, norms[1], ropes[1])  # (B, K, S_new, H)
    v = _project(g, value, tensors["value.kernel"], tensors.get("value.bias"), K)  # (B, K, S_new, V)
    past = [g.input(n, inputs[n]) for n in ("past_key", "past_value")] if inputs.get("past_key") is not None else []
    bias = bias4(shapes, inputs)
    if config.alibi:  # -slope_n * distance, one product; then the case's bias, the contract's order
        slopes = tensors["alibi.slopes"].astype(np.float64).reshape(1, N, 1, 1)
        alibi = (-slopes * alibi_distance(shapes, inputs)[:, None]).astype(dtype)  # (B|1, N, T, S)
        bias = alibi if bias is None else alibi.astype(np.float64) + bias.astype(np.float64)
    top_left = bool(options.get("is_causal")) and options.get("causal_alignment", "top_left") == "top_left"
    window = {}
    if config.window_left >= 0 or config.window_right >= 0:  # the node's own attributes (opset 25), not the mask
        window = {"left_window_size": config.window_left, "right_window_size": config.window_right}
    plain_config = dataclasses.replace(config, window_left=-1, window_right=-1)
    if form == "attention":
        causal_flag = top_left and inputs.get("mask") is None and bias is None and inputs.get("segment_ids") is None
        allowed = allowed4(shapes, inputs, options, causal=bool(options.get("is_causal")) and not causal_flag,
                           config=plain_config)
        names = [q, k, v]
        if bias is not None:
            full = bias.astype(np.float64) if allowed is None else np.where(allowed, bias.astype(np.float64), -np.inf)
            names.append(g.input("attn_mask", full.astype(g.np_dtype)))  # added to the logits
        elif allowed is not None:
            allowed = np.broadcast_to(allowed, (*allowed.shape[:2], T, S))  # onnxruntime needs the T axis
            names.append(g.input("attn_mask", np.ascontiguousarray(allowed)))  # bool, True = attend
        elif past:
            names.append("")
        names += past
        # onnxruntime refuses past_key without present_key ("does not support past_key provided and present_key
        # being null"): with a past the present outputs are always named, graph outputs only where asked for
        outs = ["ctx"] + (["present_key", "present_value"] if want_cache else
                          [g.name("present_key"), g.name("present_value")] if past else
                          ["", ""] if want_weights else [])
        outs += ["weights"] if want_weights else []
        attrs = {"qk_matmul_output_mode": 3} if want_weights else {}
        if config.logit_softcap is not None:
            attrs["softcap"] = float(config.logit_softcap)
        g.op("Attention", names, outputs=outs, scale=float(config.effective_scale), is_causal=int(causal_flag),
             **attrs, **window)
        ctx = "ctx"  # (B, N, T, V)
    else:
        if past:
            k = g.op("Concat", [past[0], k], axis=2, outputs=["present_key"] if want_cache else 1)  # (B, K, S, H)
            v = g.op("Concat", [past[1], v], axis=2, outputs=["present_value"] if want_cache else 1)  # (B, K, S, V)
        elif want_cache:
            k = g.op("Identity", [k], outputs=["present_key"])
            v = g.op("Identity", [v], outputs=["present_value"])
        ctx = _plain_core(g, config, shapes, inputs, options, q, k, v, bias)
    ctx = g.op("Transpose", [ctx], perm=[0, 2, 1, 3])  # (B, T, N, V)
    ctx = g.op("Reshape", [ctx, g.const("shape", np.array([0, 0, N * V], np.int64))])  # (B, T, N*V)
    kernel = tensors["output.kernel"].reshape(N * V, O)
    if tensors.get("output.bias") is None:
        g.op("MatMul", [ctx, g.const("kernel", kernel)], outputs=["output"])
    else:
        y = g.op("MatMul", [ctx, g.const("kernel", kernel)])
        g.op("Add", [y, g.const("bias", tensors["output.bias"])], outputs=["output"])
    outputs = {"output": (B, T, O)}
    if want_weights:
        outputs["weights"] = (B, N, T, S)
    if want_cache:
        outputs.update(present_key=(B, K, S, config.head_dim), present_value=(B, K, S, V))
    return g.model(outputs, opset=WINDOW_OPSET if window else OPSET), g.feeds


def _plain_core(g: _Graph, config, shapes, inputs, options, q, k, v, bias) -> str:
    """logits -> mask/bias -> softmax (masked_row policy) -> dropout -> attend, in plain ops."""
    B, S, N, K = shapes.B, shapes.S_total, config.num_heads, config.num_kv_heads
    H, V, G = config.head_dim, config.value_head_dim, config.group_size

    def per_query_head(x, width):  # (B, K, S, width) -> (B, N, S, width): head n reads n // G
        if G == 1:
            return x
        x = g.op("Unsqueeze", [x, g.const("axes", np.array([2], np.int64))])  # (B, K, 1, S, width)
        x = g.op("Expand", [x, g.const("shape", np.array([B, K, G, S, width], np.int64))])  # (B, K, G, S, width)
        return g.op("Reshape", [x, g.const("shape", np.array([B, N, S, width], np.int64))])  # (B, N, S, width)

    k, v = per_query_head(k, H), per_query_head(v, V)
    kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])  # (B, N, H, S)
    x = g.op("Mul", [g.op("MatMul", [q, kt]), g.const("scale", np.array(config.effective_scale, g.np_dtype))])
    if config.logit_softcap is not None:  # c tanh(x / c), before bias and mask
        cap = g.const("cap", np.array(config.logit_softcap, g.np_dtype))
        x = g.op("Mul", [g.op("Tanh", [g.op("Div", [x, cap])]), cap])
    if bias is not None:
        x = g.op("Add", [x, g.const("bias", bias.astype(g.np_dtype))])  # (B|1, N|1, T, S)
    allowed = allowed4(shapes, inputs, options, config=config)  # windows too: the plain form has no window attribute
    if allowed is not None:
        x = g.op("Where", [g.const("allowed", allowed), x, g.const("neg_inf", np.array(-np.inf, g.np_dtype))])
    w = g.op("Softmax", [x], axis=-1)  # (B, N, T, S)
    row_max = g.op("ReduceMax", [x, g.const("axes", np.array([-1], np.int64))], keepdims=1)  # (B, N, T, 1)
    empty = g.op("IsInf", [row_max], detect_positive=0)  # a row with no finite logit
    fill = {"zero": 0.0, "uniform": 1.0 / S, "nan": np.nan}[config.masked_row]
    w = g.op("Where", [empty, g.const("fill", np.array(fill, g.np_dtype)), w], outputs=["weights"])
    if options.get("training") and inputs.get("dropout_mask") is not None:
        keep = g.input("dropout_mask", np.asarray(inputs["dropout_mask"], dtype=bool))  # (B, N, T, S)
        scaled = g.op("Mul", [w, g.const("inv_keep", np.array(1.0 / (1.0 - config.dropout), g.np_dtype))])
        w = g.op("Where", [keep, scaled, g.const("zero", np.array(0.0, g.np_dtype))])
    return g.op("MatMul", [w, v])  # (B, N, T, V)


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                                  expresses=EXPRESSES, why=FRONTIER_WHY)
    if options.get("training") and config.dropout > 0 and inputs.get("dropout_mask") is None:
        raise NotImplementedError(f"{NAME}: dropout in training needs the case's explicit dropout_mask (the graph "
                                  "draws no random numbers)")
    want = bool(options.get("return_weights", False))
    form = graph_form(config, shapes, inputs, options, device, dtype)
    model, feeds = _build(config, tensors, inputs, options, shapes, form, want or form == "plain")
    session = _session(model, device, precision, exact_scalars=form == "plain" and dtype == "float64")
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, feeds)))
    answer = {"output": got["output"]}
    if want:
        answer["weights"] = got["weights"]
    if options.get("return_cache"):
        answer["present_key"], answer["present_value"] = got["present_key"], got["present_value"]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    raise NotImplementedError(f"{NAME}: forward only (an onnxruntime InferenceSession computes no gradients)")
