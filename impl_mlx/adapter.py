"""The conformance adapter: NumPy arrays in and out (see conformance/suite/backends.py).

The same functions and argument names as impl_numpy/adapter.py and impl_jax/adapter.py. Gradients come
from mx.vjp: query, key, value, past_key and past_value (those given, the cache with P > 0) and every
tensor; forward_and_vjp runs the forward pass and its VJP once for both (`mha check` asks for both).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import weights
from weights.call import (
    COMPRESSED_MIRROR_DTYPES,
    INDEXER_INPUTS,
    OPTIONAL_INPUTS,
    as_compressed,
    compressed_call,
    compressed_vjp_call,
    split_result,
)
from weights.paths import common_path_options, in_place_buffers, index_buffer, new_keys

from .attention import multi_head_attention, plan
from .compressed import compressed_attention
from .convert import to_mx, to_numpy
from .layer import gpu_available, resolve_device

NAME = "mlx"

# DeepSeek V4's layer (config.compressed) runs through this backend's compressed module (impl_mlx.compressed),
# its gradients by mx.vjp: _compressed_gradients.

# The paths `mha check` judges (weights/paths.py): the stages, the fused kernel
# (mx.fast.scaled_dot_product_attention), the chunked core (chunk_size=) and the in-place cache (cache_length=).
PATHS = ("stages", "fused", "chunked", "in_place")
FAST_PATH = "fused"
# DeepSeek V4 (config.compressed): its in-place cache runs on the in_place path (conformance.suite.compare.path_options)
COMPRESSED_IN_PLACE = True
# ... and its block-wise path (compressed_attention's chunk_size=) on the chunked path, differentiated by mx.vjp
COMPRESSED_CHUNKED = True
PRECISIONS = ("highest", "tf32", "default")  # MLX has one float32 matmul: all three compute the same
GPU_FLOAT64 = "float64 runs on MLX's CPU device only (Metal has no float64)"
_DIFFERENTIABLE = ("query", "key", "value", "past_key", "past_value")


def path_options(path: str, config, inputs: dict, options: dict) -> dict | None:
    """The call options that run `path` on this call (weights.paths); NotImplementedError where the fused
    kernel cannot take it, with the plan's reason."""
    if path != "fused":
        return common_path_options(path, inputs, options, paths=PATHS)
    dropout = bool(options.get("training")) and (inputs.get("dropout_mask") is not None or config.dropout > 0)
    chosen = plan(config, return_weights=False, traced=False, chunk_size=None, dropout=dropout,
                  dtype=weights.dtype_from_name(options["dtype"]))
    if chosen.path != "fused":
        raise NotImplementedError(f"the fused path cannot take this call: {chosen.why} (the stages run)")
    return options | {"return_weights": False}


def devices() -> list[str]:
    return ["cpu", "gpu"] if gpu_available() else ["cpu"]


def _check(device: str, precision: str, options: dict):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}: got {precision!r}")
    dev = resolve_device(device)
    if dev == mx.gpu and options.get("dtype") == "float64":
        raise NotImplementedError(GPU_FLOAT64)
    return dev


def _kwargs(options) -> dict:
    return dict(is_causal=bool(options.get("is_causal", False)),
                causal_alignment=options.get("causal_alignment", "top_left"),
                training=bool(options.get("training", False)), seed=options.get("seed"), dtype=options.get("dtype"),
                chunk_size=options.get("chunk_size"))


def _arrays(config, inputs, options, tensors):
    """The call's arrays as mx.arrays (ids and positions as given), and an in-place cache's buffers."""
    arrays = {name: to_mx(inputs[name]) for name in ("query", "key", "value", *OPTIONAL_INPUTS, *INDEXER_INPUTS)
              if inputs.get(name) is not None}
    extra = {}
    if options.get("in_place"):  # the cache in zeroed buffers of capacity P + S + SPARE, written in place
        dtype = weights.dtype_from_name(options.get("dtype") or next(iter(tensors.values())).dtype.name)
        past_key, past_value, P = in_place_buffers(inputs, dtype)
        arrays["past_key"], arrays["past_value"] = to_mx(past_key), to_mx(past_value)
        if config.indexer is not None:  # the indexer's cache in a buffer of the same capacity, written in place
            arrays["past_index_keys"] = to_mx(index_buffer(inputs, past_key.shape[2], dtype))
        extra["cache_length"] = P
    return arrays, extra


def _call(config, params, arrays, options, extra, *, trace=None):
    return_weights, return_cache = bool(options.get("return_weights")), bool(options.get("return_cache"))
    return multi_head_attention(config, params, arrays["query"], arrays.get("key"), arrays.get("value"),
                                **{name: arrays.get(name) for name in OPTIONAL_INPUTS + INDEXER_INPUTS},
                                **_kwargs(options), **extra, return_weights=return_weights, return_cache=return_cache,
                                return_selection=config.indexer is not None, trace=trace)


def _answer(config, inputs, options, result, entries=None) -> dict:
    """The answer as NumPy: output, the weights and the present cache where asked, and with config.indexer its
    selection (always, to be judged) and present_index_keys (with the cache)."""
    return_weights, return_cache = bool(options.get("return_weights")), bool(options.get("return_cache"))
    index = config.indexer is not None
    answer = split_result(result, return_weights, return_cache, to_numpy, return_selection=index, index_cache=index)
    if options.get("in_place") and return_cache:  # the buffers, whole: the cache is their first P + S positions
        S_total = np.shape(inputs["past_key"])[2] + new_keys(inputs, config)
        answer["present_key"], answer["present_value"] = (answer[n][:, :, :S_total] for n in
                                                          ("present_key", "present_value"))
        if index:
            answer["present_index_keys"] = answer["present_index_keys"][:, :S_total]
    if entries is not None:
        answer["trace"] = [(e.stage, to_numpy(e.value)) for e in entries]
    return answer


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    dev = _check(device, precision, options)
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: impl_mlx.compressed
        with mx.stream(dev):
            return compressed_call(compressed_attention, v4, tensors, inputs, options, trace=trace,
                                   convert=to_mx, to_numpy=to_numpy, dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)
    weights.validate_tensors(config, tensors)  # values too, once, in NumPy: the reference's own check
    entries = [] if trace else None
    with mx.stream(dev):
        params = {name: to_mx(t) for name, t in tensors.items()}
        arrays, extra = _arrays(config, inputs, options, tensors)
        result = _call(config, params, arrays, options, extra, trace=entries)
        return _answer(config, inputs, options, result, entries)


