"""The conformance adapter: NumPy arrays in and out (see conformance/suite/backends.py).

The same three functions and argument names as impl_numpy/adapter.py.
Validation runs on the host, on the NumPy arrays (bias values included);
then one jitted program (compiled once per config, shapes, dtype and
options) runs on the chosen device. Gradients come from jax.vjp: query,
key, value, past_key and past_value (those given) and every tensor.

Importing this module switches on JAX's x64 mode, process-wide: float64 is
one of the conformance dtypes and JAX computes it only in x64 mode. Every
array impl_jax makes has an explicit dtype, so float32, float16 and bfloat16
results are the same with x64 on or off (tests/test_jax.py checks that).
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np

import weights
from weights.call import (
    COMPRESSED_MIRROR_DTYPES,
    INDEXER_INPUTS,
    OPTIONAL_INPUTS,
    as_compressed,
    compressed_call,
    compressed_vjp_call,
)
from weights.contract import check_input_values
from weights.paths import common_path_options, in_place_buffers, index_buffer, new_keys

from . import programs
from .attention import apply, plan
from .call import check
from .compressed import check_compressed_call, compressed_attention
from .compressed import layer as compressed_layer
from .heads import trace_stages
from .layer import gpu_available, resolve_device

jax.config.update("jax_enable_x64", True)

NAME = "jax"

# DeepSeek V4's layer (config.compressed) runs through this backend's compressed module (impl_jax.compressed),
# its gradients by jax.vjp of its layer(): _compressed_gradients.
# Its block-wise path (compressed_attention's chunk_size=) runs on the chunked path, jitted, differentiated by
# jax.vjp (conformance.suite.compare.path_options).
COMPRESSED_CHUNKED = True

# The paths `mha check` judges (weights/paths.py): the stages, fused_attention (float32 and float64 storage
# without dropout), the chunked core (chunk_size=) and the in-place cache (cache_length=).
PATHS = ("stages", "fused", "chunked", "in_place")
FAST_PATH = "fused"
# DeepSeek V4 (config.compressed): its in-place cache (buffers donated to a jitted call, written by .at[].set)
# runs on the in_place path (conformance.suite.compare.path_options)
COMPRESSED_IN_PLACE = True


def path_options(path: str, config, inputs: dict, options: dict) -> dict | None:
    """The call options that run `path` on this call (weights.paths); None where the path does not exist for
    it (fused_attention in 16-bit storage: plan's stages round every result to it); NotImplementedError
    where it cannot take the call, with the plan's reason."""
    if path != "fused":
        return common_path_options(path, inputs, options, paths=PATHS)
    dtype = weights.dtype_from_name(options["dtype"])
    if weights.compute_dtype(dtype) != dtype:
        return None
    dropout = bool(options.get("training")) and (inputs.get("dropout_mask") is not None or config.dropout > 0)
    chosen = plan(return_weights=False, traced=False, chunk_size=None, dropout=dropout, dtype=dtype)
    if chosen.path != "fused":
        raise NotImplementedError(f"the fused path cannot take this call: {chosen.why} (the stages run)")
    return options | {"return_weights": False}


_ARRAYS = ("query", "key", "value", *OPTIONAL_INPUTS, *INDEXER_INPUTS)
# The inputs jax.vjp differentiates (those given); the others (masks, ids) are not differentiable.
_DIFFERENTIABLE = ("query", "key", "value", "past_key", "past_value")


def devices() -> list[str]:
    return ["cpu", "gpu"] if gpu_available() else ["cpu"]


def _static(options, precision):
    """The call's static options, as apply's keyword arguments (hashable)."""
    return (
        ("is_causal", bool(options.get("is_causal", False))),
        ("causal_alignment", options.get("causal_alignment", "top_left")),
        ("training", bool(options.get("training", False))),
        ("seed", options.get("seed")),
        ("dtype", options.get("dtype")),
        ("precision", precision),
        ("chunk_size", options.get("chunk_size")),
        ("cache_length", options.get("cache_length")),
    )


def _call(config, params, arrays, static, **extra):
    return apply(config, params, arrays["query"], arrays.get("key"), arrays.get("value"),
                 **{name: arrays.get(name) for name in OPTIONAL_INPUTS + INDEXER_INPUTS}, **dict(static), **extra)


def _forward_and_vjp(config, params, arrays, d_output, *, static, return_weights, return_cache, with_trace):
    """The forward pass and its VJP (jax.vjp) in one compiled program.

    forward() and vjp() both run it (forward with a zero cotangent), so a
    case compiles once, not twice: XLA compilation dominates the suite's time
    (0.3 to 0.8 s of CPU per program here, against milliseconds of running),
    and the backward pass costs about twice the forward at these sizes.
    The weights, the present cache and the trace ride along as auxiliary
    outputs (not differentiated)."""
    inputs = {name: arrays[name] for name in _DIFFERENTIABLE if name in arrays}
    others = {name: arrays[name] for name in arrays if name not in inputs}

    def f(params, inputs):
        entries = [] if with_trace else None
        selection = config.indexer is not None  # the indexer's selection rides along, to be judged
        result = _call(config, params, {**inputs, **others}, static, return_weights=return_weights,
                       return_cache=return_cache, trace=entries, return_selection=selection)
        parts = list(result) if (return_weights or return_cache or selection) else [result]
        out = parts.pop(0)
        w = parts.pop(0) if return_weights else None
        chosen = parts.pop(0) if selection else None
        cache = tuple(parts) if return_cache else None
        return out, (w, (chosen, cache), None if entries is None else [e.value for e in entries])

    out, pullback, (w, cache, stages) = jax.vjp(f, params, inputs, has_aux=True)
    d_params, d_inputs = pullback(d_output.astype(out.dtype))
    return out, w, cache, stages, d_params, d_inputs


# XLA compile options for the CPU programs of the conformance suite. A case's
# program runs in microseconds and compiles in about half a second, most of it
# in LLVM's optimiser and XLA's newer fusion emitters; LLVM at -O0 with the
# classic emitters compiles the same optimised HLO about 4x faster (16 cases:
# 8.5 s -> 2.0 s here), which is what lets a cold `mha check` fit a minute.
# XLA's HLO passes (fusion, layout, simplification: where what is computed is
# decided) run as by default; these options change how the fused kernels are
# turned into machine code. `mha check --xla-full-opt` compiles with XLA's
# defaults instead; GPU programs always do. The LLVM module is also compiled
# whole instead of split into parallel parts (xla_cpu_parallel_codegen_split_count
# 1): the parts' set-up costs more than the parallelism saves on programs this
# small (a case's program: 64 -> 38 ms, modern_everything 133 -> 102 ms here),
# and the same code comes out. An XLA that no longer knows one of these options
# (jax 0.11.2's has no xla_cpu_use_fusion_emitters: seen on a GPU machine) compiles
# with the others: cpu_compile_options().
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                    "xla_cpu_parallel_codegen_split_count": 1}
_STATIC_ARGNAMES = ("config", "static", "return_weights", "return_cache", "with_trace")
_PROGRAM_NAMES = ("fast", "default")
_cpu_compile = "fast"


