"""The conformance adapter: NumPy arrays in and out (see conformance/suite/backends.py).

The same three functions and argument names as impl_numpy/adapter.py. It
builds the Keras layer from the canonical tensors and calls it, on the Keras
backend keras was imported on: backend `tf` on TensorFlow, `keras-jax` on
JAX, `keras-torch` on PyTorch (`mha check` runs each in a worker of its own:
Keras fixes its backend at import). Gradients come from the backend's own
autodiff: tf.GradientTape, jax.vjp (through the layer's stateless_call),
torch.autograd. bfloat16 arrays are ml_dtypes.bfloat16. An
options["chunk_size"] selects the chunked path (tests run the grid through it).

On jax, importing this module switches on JAX's x64 mode, process-wide (as
impl_jax/adapter.py does): float64 is one of the conformance dtypes, and JAX
computes it only in x64 mode.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from weights.call import (
    COMPRESSED_MIRROR_DTYPES,
    INDEXER_INPUTS,
    OPTIONAL_INPUTS,
    as_compressed,
    compressed_call,
    compressed_vjp_call,
    split_result,
)
from weights.contract import check_input_values
from weights.paths import common_path_options, in_place_buffers, index_buffer, new_keys

from ._keras import BACKEND, TENSORFLOW, keras
from .attention import CHUNKED_UNSUPPORTED
from .backend import gpus, to_tensor
from .call import IN_PLACE_UNSUPPORTED
from .compressed import CHUNKED_UNSUPPORTED as compressed_chunked_refused
from .compressed import IN_PLACE_UNSUPPORTED as compressed_in_place_refused
from .compressed import check_compressed_call, compressed_attention
from .compressed import layer as compressed_layer
from .layer import MultiHeadAttention, check_device, check_precision

ops = keras.ops

# The conformance backend this module is, by the Keras backend it runs on.
NAMES = {"tensorflow": "tf", "jax": "keras-jax", "torch": "keras-torch"}
NAME = NAMES[BACKEND]

# DeepSeek V4's layer (config.compressed) runs through this backend's compressed module (impl_tf.compressed, in
# keras.ops), its gradients by the Keras backend's own autodiff: _compressed_gradients. Its in-place cache (the
# buffers as tf.Variables: _compressed_forward) and its block-wise path (chunk_size=) run on TensorFlow alone, as
# the regular call's (conformance.suite.compare.path_options reads these two).
COMPRESSED_IN_PLACE = TENSORFLOW
COMPRESSED_CHUNKED = TENSORFLOW
# ... and on jax and torch their reasons, which the keras-jax and keras-torch columns report as unsupported rows
COMPRESSED_REFUSED = {} if TENSORFLOW else {"in_place": compressed_in_place_refused,
                                            "chunked": compressed_chunked_refused}

if BACKEND == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)

# On jax, the XLA compile options of the CPU programs (each call is one: _jax_run): the same as
# impl_jax.adapter.FAST_CPU_COMPILE (LLVM at -O0, XLA's classic fusion emitters, the LLVM module whole; XLA's
# HLO passes as by default: what is computed is decided the same way, only the machine code differs; its
# comment there has the measurements), copied rather than imported: impl_jax.adapter is the jax column's entry
# point, with its own set-up (the Keras worker imports impl_jax's program cache alone: _jax_run).
# With XLA's defaults the keras-jax column of a cold `mha check` took 126 s of CPU, with these 22 s (2-core
# EPYC VM, 2026-11-29, under load; tests/test_keras_backends.py checks they are impl_jax's).
# `mha check --xla-full-opt` compiles with XLA's defaults (set_cpu_compile("default")); GPU programs always do.
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                    "xla_cpu_parallel_codegen_split_count": 1}
_CPU_COMPILE_MODES = ("fast", "default")
_cpu_compile = "fast"


def set_cpu_compile(mode: str) -> None:
    """"fast" (FAST_CPU_COMPILE, the default) or "default" (XLA's own options) for the CPU programs compiled
    from now on on Keras's jax backend; no effect on the other backends (nothing is compiled by XLA there)."""
    global _cpu_compile
    if mode not in _CPU_COMPILE_MODES:
        raise ValueError(f"cpu compile mode must be one of {', '.join(_CPU_COMPILE_MODES)}: got {mode!r}")
    _cpu_compile = mode


def cpu_compile() -> str:
    return _cpu_compile


@functools.cache
def cpu_compile_options() -> dict:
    """FAST_CPU_COMPILE less the options this process's XLA does not know (as impl_jax.adapter's: found once
    by compiling a one-line CPU program, each refusal naming its option)."""
    options = dict(FAST_CPU_COMPILE)
    x = jax.device_put(np.float32(0), jax.devices("cpu")[0])
    while True:
        try:
            jax.jit(lambda a: a + 1, compiler_options=options).lower(x).compile()
            return options
        except Exception as err:
            unknown = re.search(r"No such compile option: '([^']+)'", str(err))
            if unknown is None or unknown.group(1) not in options:
                raise
            del options[unknown.group(1)]


# The paths `mha check` judges (weights/paths.py): the stages, fused_attention (a call without weights or
# trace), the chunked path (chunk_size=) and the in-place cache (cache_length=, tf.Variables); the last two
# on TensorFlow alone (unsupported on jax and torch, with the reason).
PATHS = ("stages", "fused", "chunked", "in_place")
FAST_PATH = "fused"


def path_options(path: str, config, inputs: dict, options: dict) -> dict | None:
    """The call options that run `path` on this call (weights.paths): on TensorFlow every path takes every
    call; on jax and torch the chunked path and the in-place cache raise NotImplementedError (their reason)."""
    if path == "fused":
        return options | {"return_weights": False}
    found = common_path_options(path, inputs, options, paths=PATHS, in_place_forward_only=(
        "an in-place cache is inference only (refused under a recording tape)"))
    if found is not None and not TENSORFLOW and path in ("chunked", "in_place"):
        raise NotImplementedError(CHUNKED_UNSUPPORTED if path == "chunked" else IN_PLACE_UNSUPPORTED)
    return found


def devices() -> list[str]:
    return ["cpu"] + (["gpu"] if gpus() else [])




def _kwargs(inputs, options):
    return dict(
        **{name: None if inputs.get(name) is None else to_tensor(inputs[name])
           for name in OPTIONAL_INPUTS + INDEXER_INPUTS},
        is_causal=bool(options.get("is_causal", False)),
        causal_alignment=options.get("causal_alignment", "top_left"),
        training=bool(options.get("training", False)), seed=options.get("seed"),
        chunk_size=options.get("chunk_size"),
    )


# The last layer built, kept for the next call with the same tensors: `mha check` runs each case's forward
# and vjp on two paths, and building a Keras layer (its variables) costs more than calling it (half of the
# Keras column's time). Reused only where nothing could differ: the same config, dtype, device and
# precision, and tensors of the same names, dtypes, shapes and values (compared against copies kept here,
# so an array changed in place is seen); never for large tensors (REUSE_MAX_BYTES: no copies of a real
# model's weights). The layer draws no dropout of its own here (from_tensors gives it no seed generator).
REUSE_MAX_BYTES = 1 << 20
_last: dict = {}


def _layer(config, tensors, options, device, precision) -> MultiHeadAttention:
    key = (config, options.get("dtype"), device, precision)
    arrays = {name: np.asarray(t) for name, t in tensors.items()}
    kept = _last.get("arrays")
    if (_last.get("key") == key and kept is not None and kept.keys() == arrays.keys()
            and all(kept[n].dtype == a.dtype and kept[n].shape == a.shape and np.array_equal(kept[n], a, equal_nan=True)
                    for n, a in arrays.items())):
        return _last["layer"]
    layer = MultiHeadAttention.from_tensors(
        config, tensors, dtype=options.get("dtype"), device=check_device(device), precision=check_precision(precision)
    )
    _last.clear()
    if sum(a.nbytes for a in arrays.values()) <= REUSE_MAX_BYTES:
        _last.update(key=key, arrays={n: a.copy() for n, a in arrays.items()}, layer=layer)
    return layer


def _numpy(x) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x))


