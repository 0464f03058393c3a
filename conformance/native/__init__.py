"""The frameworks' own attention layers as conformance backends.

One module per backend id of conformance/suite/backends.py, each with the adapter
interface of impl_numpy/adapter.py (NAME, devices(), forward(...), vjp(...)),
NumPy in and out. Two kinds:

- native layers built from the canonical tensors (impl_*.native.to_native):
  torch nn.MultiheadAttention, keras.layers.MultiHeadAttention,
  flax.linen.MultiHeadDotProductAttention, flax.nnx.MultiHeadAttention;
- native attention kernels around our own projections: torch
  F.scaled_dot_product_attention, jax.nn.dot_product_attention, and an ONNX
  graph of our layer (opset-23 Attention) run by onnxruntime.

What the native API cannot express raises NotImplementedError with the
reason, which the suite reports as "unsupported": a config its weights
cannot hold, a scale it does not take, a mask shape or bias it has no
argument for, an explicit dropout mask, and a query row with no allowed key
when the case's masked_row policy is not what the API does with such a row
(`mha check --conventions` measures it). Everything else runs and is judged: a native
behaviour that differs from the reference then shows as a failure with its
margin. Each module's `known_difference(case, dtype)` names the failures
that are expected, with the reason (tests/test_native_backends.py asserts
that exactly those fail).

Kernels that return no attention weights (SDPA, jax.nn.dot_product_attention)
have them read out of the kernel itself: a second call with the value set to
the identity (V = I_S, so weights @ I = weights); see `identity_values`.

Not a backend: mlx_lm_ports.py (with mlx_lm_stages.py and mlx_lm_harness.py)
judges mlx-lm's hand-written model ports, a table of `mha check --conventions`.

Shape letters as in impl_numpy: B batch, T query length, S key length,
N query heads, K key/value heads, H head dim, V value head dim, D input
features, O output features.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Mapping

import numpy as np

from impl_numpy.functional import all_key_positions, default_positions, selection_mask
from impl_numpy.masks import causal_mask, chunk_mask, segment_mask, window_mask
from weights import AttentionConfig, dtype_from_name, layouts, validate_tensors
from weights.contract import CallShapes, check_call, check_input_values

PRECISIONS = ("highest", "tf32")
DTYPES = ("float64", "float32", "float16", "bfloat16")
ROW_LABELS = {"zero": "0", "uniform": "uniform weights (mean of V)", "nan": "NaN"}


# -- imports ---------------------------------------------------------------------------

def require(*modules: str) -> None:
    """Called at the top of each backend module: a missing framework makes
    importing the module fail with ModuleNotFoundError naming it, which the
    registry reports as "not installed"; the framework itself is imported
    lazily, on first use."""
    for name in modules:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


# -- the call ------------------------------------------------------------------------

def call_shapes(config: AttentionConfig, inputs: Mapping, options: Mapping) -> CallShapes:
    """Validate the call as every implementation does (weights.contract)."""
    q, k, v = inputs["query"], inputs.get("key"), inputs.get("value")
    k = q if k is None else k
    v = k if v is None else v
    mask, bias, keep = inputs.get("mask"), inputs.get("bias"), inputs.get("dropout_mask")
    check_input_values(query=q, key=k, value=v)
    return check_call(
        config, query_shape=np.shape(q), key_shape=np.shape(k), value_shape=np.shape(v),
        mask_shape=None if mask is None else np.shape(mask),
        mask_dtype=None if mask is None else np.asarray(mask).dtype.name,
        bias_shape=None if bias is None else np.shape(bias),
        bias_dtype=None if bias is None else np.asarray(bias).dtype.name,
        dropout_mask_shape=None if keep is None else np.shape(keep),
        dropout_mask_dtype=None if keep is None else np.asarray(keep).dtype.name,
        **{f"{name}_{what}": (np.shape(inputs[name]) if what == "shape" else np.asarray(inputs[name]).dtype.name)
           for name in MODERN_INPUTS if inputs.get(name) is not None for what in ("shape", "dtype")},
        is_causal=bool(options.get("is_causal", False)), causal_alignment=options.get("causal_alignment", "top_left"),
        training=bool(options.get("training", False)), seed=options.get("seed"),
        return_weights=bool(options.get("return_weights", False)),
        keys_given=inputs.get("key") is not None or inputs.get("value") is not None,
        return_cache=bool(options.get("return_cache", False)),
    )


def qkv(inputs: Mapping) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = np.asarray(inputs["query"])
    k = q if inputs.get("key") is None else np.asarray(inputs["key"])
    v = k if inputs.get("value") is None else np.asarray(inputs["value"])
    return q, k, v


def dtype_name(tensors: Mapping, options: Mapping) -> str:
    """The storage dtype of the call: options["dtype"], else the tensors'."""
    name = options.get("dtype") or np.dtype(next(iter(tensors.values())).dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}: got {name!r}")
    return name