@functools.cache
def cpu_compile_options() -> dict:
    """FAST_CPU_COMPILE less the options this process's XLA does not know, found once by compiling a
    one-line CPU program (each refusal names its option)."""
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


def compile_options(name: str) -> dict:
    """The options of program `name`: "fast" (CPU programs, see FAST_CPU_COMPILE) or "default"."""
    return cpu_compile_options() if name == "fast" else {}


def program(name: str, with_vjp: bool = True):
    """The jitted forward-and-vjp program compiled with compile_options(name); with_vjp=False: the forward
    alone (an in-place cache: inference only, so the backward pass would be compiled for nothing)."""
    return _program(name, bool(with_vjp))


@functools.cache
def _program(name: str, with_vjp: bool):
    return jax.jit(_forward_and_vjp if with_vjp else _forward_only, static_argnames=_STATIC_ARGNAMES,
                   compiler_options=compile_options(name) or None)


def _forward_only(config, params, arrays, d_output, *, static, return_weights, return_cache, with_trace):
    """_forward_and_vjp's results without the VJP (its gradient slots None)."""
    entries = [] if with_trace else None
    selection = config.indexer is not None
    result = _call(config, params, arrays, static, return_weights=return_weights, return_cache=return_cache,
                   trace=entries, return_selection=selection)
    parts = list(result) if (return_weights or return_cache or selection) else [result]
    out = parts.pop(0)
    w = parts.pop(0) if return_weights else None
    chosen = parts.pop(0) if selection else None
    cache = tuple(parts) if return_cache else None
    return out, w, (chosen, cache), None if entries is None else [e.value for e in entries], None, None