def _check_values(inputs):
    check_input_values(**{name: inputs.get(name) for name in ("query", "key", "value", "past_key", "past_value")})


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: impl_tf.compressed (keras.ops)
        check_device(device), check_precision(precision)
        jit = (cpu_compile_options() if _cpu_compile == "fast" else {}) if BACKEND == "jax" else None
        return compressed_call(functools.partial(_compressed_forward, jit=jit), v4, tensors, inputs, options,
                               trace=trace, convert=to_tensor, to_numpy=_numpy, dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)
    _check_values(inputs)
    layer = _layer(config, tensors, options, device, precision)
    return_weights, return_cache = bool(options.get("return_weights", False)), bool(options.get("return_cache", False))
    kwargs = _kwargs(inputs, options)
    in_place = {}
    if options.get("in_place"):  # the cache in zeroed tf.Variables of capacity P + S + SPARE, written in place
        dtype = options.get("dtype") or np.asarray(next(iter(tensors.values()))).dtype.name
        *buffers, P = in_place_buffers(inputs, np.float64)
        S = new_keys(inputs, config)
        import tensorflow as tf  # only TensorFlow has the in-place cache (path_options says so elsewhere)

        for name, buffer in zip(("past_key", "past_value"), buffers):
            in_place[name] = tf.Variable(ops.cast(buffer, dtype))
        in_place["cache_length"] = P
        if config.indexer is not None:
            in_place["past_index_keys"] = tf.Variable(ops.cast(index_buffer(inputs, buffers[0].shape[2], np.float64),
                                                               dtype))
    selection = config.indexer is not None  # the indexer's selection is returned, to be judged
    query, key, value = (None if inputs.get(n) is None else to_tensor(inputs[n]) for n in ("query", "key", "value"))
    if BACKEND == "jax":  # one compiled program instead of an XLA compile per op and shape (_jax_run)
        given = {n: x for n, x in (("query", query), ("key", key), ("value", value)) if x is not None}
        given |= {n: kwargs.pop(n) for n in ("past_key", "past_value") if kwargs.get(n) is not None}
        result = _jax_run(layer, given, kwargs, None, device, return_weights=return_weights,
                          return_cache=return_cache, return_selection=selection)
    else:
        result = layer(query, key, value, return_weights=return_weights, return_cache=return_cache,
                       return_selection=selection, **(kwargs | in_place))
    answer = split_result(result, return_weights, return_cache, _numpy, return_selection=selection,
                          index_cache=selection)
    if in_place and return_cache:  # the buffers, whole: the cache is their first P + S positions
        answer["present_key"], answer["present_value"] = (answer[name][:, :, :P + S] for name in
                                                          ("present_key", "present_value"))
        if "present_index_keys" in answer:
            answer["present_index_keys"] = answer["present_index_keys"][:, :P + S]
    if trace:  # (on jax the cache went to the program as `given`: the trace takes it back)
        past = {n: given[n] for n in ("past_key", "past_value") if n in given} if BACKEND == "jax" else {}
        _, entries = layer.trace(query, key, value, **kwargs, **past)
        answer["trace"] = [(e.stage, _numpy(e.value)) for e in entries]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    answer, grads = forward_and_vjp(config, tensors, inputs, options, d_output, device=device, precision=precision)
    return {"output": answer["output"], "grads": grads}