def cast(tensors: Mapping, inputs: Mapping, dtype: str, config: AttentionConfig | None = None) -> tuple[dict, dict]:
    """Tensors (validated against `config` when given, as the reference does)
    and float inputs in the storage dtype (bool masks unchanged)."""
    if config is not None:
        validate_tensors(config, tensors)
    dt = dtype_from_name(dtype)
    tensors = {k: np.asarray(v).astype(dt) for k, v in tensors.items()}
    inputs = {k: (v if v is None or np.asarray(v).dtype.kind in "biu" else np.asarray(v).astype(dt))
              for k, v in inputs.items()}  # bool masks, integer positions and segment ids unchanged
    return tensors, inputs


def check_device(backend: str, device: str, available: list[str]) -> None:
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be cpu or gpu: got {device!r}")
    if device not in available:
        raise ValueError(f"device {device} requested but backend {backend} sees none here (available: "
                         f"{', '.join(available)})")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}: got {precision!r}")


# -- masks -----------------------------------------------------------------------------

def mask4(shapes: CallShapes, inputs: Mapping) -> np.ndarray | None:
    """The case's mask as rank-4 (B|1, N|1, T, S) bool, True = may attend."""
    m = inputs.get("mask")
    return None if m is None else np.asarray(m, dtype=bool).reshape(shapes.mask_shape)


def bias4(shapes: CallShapes, inputs: Mapping) -> np.ndarray | None:
    b = inputs.get("bias")
    return None if b is None else np.asarray(b).reshape(shapes.bias_shape)


def call_positions(shapes: CallShapes, inputs: Mapping) -> tuple[np.ndarray, np.ndarray]:
    """The positions ALiBi, local chunks and RoPE read (spec-frontier.md): the queries' (B|1, T) and every
    key's (B|1, S_total), the cache's keys at past_key_positions (default 0..P-1), int64."""
    past = inputs.get("past_key_positions")
    return (default_positions(inputs.get("positions"), shapes.P, shapes.T),
            all_key_positions(default_positions(inputs.get("key_positions"), shapes.P, shapes.S), shapes.P,
                              None if past is None else default_positions(past, 0, shapes.P)))


def alibi_distance(shapes: CallShapes, inputs: Mapping) -> np.ndarray:
    """|pos_q(i) - pos_k(j)|, (B|1, T, S_total) int64: ALiBi's bias is -slope_n times it."""
    q, k = call_positions(shapes, inputs)
    return np.abs(q[:, :, None] - k[:, None, :])  # (B|1, T, S_total)


def allowed4(shapes: CallShapes, inputs: Mapping, options: Mapping, *, causal: bool | None = None,
             config: AttentionConfig | None = None) -> np.ndarray | None:
    """mask AND (if `causal`, default the call's is_causal) the causal mask,
    rank 4 over every key (S_total, the cache's included); with `config`,
    its window, its local chunks, the call's segment ids and its selection
    (topk_indices) too (what the reference ANDs)."""
    T, S, alignment = shapes.T, shapes.S_total, options.get("causal_alignment", "top_left")
    allowed = mask4(shapes, inputs)

    def both(extra):
        return extra if allowed is None else allowed & extra

    if options.get("is_causal") if causal is None else causal:
        allowed = both(causal_mask(T, S, alignment)[None, None])  # (1, 1, T, S)
    if config is not None and (config.window_left >= 0 or config.window_right >= 0):
        allowed = both(window_mask(T, S, config.window_left, config.window_right, alignment)[None, None])
    if config is not None and config.local_chunk is not None:
        allowed = both(chunk_mask(*call_positions(shapes, inputs), config.local_chunk))  # (B|1, 1, T, S)
    if config is not None and inputs.get("segment_ids") is not None:
        key_ids = inputs.get("key_segment_ids")
        allowed = both(segment_mask(inputs["segment_ids"], inputs["segment_ids"] if key_ids is None else key_ids))
    if config is not None and inputs.get("topk_indices") is not None:
        allowed = both(selection_mask(inputs["topk_indices"], config.num_heads, S))  # (B, 1|N, T, S)
    return allowed