def set_cpu_compile(mode: str) -> None:
    """"fast" (the default: FAST_CPU_COMPILE) or "default" (XLA's own options)
    for the CPU programs this adapter compiles from now on."""
    global _cpu_compile
    if mode not in _PROGRAM_NAMES:
        raise ValueError(f"cpu compile mode must be one of {', '.join(_PROGRAM_NAMES)}: got {mode!r}")
    _cpu_compile = mode


def cpu_compile() -> str:
    return _cpu_compile


def set_program_cache(directory) -> None:
    """Keep the compiled CPU programs under this directory, found without tracing (impl_jax/programs.py);
    None: jax.jit's own caches only."""
    programs.set_directory(directory)


def _prepare(config, tensors, inputs, options, d_output, *, device, precision, place: bool = True):
    """Validate one call on the host and place it on the device: (the call's static keyword arguments,
    whether it runs the VJP, the device, its arrays (params, arrays, d_output) there; None with place=False)."""
    weights.validate_tensors(config, tensors)  # values too, once, in NumPy: the reference's own check
    if options.get("in_place"):  # the cache in zeroed buffers of capacity P + S + SPARE (cache_length=P)
        past_key, past_value, P = in_place_buffers(inputs, np.asarray(inputs["past_key"]).dtype)
        inputs = dict(inputs, past_key=past_key, past_value=past_value)
        if config.indexer is not None:
            inputs["past_index_keys"] = index_buffer(inputs, past_key.shape[2], past_key.dtype)
        options = options | {"cache_length": P}
    static = _static(options, precision)
    return_weights = bool(options.get("return_weights", False))
    return_cache = bool(options.get("return_cache", False))
    host = {name: np.asarray(inputs[name]) for name in _ARRAYS if inputs.get(name) is not None}
    checked = {name: value for name, value in static if name != "chunk_size"}
    shapes, dtype = check(config, tensors, host["query"], host.get("key"), host.get("value"),
                          **{name: host.get(name) for name in OPTIONAL_INPUTS + INDEXER_INPUTS},
                          return_weights=return_weights, return_cache=return_cache,
                          materializes_scores=options.get("chunk_size") is None, **checked)
    check_input_values(query=host["query"], key=host.get("key"), value=host.get("value"))
    if "past_key" in host:
        check_input_values(past_key=host["past_key"], past_value=host["past_value"])
    want = (shapes.B, shapes.T, config.out_dim)
    with_vjp = d_output is not None or not options.get("in_place")  # an in-place forward: inference only
    if d_output is None:
        d_output = np.zeros(want, dtype)
    d_output = np.asarray(d_output)
    if d_output.shape != want:
        raise ValueError(f"d_output must have shape (B, T, O) = {want}: got {d_output.shape}")
    dev = resolve_device(device)
    arrays = jax.device_put((dict(tensors), host, d_output.astype(dtype)), dev) if place else None
    return dict(static=static, return_weights=return_weights, return_cache=return_cache), with_vjp, dev, arrays