def forward_and_vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    """forward()'s answer and vjp()'s gradients of one call, from one recorded pass: `mha check` asks for
    both, and the eager Keras pass is most of this backend's time there. (forward's weights and present
    cache are the same call's; an in-place cache, inference only, goes through forward alone.)"""
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: impl_tf.compressed's layer, differentiated
        check_device(device), check_precision(precision)
        jit = (cpu_compile_options() if _cpu_compile == "fast" else {}) if BACKEND == "jax" else None
        return compressed_vjp_call(functools.partial(_compressed_gradients, jit=jit), v4, tensors, inputs, options,
                                   d_output, convert=to_tensor, to_numpy=_numpy, dtypes=COMPRESSED_MIRROR_DTYPES,
                                   backend=NAME)
    if options.get("in_place"):
        raise ValueError("forward_and_vjp: an in-place cache is inference only (refused under a recording tape)")
    _check_values(inputs)
    layer = _layer(config, tensors, options, device, precision)
    given, variables, kwargs, returns = _vjp_call(layer, config, inputs, options)
    d_out = np.asarray(d_output)

    def call(inputs_now, fn=layer):  # fn: the layer, or a stateless form of it (jax)
        return fn(inputs_now["query"], inputs_now.get("key"), inputs_now.get("value"), **returns,
                  **kwargs, **{n: inputs_now[n] for n in ("past_key", "past_value") if n in inputs_now})

    if BACKEND == "jax":  # one compiled program: the call and its vjp (_jax_run)
        result, found = _jax_gradients(layer, given, kwargs, list(variables.values()), d_out, device, **returns)
    else:
        result, found = _GRADIENTS[BACKEND](layer, call, given, list(variables.values()), d_out, device)
    return _answer_and_grads(config, result, found, given, variables, returns)