def empty_rows(shapes: CallShapes, inputs: Mapping, options: Mapping,
               config: AttentionConfig | None = None) -> tuple[bool, bool]:
    """(a row has no allowed key by mask/causal [/window/segments with
    `config`], a row has none once bias -inf is counted too)."""
    allowed = allowed4(shapes, inputs, options, config=config)
    by_mask = bool(allowed is not None and (~allowed.any(-1)).any())
    bias = bias4(shapes, inputs)
    if bias is None:
        return by_mask, by_mask
    finite = ~np.isneginf(bias) if allowed is None else allowed & ~np.isneginf(bias)
    return by_mask, bool((~finite.any(-1)).any())


def check_masked_rows(backend: str, config: AttentionConfig, shapes: CallShapes, inputs: Mapping, options: Mapping,
                      native: str, how: str, *, by_bias: str | None = None) -> None:
    """Refuse a call with a query row that has no allowed key when the API's
    own answer for such a row (`native`: "zero" | "uniform" | "nan" |
    anything else) is not the case's masked_row policy. `by_bias`: the
    answer for a row left without a key by bias -inf alone, if different."""
    by_mask, by_any = empty_rows(shapes, inputs, options, config)
    if not by_any:
        return
    if not by_mask and by_bias is not None:
        native = by_bias
    # With sinks such a row puts all its mass on the sink: weights and context 0 whatever masked_row says.
    wanted = "zero" if config.use_sinks else config.masked_row
    if native != wanted:
        said = ROW_LABELS.get(native, native)
        asked = "use_sinks (0)" if config.use_sinks else f"masked_row={config.masked_row!r} ({ROW_LABELS[wanted]})"
        raise NotImplementedError(f"{backend}: a query row with no allowed key gives {said} ({how}); the case asks "
                                  + asked)


def check_dropout(backend: str, config: AttentionConfig, inputs: Mapping, options: Mapping) -> None:
    """Training with dropout needs the case's explicit keep-mask, which no native API takes."""
    if options.get("training") and (config.dropout > 0 or inputs.get("dropout_mask") is not None):
        raise NotImplementedError(
            f"{backend}: dropout in training takes no explicit dropout mask (the API draws its own random one), "
            "so its result cannot be compared with the reference's")


def check_default_scale(backend: str, config: AttentionConfig) -> None:
    default = 1.0 / math.sqrt(config.head_dim)
    if config.scale is not None and not math.isclose(config.scale, default, rel_tol=1e-12):
        raise NotImplementedError(f"{backend}: always scales by 1/sqrt(head_dim) = {default:.6g}; the case asks "
                                  f"scale={config.scale}")


def check_layout(backend: str, layout: str, config: AttentionConfig) -> None:
    problems = layouts.cannot_express(layout, config)
    if problems:
        raise NotImplementedError(f"{backend}: its weights ({layout}) cannot express " + "; ".join(problems))


def refuse_weights(backend: str, options: Mapping, why: str) -> None:
    if options.get("return_weights"):
        raise NotImplementedError(f"{backend}: returns no attention weights ({why})")


# -- gradients in a foreign layout -> canonical ------------------------------------------

def grads_to_canonical(layout: str, state: Mapping[str, np.ndarray], **hints) -> dict[str, np.ndarray]:
    """Gradients named and shaped as a layout's state -> canonical names and shapes.

    The layout tables are transposes, reshapes and concatenations only, so
    gradients convert like weights; non-finite entries (a NaN row's gradient)
    are carried through as codes, since the converter refuses NaN and Inf."""
    codes = {k: np.select([np.isnan(v), np.isposinf(v), np.isneginf(v)], [1.0, 2.0, 3.0], 0.0)
             for k, v in ((k, np.asarray(v, dtype=np.float64)) for k, v in state.items())}
    finite = {k: np.where(np.isfinite(np.asarray(v, dtype=np.float64)), v, 0).astype(np.asarray(v).dtype)
              for k, v in state.items()}
    _, tensors = layouts.to_canonical(layout, finite, **hints)
    _, code_tensors = layouts.to_canonical(layout, codes, **hints)
    out = {}
    for name, t in tensors.items():
        code = code_tensors[name]
        t = np.array(t, copy=True)
        if (code != 0).any():
            fill = np.select([code == 1, code == 2, code == 3], [np.nan, np.inf, -np.inf], 0.0)
            t = np.where(code != 0, fill.astype(np.float64), t.astype(np.float64)).astype(t.dtype)
        out[name] = t
    return out