def _run(config, tensors, inputs, options, d_output, *, device, precision, with_trace):
    """Validate on the host, place everything on the device, run the program."""
    kwargs, with_vjp, dev, arrays = _prepare(config, tensors, inputs, options, d_output, device=device,
                                             precision=precision)
    name = _cpu_compile if dev.platform == "cpu" else "default"
    return programs.run(repr(compile_options(name)) + ("" if with_vjp else " forward only"), program(name, with_vjp),
                        dev, (config,), dict(kwargs, with_trace=with_trace), arrays)


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: impl_jax.compressed, one program
        dev = resolve_device(device)
        jit = compile_options(_cpu_compile if dev.platform == "cpu" else "default")  # as the layer's programs
        # on the device as jax arrays: an in-place cache's buffers are donated to the call and written there
        return compressed_call(functools.partial(compressed_attention, jit=jit), v4, tensors, inputs, options,
                               convert=lambda a: jax.device_put(a, dev), trace=trace,
                               dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)
    out, w, cache, stages, _, _ = _run(config, tensors, inputs, options, None, device=device, precision=precision,
                                       with_trace=bool(trace))
    return _answer(config, inputs, options, out, w, cache, stages if trace else None)


def forward_and_vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    """forward()'s answer and vjp()'s gradients from one run of the call's program (it computes both: see
    _forward_and_vjp); `mha check` asks for both."""
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: jax.vjp of impl_jax.compressed's layer
        dev = resolve_device(device)
        jit = compile_options(_cpu_compile if dev.platform == "cpu" else "default")
        return compressed_vjp_call(functools.partial(_compressed_gradients, jit=jit, device=dev), v4, tensors,
                                   inputs, options, d_output, dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)
    out, w, cache, _, d_params, d_inputs = _run(config, tensors, inputs, options, d_output, device=device,
                                                precision=precision, with_trace=False)
    return _answer(config, inputs, options, out, w, cache, None), _grads(config, inputs, d_params, d_inputs)


def forward_and_vjp_paths(config, tensors, inputs, options_list, d_output, *, device="cpu", precision="highest"):
    """forward_and_vjp() of several calls on the same inputs (one case's paths: the stages and the fused
    path) from ONE compiled program that holds each call's forward and VJP side by side, independent of each
    other: [(answer, grads), ...] in options_list's order. `mha check` runs a case's paths this way
    (conformance.suite.compare.run_case_paths): a cold check compiles one program per case where it compiled
    one per path, and XLA computes the projections the calls share once (the same operations on the same
    values: the same results). Measured on 39 grid cases, float32, 2-core EPYC VM, 2026-11-29: 6.6-6.9 s of
    CPU to lower and compile the pairs apart, 5.5-5.7 s together. Calls that write an in-place cache or skip
    the VJP are not taken (ValueError): they run alone."""
    if as_compressed(config) is not None or any(o.get("in_place") for o in options_list) or d_output is None:
        raise ValueError("forward_and_vjp_paths takes calls with a VJP and no in-place cache, of a layer that "
                         "multi_head_attention runs")
    prepared = [_prepare(config, tensors, inputs, options, d_output, device=device, precision=precision,
                         place=i == 0) for i, options in enumerate(options_list)]  # one set of arrays serves all
    dev, arrays = prepared[0][2], prepared[0][3]
    statics = tuple((kwargs["static"], kwargs["return_weights"], kwargs["return_cache"])
                    for kwargs, _, _, _ in prepared)
    name = _cpu_compile if dev.platform == "cpu" else "default"
    results = programs.run(repr(compile_options(name)) + " paths", _paths_program(name), dev, (config,),
                           dict(statics=statics), arrays)
    answers = []
    for options, (out, w, cache, _, d_params, d_inputs) in zip(options_list, results):
        answers.append((_answer(config, inputs, options, out, w, cache, None), _grads(config, inputs, d_params,
                                                                                     d_inputs)))
    return answers


@functools.cache
def _paths_program(name: str):
    return jax.jit(_forward_and_vjp_paths, static_argnames=("config", "statics"),
                   compiler_options=compile_options(name) or None)