def _vjp_call(layer, config, inputs, options):
    """A call's differentiable inputs as tensors ({name: tensor}), the layer's canonical variables, its other
    keyword arguments (the cache comes from the inputs) and what it returns (return_weights, return_cache,
    return_selection)."""
    differentiable = ("query", "key", "value", "past_key", "past_value")  # the float inputs, in the reference's order
    given = {n: to_tensor(inputs[n]) for n in differentiable if inputs.get(n) is not None}
    kwargs = {n: x for n, x in _kwargs(inputs, options).items() if n not in given}  # the cache: from `given`
    return given, layer.canonical_variables(), kwargs, _returns(config, options)


def _returns(config, options) -> dict:
    """What a call returns: return_weights (the weights run the stages), return_cache, return_selection (the
    indexer's selection, to be judged)."""
    return dict(return_weights=bool(options.get("return_weights", False)),
                return_cache=bool(options.get("return_cache", False)), return_selection=config.indexer is not None)


def _answer_and_grads(config, result, found, given, variables, returns):
    """forward()'s answer and the gradients by canonical name, from a call's result and its gradients over
    `given` then `variables` (None: not read, zeros)."""
    answer = split_result(result, returns["return_weights"], returns["return_cache"], _numpy,
                          return_selection=returns["return_selection"], index_cache=returns["return_selection"])
    dtype = answer["output"].dtype
    sources = [*given.values(), *variables.values()]
    shapes = config.tensor_shapes()
    grads = {}
    for name, source, g in zip([*given, *variables], sources, found):
        g = np.zeros(tuple(source.shape), dtype) if g is None else _numpy(g).astype(dtype)  # None: not read (a
        # latent layer's value)
        grads[name] = g.reshape(shapes[name]) if name in shapes else g  # Dense layout -> canonical shape
    return answer, grads