def order_grads(config: AttentionConfig, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """query, key, value, then the canonical tensors in the config's order, then the cache's."""
    names = [n for n in ("query", "key", "value") if n in grads] + list(config.tensor_shapes())
    names += [n for n in ("past_key", "past_value") if n in grads]  # a cache's, after the config's tensors
    missing = [n for n in names if n not in grads]
    assert not missing, f"gradients missing for {missing}"
    return {n: grads[n] for n in names}


def identity_values(S: int, width: int | None = None, dtype=np.float32) -> np.ndarray:
    """(S, width) = [I_S | 0]: as the value of an attention kernel its output
    row t is the weights row t (then zeros): the weights read out of a kernel
    that returns none, computed by the kernel itself."""
    width = S if width is None else width
    eye = np.zeros((S, width), dtype=dtype)
    eye[np.arange(S), np.arange(S)] = 1
    return eye


def classify_row(row, values) -> str:
    """What an API gave for a query row with no allowed key: "nan", "zero",
    "uniform" (the mean of the values) or "other (...)". row (..., V) and
    values (..., S, V) broadcast per head."""
    row = np.asarray(row, dtype=np.float64)
    if np.isnan(row).all():
        return "nan"
    if np.isnan(row).any():
        return "other (partly NaN)"
    mean = np.asarray(values, dtype=np.float64).mean(axis=-2)
    scale = max(1.0, float(np.abs(mean).max()))
    if np.abs(row).max() <= 1e-6:
        return "zero"
    if np.abs(row - mean).max() <= 1e-3 * scale:
        return "uniform"
    return f"other ({' '.join(f'{x:.3g}' for x in row.reshape(-1)[:4])} ...)"


def case_has_empty_rows(case) -> bool:
    """Whether a conformance case (conformance.suite.cases.Case) has a query row
    with no allowed key (mask, causal or bias -inf)."""
    from conformance.suite.cases import make_inputs

    inputs = make_inputs(case)
    shapes = call_shapes(case.config, inputs, case.options("float64"))
    return empty_rows(shapes, inputs, case.options("float64"))[1]


# -- JAX ---------------------------------------------------------------------------------

def jax_devices() -> list[str]:
    import jax

    return ["cpu"] + (["gpu"] if any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()) else [])


def jax_context(device: str, dtype: str, precision: str):
    """x64 for float64 (only then), the device, and float32 matmul precision
    ("highest": no TF32 on GPUs, JAX's default there being reduced)."""
    import contextlib

    import jax

    stack = contextlib.ExitStack()
    if dtype == "float64":
        stack.enter_context(jax.enable_x64(True))
    platform = "cpu" if device == "cpu" else next(d.platform for d in jax.devices() if d.platform != "cpu")
    stack.enter_context(jax.default_device(jax.devices(platform)[0]))
    stack.enter_context(jax.default_matmul_precision("highest" if precision == "highest" else "tensorfloat32"))
    return stack


def jax_jit(fn=None, **kwargs):
    """jax.jit, applied on first call (so jax is imported lazily). Used on one
    function per backend that computes output, weights and gradients
    together: run_case's forward and vjp then share one XLA compile per case
    (compiling is the slow part on CPU: about 1 s a case here, against
    several seconds of op-by-op compiles for eager calls on new shapes).

    One exception, measured with jax 0.10.2: jax.nn.dot_product_attention
    asks for the dot precision preset F16_F16_F32 on float16 inputs inside a
    try/except that falls back to the default precision where the platform
    lacks it; under jit the refusal comes at compile time, outside that try,
    so a jitted float16 call fails on CPU ("The precision 'F16_F16_F32' is
    not supported by dot_general on CPU"). The call then runs eagerly, where
    the fallback works, as it does for a user who does not jit."""
    import functools

    if fn is None:
        return functools.partial(jax_jit, **kwargs)
    compiled = {}

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        if "fn" not in compiled:
            import jax

            compiled["fn"] = jax.jit(fn, **kwargs)
        try:
            return compiled["fn"](*args, **kw)
        except ValueError as err:
            if "is not supported by dot_general" not in str(err):
                raise
            return fn(*args, **kw)

    return wrapper


def jax_array(x, dtype: str | None = None):
    import jax.numpy as jnp

    x = np.asarray(x)
    return jnp.asarray(x) if dtype is None or x.dtype == bool else jnp.asarray(x, dtype=dtype)