def _compressed_gradients(config, params, x, positions, past, d_out, **returns):
    """DeepSeek V4's layer and mx.vjp of its output over x, every tensor and the cache (the present cache rides
    along with zero cotangents; the indexer's tensors, read only by its top-k, get zeros). The selection is not an
    output of the vjp's function: an output under mx.stop_gradient (as the selection is) shifts mx.vjp's pairing
    of the outputs after it with their cotangents (mlx 0.32.4: "[vjp] Output shape (2,1,3,8) does not match
    cotangent shape (2,12,2)" with the present cache asked for); it comes from the plain call before."""
    past = past or {}
    names = ["query", *params, *(f"past_{name}" for name in past)]
    present_names = []  # the present cache's names, in the order f returns its arrays
    selection = []  # the plain call's selection (csa)

    def f(*primals):
        given = dict(zip(names, primals))
        result = compressed_attention(config, {n: given[n] for n in params}, given["query"], positions,
                                      {n: given[f"past_{n}"] for n in past} or None, **returns)
        result = result if isinstance(result, tuple) else (result,)
        present = result[-1] if returns.get("return_cache") else {}
        present_names[:] = list(present)
        if returns.get("return_selection") and not selection:
            selection.append(result[1])
        return [result[0], *present.values()]

    primals = [x, *params.values(), *past.values()]
    outputs = f(*primals)
    cotangents = [d_out.astype(outputs[0].dtype)] + [mx.zeros_like(a) for a in outputs[1:]]
    outputs, grads = mx.vjp(f, primals, cotangents)
    result = (outputs[0],) + ((selection[0],) if returns.get("return_selection") else ())
    if returns.get("return_cache"):
        result += (dict(zip(present_names, outputs[1:])),)
    return result, dict(zip(names, grads))


def forward_and_vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    """forward()'s answer and the gradients from one mx.vjp of the call: the weights and the present cache
    ride along as outputs with zero cotangents."""
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: mx.vjp of impl_mlx.compressed
        dev = _check(device, precision, options)
        with mx.stream(dev):
            return compressed_vjp_call(_compressed_gradients, v4, tensors, inputs, options, d_output, convert=to_mx,
                                       to_numpy=to_numpy, dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)
    dev = _check(device, precision, options)
    weights.validate_tensors(config, tensors)
    with mx.stream(dev):
        params = {name: to_mx(t) for name, t in tensors.items()}
        arrays, extra = _arrays(config, inputs, options, tensors)
        differentiable = [name for name in _DIFFERENTIABLE if name in arrays]
        names = differentiable + list(params)
        others = {name: a for name, a in arrays.items() if name not in differentiable}

        def f(*primals):
            given = dict(zip(names, primals))
            result = _call(config, {n: given[n] for n in params}, {**others, **{n: given[n] for n in differentiable}},
                           options, extra)
            return list(result) if isinstance(result, tuple) else [result]

        primals = [arrays[n] for n in differentiable] + [params[n] for n in params]
        out_shape = f(*primals)
        d_out = to_mx(np.asarray(d_output)).astype(out_shape[0].dtype)
        if tuple(d_out.shape) != tuple(out_shape[0].shape):
            raise ValueError(f"d_output must have shape (B, T, O) = {tuple(out_shape[0].shape)}: got "
                             f"{tuple(d_out.shape)}")
        cotangents = [d_out] + [mx.zeros_like(x) for x in out_shape[1:]]
        outputs, grads = mx.vjp(f, primals, cotangents)
        answer = _answer(config, inputs, options, outputs[0] if len(outputs) == 1 else tuple(outputs))
        by_name = dict(zip(names, grads))
        order = [n for n in ("query", "key", "value") if n in by_name]
        if "past_key" in by_name and np.shape(inputs["past_key"])[2] > 0:
            order += ["past_key", "past_value"]
        order += list(config.tensor_shapes())
        return answer, {n: to_numpy(by_name[n]) for n in order}


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    """Gradients of query, key, value (those given), past_key and past_value (with a cache of P > 0
    positions, as the reference) and every tensor, through mx.vjp."""
    answer, grads = forward_and_vjp(config, tensors, inputs, options, d_output, device=device, precision=precision)
    return {"output": answer["output"], "grads": grads}


def attention(config, tensors, inputs, options) -> dict:
    """`mha verify`'s and the pytest plugin's function (conformance/suite/verify.py): the whole contract through
    impl_mlx, gradients by mx.vjp when the vector gives a cotangent.
    `mha verify --impl impl_mlx.adapter:attention --require-gradients`."""
    from weights import AttentionConfig

    config = AttentionConfig.from_dict(config) if isinstance(config, dict) else config
    options = dict(options)
    cotangent = options.pop("cotangent", None)
    if cotangent is None:
        return forward(config, tensors, inputs, options)
    answer, grads = forward_and_vjp(config, tensors, inputs, options, cotangent)
    return answer | {"grads": grads}