if BACKEND == "jax":
    def forward_and_vjp_paths(config, tensors, inputs, options_list, d_output, *, device="cpu", precision="highest"):
        """forward_and_vjp() of several calls on the same inputs (one case's stages and fused path) from ONE
        compiled program holding each call's forward and VJP side by side (as impl_jax.adapter's, whose
        docstring has the why and the measurement): [(answer, grads), ...] in options_list's order. Keras's
        jax backend alone; an in-place cache, V4's layer or calls whose other arguments differ: ValueError
        (each runs alone)."""
        if as_compressed(config) is not None or any(o.get("in_place") for o in options_list):
            raise ValueError("forward_and_vjp_paths takes calls with a VJP and no in-place cache, of a layer "
                             "that multi_head_attention runs")
        differ = ("return_weights", "return_cache")  # what the calls may differ in: all else is one call's
        if any({k: v for k, v in o.items() if k not in differ} != {k: v for k, v in options_list[0].items()
                                                                 if k not in differ} for o in options_list[1:]):
            raise ValueError("forward_and_vjp_paths takes calls whose options differ only in what they return")
        check_device(device), check_precision(precision)
        _check_values(inputs)
        layer = _layer(config, tensors, options_list[0], device, precision)
        given, variables, kwargs, _ = _vjp_call(layer, config, inputs, options_list[0])
        calls = [_returns(config, options) for options in options_list]
        ran = _jax_gradients(layer, given, kwargs, list(variables.values()), np.asarray(d_output), device,
                             paths=calls)
        return [_answer_and_grads(config, result, found, given, variables, returns)
                for returns, (result, found) in zip(calls, ran)]


def _compressed_forward(config, params, x, positions, past, *, in_place: bool = False, **kwargs):
    """impl_tf.compressed.compressed_attention; in place (TensorFlow alone, else its NotImplementedError), the
    buffers compressed_call hands over as tensors put into tf.Variables first, which the call writes and returns
    as its present cache."""
    if in_place and TENSORFLOW:
        import tensorflow as tf

        past = {name: tf.Variable(a) for name, a in past.items()}
    return compressed_attention(config, params, x, positions, past, in_place=in_place, **kwargs)


def _compressed_gradients(config, params, x, positions, past, d_out, *, jit, **returns):
    """DeepSeek V4's layer (impl_tf.compressed.layer) and the gradients of its output over x, every tensor and the
    cache, by the Keras backend's autodiff: a GradientTape (tensorflow), jax.vjp in one jax.jit program with the
    forward's XLA options `jit` (jax), torch.autograd.grad (torch). The indexer's tensors, read only by its
    top-k, come back None (zeros)."""
    p0 = check_compressed_call(config, x, np.asarray(positions), past)
    leaves = {"query": x, **params, **{f"past_{name}": a for name, a in (past or {}).items()}}

    def call(given):
        result = compressed_layer(config, {n: given[n] for n in params}, given["query"],
                                  None if past is None else {n: given[f"past_{n}"] for n in past}, p0=p0, **returns)
        return result if isinstance(result, tuple) else (result,)

    if BACKEND == "jax":
        def with_output(given):
            result = call(given)
            return result[0], result

        def run(given, d):
            _, pullback, result = jax.vjp(with_output, given, has_aux=True)
            return result, pullback(d)[0]

        return jax.jit(run, compiler_options=jit or None)(leaves, d_out)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(list(leaves.values()))
            result = call(leaves)
        found = tape.gradient(result[0], list(leaves.values()), output_gradients=d_out)
        return result, dict(zip(leaves, found))
    import torch

    leaves = {name: a.detach().requires_grad_(True) for name, a in leaves.items()}
    result = call(leaves)
    found = torch.autograd.grad(result[0], list(leaves.values()), grad_outputs=d_out, allow_unused=True)
    return result, dict(zip(leaves, found))


def attention(config, tensors, inputs, options) -> dict:
    """`mha verify`'s and the pytest plugin's function (conformance/suite/verify.py): the whole contract through
    impl_tf's layer on the Keras backend Keras runs on (KERAS_BACKEND: the backend NAME, tf, keras-jax or
    keras-torch, as `mha check` names the column), gradients by that backend's autodiff when the vector gives
    a cotangent. `KERAS_BACKEND=jax mha verify --impl impl_tf.adapter:attention --require-gradients`."""
    from weights import AttentionConfig

    config = AttentionConfig.from_dict(config) if isinstance(config, dict) else config
    options = dict(options)
    cotangent = options.pop("cotangent", None)
    if cotangent is None:
        return forward(config, tensors, inputs, options)
    answer, grads = forward_and_vjp(config, tensors, inputs, options, cotangent)
    return answer | {"grads": grads}