def flatten_tree(tree, prefix: str = "") -> dict[str, np.ndarray]:
    """A nested dict of arrays -> {"a/b/c": numpy array}."""
    flat = {}
    for key, value in tree.items():
        if hasattr(value, "items"):
            flat.update(flatten_tree(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = np.asarray(value)
    return flat


def torch_vjp(out, leaves: Mapping, d_output) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Output and the gradients of sum(out * d_output) for each named leaf
    tensor (zeros for a leaf the output does not use), as NumPy arrays."""
    import torch

    from impl_torch.convert import to_numpy, to_torch

    d_out = to_torch(np.asarray(d_output)).to(device=out.device, dtype=out.dtype)
    if tuple(d_out.shape) != tuple(out.shape):
        raise ValueError(f"d_output must have shape (B, T, O) = {tuple(out.shape)}: got {tuple(d_out.shape)}")
    found = torch.autograd.grad(out, list(leaves.values()), grad_outputs=d_out, allow_unused=True)
    grads = {name: to_numpy(torch.zeros_like(leaf) if g is None else g) for (name, leaf), g in zip(leaves.items(), found)}
    return to_numpy(out), grads


# The modern call inputs (positions, KV cache, packed segments), beside the config's modern fields
# (weights.config.MODERN_DEFAULTS).
MODERN_INPUTS = ("positions", "key_positions", "past_key", "past_value", "segment_ids", "key_segment_ids",
                 "past_key_positions", "topk_indices")


# Why a native without an index argument refuses topk_indices (torch-flex takes it in its block mask).
SELECTION_WHY = ("no argument takes key indices: the API would take the selection only as a dense (B, N, T, P+S) "
                 "boolean mask, which this wrapper does not build from topk_indices (torch-flex's block mask does)")


def modern_features(config: AttentionConfig, inputs, options) -> list[str]:
    """The modern fields, inputs and options a call uses: config fields that
    differ from their defaults, modern inputs given, return_cache."""
    from weights.config import MODERN_DEFAULTS

    used = [field for field, default in MODERN_DEFAULTS.items() if getattr(config, field) != default]
    # the later forms of a field a wrapper may express in its first form: named on their own, so that a
    # wrapper that takes qk_norm or rope refuses them unless it says it expresses them too
    norm = config.qk_norm
    if norm is not None:
        used += [f"qk_norm.{key}" for key, default in norm.LATER_KEYS.items() if getattr(norm, key) != default]
    scaling = None if config.rope is None else config.rope.scaling
    if scaling is not None and scaling.type in ("longrope", "proportional"):
        used.append(f"rope.scaling {scaling.type}")
    if config.rope is not None and config.rope.mrope_section is not None:  # three positions per token
        used.append("rope.mrope_section")
    used += [field for field in MODERN_INPUTS if inputs.get(field) is not None]
    used += ["return_cache"] if options.get("return_cache") else []
    return used


def refuse_modern(name: str, config: AttentionConfig, inputs, options, expresses=(), why: str | dict = "") -> None:
    """NotImplementedError for the modern features a wrapper does not express.
    `expresses`: the feature names (modern_features' names) the backend
    passes to its native API or builds around it; every other one used is
    refused, with `why` (the API's reason) when given: one reason for all, or a dict feature -> reason
    (a reason that concerns one feature is not printed for another)."""
    used = [f for f in modern_features(config, inputs, options) if f not in expresses]
    if used:
        reasons = why if isinstance(why, str) else "; ".join(dict.fromkeys(why[f] for f in used if f in why))
        raise NotImplementedError(f"{name}: this wrapper of the native API does not express {', '.join(used)}"
                                  + (f" ({reasons})" if reasons else ""))


def why_each(config: AttentionConfig, inputs, options, default: str, specific: Mapping[str, str]) -> dict[str, str]:
    """refuse_modern's `why` as a dict: each modern feature the call uses -> its own reason where `specific`
    has one, else `default` (the API's general reason)."""
    return {f: specific.get(f, default) for f in modern_features(config, inputs, options)}


def prepare_call(name: str, config: AttentionConfig, tensors, inputs, options, device: str, precision: str,
                 devices: list[str], *, expresses=(), why: str | dict = ""):
    """The start every native backend shares: precision and device checked,
    tensors and inputs cast to the call's dtype, the call validated.
    `expresses`, `why`: the modern features the backend takes (refuse_modern).
    Returns (dtype name, tensors, inputs, CallShapes)."""
    check_precision(precision)
    check_device(name, device, devices)
    refuse_modern(name, config, inputs, options, expresses, why)
    dtype = dtype_name(tensors, options)
    tensors, inputs = cast(tensors, inputs, dtype, config)
    return dtype, tensors, inputs, call_shapes(config, inputs, options)