def _forward_and_vjp_paths(config, params, arrays, d_output, *, statics):
    """_forward_and_vjp of each call in statics ((static, return_weights, return_cache) each) on the same
    arrays, in one program."""
    return tuple(_forward_and_vjp(config, params, arrays, d_output, static=static, return_weights=weights_,
                                  return_cache=cache, with_trace=False) for static, weights_, cache in statics)


def _compressed_gradients(config, params, x, positions, past, d_out, *, jit, device, return_selection, return_cache,
                          chunk_size=None):
    """DeepSeek V4's layer and jax.vjp of its output over x, every tensor and the cache: one jax.jit program
    (XLA's options `jit`, as the forward's). The indexer's tensors, read only by its top-k, get zeros. chunk_size:
    the block-wise path (attend_blockwise)."""
    p0 = check_compressed_call(config, np.asarray(x), np.asarray(positions), past)

    def run(p, x, past, d_out):
        def f(p, x, past):
            result = compressed_layer(config, p, x, past, p0=p0, return_cache=return_cache,
                                      return_selection=return_selection, chunk_size=chunk_size)
            result = result if isinstance(result, tuple) else (result,)
            return result[0], result
        _, pullback, result = jax.vjp(f, p, x, past, has_aux=True)
        return result, pullback(d_out)

    arrays = jax.device_put((params, x, past, d_out), device)
    result, (d_p, d_x, d_past) = jax.jit(run, compiler_options=jit or None)(*arrays)
    return result, {"query": d_x, **d_p, **{f"past_{name}": g for name, g in (d_past or {}).items()}}


def _answer(config, inputs, options, out, w, cache, stages) -> dict:
    """The forward answer as NumPy: output, and the weights, the present cache and the trace where asked; cache:
    (the indexer's selection or None, the present cache or None)."""
    answer = {"output": np.asarray(out)}
    if w is not None:
        answer["weights"] = np.asarray(w)
    selection, cache = cache
    if selection is not None:
        answer["selection"] = np.asarray(selection)
    if cache is not None:
        answer["present_key"], answer["present_value"] = (np.asarray(x) for x in cache[:2])
        if len(cache) > 2:
            answer["present_index_keys"] = np.asarray(cache[2])
        if options.get("in_place"):  # the buffers, whole: the cache is their first P + S positions
            S_total = np.shape(inputs["past_key"])[2] + new_keys(inputs, config)
            answer["present_key"], answer["present_value"] = (answer[name][:, :, :S_total] for name in
                                                              ("present_key", "present_value"))
            if "present_index_keys" in answer:
                answer["present_index_keys"] = answer["present_index_keys"][:, :S_total]
    if stages is not None:
        names = trace_stages(config)
        assert len(stages) == len(names), (len(stages), names)
        answer["trace"] = [(stage, np.asarray(value)) for stage, value in zip(names, stages)]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    """Gradients of query, key, value (those given), past_key and past_value
    (with a cache of P > 0 positions, as the reference) and every tensor."""
    if as_compressed(config) is not None:
        answer, grads = forward_and_vjp(config, tensors, inputs, options, d_output, device=device,
                                        precision=precision)
        return {"output": answer["output"], "grads": grads}
    out, _, _, _, d_params, d_inputs = _run(config, tensors, inputs, options, d_output, device=device,
                                            precision=precision, with_trace=False)
    return {"output": np.asarray(out), "grads": _grads(config, inputs, d_params, d_inputs)}


def _grads(config, inputs, d_params, d_inputs) -> dict:
    grads = {name: np.asarray(d_inputs[name]) for name in ("query", "key", "value") if name in d_inputs}
    if "past_key" in d_inputs and np.asarray(inputs["past_key"]).shape[2] > 0:
        grads.update({name: np.asarray(d_inputs[name]) for name in ("past_key", "past_value")})
    grads.update({name: np.asarray(d_params[name]) for name in config.tensor_shapes()})
    return grads