# -- gradients, through each backend's own autodiff ---------------------------------------------
# Each: (layer, call(inputs[, fn]) -> the layer's result, inputs {name: tensor}, variables [keras.Variable],
# d_out ndarray (B, T, O), device) -> (result, [gradient or None per input, then per variable]).

def _output(result):
    return result[0] if isinstance(result, (tuple, list)) else result  # the gradient is the output's


def _check_cotangent(out, d_out):
    if d_out.shape != tuple(out.shape):
        raise ValueError(f"d_output must have shape (B, T, O) = {tuple(out.shape)}: got {d_out.shape}")


def _tensorflow_gradients(layer, call, given, variables, d_out, device):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(list(given.values()))
        result = call(given)
        out = _output(result)
    _check_cotangent(out, d_out)
    found = tape.gradient(out, [*given.values(), *variables], output_gradients=ops.cast(d_out, out.dtype))
    return result, found


# -- Keras's jax backend: each call one compiled program ------------------------------------------
# Eagerly, JAX compiles every op for every new shape: the grid's cases ran about 5x the CPU time of one
# program per call (ten cases in four dtypes, 110 s eagerly against 22 s compiled; impl_jax's own programs
# 14 s). The program is the layer's stateless_call (as Keras's own jax trainer calls a layer) and, with a
# cotangent, its jax.vjp over the inputs and the trainable variables' values. Every array is an argument of
# the program, never a constant of its trace, so a program is decided by _JaxCall and the arrays' shapes
# and dtypes alone: with a directory set (set_program_cache: `mha check`) it is kept on disk and found again
# before any tracing (impl_jax/programs.py; tracing and lowering were 21 of this column's 27 s of CPU in a
# warm check, measured 2026-11-29 on the 2-core EPYC VM under cProfile).

@dataclasses.dataclass(frozen=True)
class _JaxCall:
    """What decides a program besides its arrays: the layer's structure (config, dtype, device, precision),
    the call's non-array options, what it returns."""

    config: object
    dtype: str
    device: str | None
    precision: str
    options: tuple  # ((name, value), ...): the call's options that are not arrays
    return_weights: bool
    return_cache: bool
    return_selection: bool


_ARRAY_KWARGS = OPTIONAL_INPUTS + INDEXER_INPUTS  # the call's options that are arrays: the program's arguments
_tracing: dict = {}  # the last _JaxCall -> its layer, for a trace (the layer's values come as arguments)


def _jax_apply(call: _JaxCall, given, arrays, trainable, other):
    layer = _tracing[call]
    result = layer.stateless_call(trainable, other, given["query"], given.get("key"), given.get("value"),
                                  return_weights=call.return_weights, return_cache=call.return_cache,
                                  return_selection=call.return_selection, **arrays, **dict(call.options),
                                  **{n: given[n] for n in ("past_key", "past_value") if n in given})
    return result[0]


def _jax_apply_and_vjp(call: _JaxCall, given, arrays, trainable, other, cotangent):
    def run(given_now, trainable_now):
        result = _jax_apply(call, given_now, arrays, trainable_now, other)
        return _output(result), result

    out, pullback, result = jax.vjp(run, given, trainable, has_aux=True)
    return result, pullback(cotangent.astype(out.dtype))


def _jax_paths_and_vjps(calls: tuple, given, arrays, trainable, other, cotangent):
    return tuple(_jax_apply_and_vjp(call, given, arrays, trainable, other, cotangent) for call in calls)


@functools.cache
def _paths_program(fast: bool):
    return jax.jit(_jax_paths_and_vjps, static_argnums=0, compiler_options=cpu_compile_options() if fast else None)


@functools.cache
def _program(with_vjp: bool, fast: bool):
    return jax.jit(_jax_apply_and_vjp if with_vjp else _jax_apply, static_argnums=0,
                   compiler_options=cpu_compile_options() if fast else None)


_program_directory = None


def set_program_cache(directory) -> None:
    """Keep the compiled CPU programs of Keras's jax backend under this directory, found without tracing
    (impl_jax/programs.py, keyed by impl_tf's and weights' sources and Keras's version and configuration);
    None: jax.jit's own caches only. No effect on the other Keras backends."""
    global _program_directory
    _program_directory = directory


def _jax_run(layer, given, kwargs, cotangent, device, paths=None, **returns):
    """The layer's call on these inputs ({name: tensor}: query, key, value, the past cache) and options (the
    other arrays and the call's settings), compiled; with a cotangent, (result, (d_given, d_trainable)).
    paths (with a cotangent): several calls that differ only in what they return (a returns dict each), as one
    program: their (result, (d_given, d_trainable)) in order."""
    from impl_jax import programs  # the same on-disk programs as impl_jax's (its CPU-keyed cache)

    arrays = {n: x for n, x in kwargs.items() if n in _ARRAY_KWARGS and x is not None}
    options = tuple(sorted((n, x) for n, x in kwargs.items() if n not in _ARRAY_KWARGS))
    calls = tuple(_JaxCall(layer.config, layer.dtype_policy.name, layer.device, layer.precision, options, **r)
                  for r in (paths or [returns]))
    _tracing.clear()
    _tracing.update((call, layer) for call in calls)
    on_cpu = check_device(device) in (None, "cpu") and not gpus()
    fast = _cpu_compile == "fast" and on_cpu
    dynamic = (given, arrays, [v.value for v in layer.trainable_variables],
               [v.value for v in layer.non_trainable_variables]) + (() if cotangent is None else (cotangent,))
    programs.set_directory(_program_directory)
    name = (f"keras {keras.__version__} {keras.config.floatx()} {keras.config.epsilon()} "
            f"{cpu_compile_options() if fast else 'default'}" + (" vjp" if cotangent is not None else "")
            + (" paths" if paths else ""))
    program = _paths_program(fast) if paths else _program(cotangent is not None, fast)
    return programs.run(name, program, jax.devices("cpu" if on_cpu else None)[0],
                        (calls,) if paths else calls, {}, dynamic, packages=("impl_tf", "weights"))


def _jax_gradients(layer, given, kwargs, variables, d_out, device, paths=None, **returns):
    """jax.vjp of the layer's stateless_call over the inputs and its trainable variables' values, with the
    output's cotangent: one program (_jax_run). paths (a returns dict each): several calls that differ only in
    what they return, in that one program: [(result, gradients), ...]."""
    trainable = layer.trainable_variables
    index = {id(v): i for i, v in enumerate(trainable)}
    query = given["query"]
    _check_cotangent(jax.ShapeDtypeStruct((*query.shape[:2], layer.config.out_dim), query.dtype), d_out)
    cotangent = to_tensor(d_out.astype(np.float32) if d_out.dtype.name == "bfloat16" else d_out)  # no program
    ran = _jax_run(layer, given, kwargs, cotangent, device, paths=paths, **returns)
    found = [(result, [*(d_inputs[n] for n in given), *(d_trainable[index[id(v)]] for v in variables)])
             for result, (d_inputs, d_trainable) in (ran if paths else [ran])]
    return found if paths else found[0]


def _torch_gradients(layer, call, given, variables, d_out, device):
    """torch.autograd.grad of the output over the inputs (leaf tensors that require grad) and the
    variables' torch parameters."""
    import torch

    given = {n: x.detach().requires_grad_(True) for n, x in given.items()}
    result = call(given)
    out = _output(result)
    _check_cotangent(out, d_out)
    sources = [*given.values(), *(v.value for v in variables)]
    found = torch.autograd.grad(out, sources, grad_outputs=ops.cast(to_tensor(d_out), out.dtype),
                                allow_unused=True)
    return result, list(found)


_GRADIENTS = {"tensorflow": _tensorflow_gradients, "torch": _torch_gradients}  # jax: _jax_gradients
