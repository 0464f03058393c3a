"""The conformance adapter: NumPy arrays in and out (see conformance/suite/backends.py).

The same three functions and argument names as impl_numpy/adapter.py;
`inputs` and `options` follow `mha verify`'s interface. options["use_sdpa"]
(default False) routes the attention core through SDPA where it applies.
Gradients come from torch autograd.
"""

from __future__ import annotations

import numpy as np
import torch

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
from weights.contract import check_input_values
from weights.paths import common_path_options, in_place_buffers, index_buffer, new_keys

from .attention import multi_head_attention, plan
from .compressed import compressed_attention
from .convert import to_numpy, to_torch, torch_dtype
from .device import devices as _devices
from .device import matmul_precision, resolve_device

NAME = "torch"

# The paths `mha check` judges (weights/paths.py): the stages (the default of a call), SDPA (use_sdpa=True)
# and the in-place cache (cache_length=). torch has no chunked path.
PATHS = ("stages", "sdpa", "in_place")
FAST_PATH = "sdpa"
# DeepSeek V4 (config.compressed): its in-place cache runs on the in_place path (conformance.suite.compare.path_options)
COMPRESSED_IN_PLACE = True
# ... and its block-wise path (compressed_attention's chunk_size=) on the chunked path, differentiated by autograd:
# torch's one chunked path (check.paths_of adds it; compare.path_options gives no row for any other layer)
COMPRESSED_CHUNKED = True


def path_options(path: str, config, inputs: dict, options: dict) -> dict | None:
    """The call options that run `path` on this call (weights.paths); NotImplementedError where SDPA cannot
    take it, with the plan's reason."""
    if path == "sdpa":
        dropout = bool(options.get("training")) and (inputs.get("dropout_mask") is not None or config.dropout > 0)
        chosen = plan(config, use_sdpa=True, return_weights=False, traced=False, dropout=dropout)
        if chosen.path != "sdpa":
            raise NotImplementedError(f"the SDPA path cannot take this call: {chosen.why} (the stages run)")
        return options | {"return_weights": False, "use_sdpa": True}
    found = common_path_options(path, inputs, options, paths=PATHS,
                                in_place_forward_only="an in-place cache is inference only (refused under autograd)")
    return found if path != "in_place" or found is None else found | {"use_sdpa": True}


# The optional call inputs passed through under their contract names (impl_numpy.adapter.OPTIONAL_INPUTS;
CACHE = ("past_key", "past_value")


def devices() -> list[str]:
    return _devices()


def _kwargs(inputs, options, device, *, skip=()):
    def get(name):
        return None if inputs.get(name) is None else to_torch(inputs[name], device)

    return dict(
        **{name: get(name) for name in OPTIONAL_INPUTS + INDEXER_INPUTS if name not in skip},
        is_causal=bool(options.get("is_causal", False)),
        causal_alignment=options.get("causal_alignment", "top_left"),
        training=bool(options.get("training", False)), seed=options.get("seed"), dtype=options.get("dtype"),
        use_sdpa=bool(options.get("use_sdpa", False)),
    )


def _check_values(inputs) -> None:
    """The reference's value checks (NaN propagates, +-inf is refused), once, in NumPy."""
    check_input_values(**{name: inputs.get(name) for name in ("query", "key", "value", *CACHE)})


def _tensors(config, tensors, device, *, requires_grad=False):
    weights.validate_tensors(config, tensors)  # values too, once, in NumPy: the reference's own check
    return {name: to_torch(t, device).requires_grad_(requires_grad) for name, t in tensors.items()}


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: impl_torch.compressed
        dev = resolve_device(device)
        with matmul_precision(precision), torch.no_grad():
            return compressed_call(compressed_attention, v4, tensors, inputs, options, trace=trace,
                                   convert=lambda a: to_torch(a, dev), to_numpy=to_numpy,
                                   dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)
    _check_values(inputs)
    dev = resolve_device(device)
    params = _tensors(config, tensors, dev)
    entries = [] if trace else None
    return_weights, return_cache = bool(options.get("return_weights", False)), bool(options.get("return_cache", False))
    kwargs = _kwargs(inputs, options, dev)
    if options.get("in_place"):  # the cache in zeroed buffers of capacity P + S + SPARE on the device, written in place
        dtype = torch_dtype(options.get("dtype")) if options.get("dtype") else next(iter(params.values())).dtype
        *buffers, P = in_place_buffers(inputs, np.float64)
        S = new_keys(inputs, config)
        for name, buffer in zip(CACHE, buffers):
            kwargs[name] = to_torch(buffer, dev).to(dtype)
        kwargs["cache_length"] = P
        if config.indexer is not None:
            kwargs["past_index_keys"] = to_torch(index_buffer(inputs, buffers[0].shape[2], np.float64), dev).to(dtype)
    selection = config.indexer is not None  # the indexer's selection is returned, to be judged
    with matmul_precision(precision), torch.no_grad():
        result = multi_head_attention(
            config, params, to_torch(inputs["query"], dev), inputs.get("key"), inputs.get("value"),
            return_weights=return_weights, return_cache=return_cache, trace=entries, return_selection=selection,
            **kwargs,
        )
    answer = split_result(result, return_weights, return_cache, to_numpy, return_selection=selection,
                          index_cache=selection)
    if "cache_length" in kwargs and return_cache:  # the buffers, whole: the cache is their first P + S positions
        answer["present_key"], answer["present_value"] = (answer[name][:, :, :P + S] for name in
                                                          ("present_key", "present_value"))
        if "present_index_keys" in answer:
            answer["present_index_keys"] = answer["present_index_keys"][:, :P + S]
    if trace:
        answer["trace"] = [(e.stage, to_numpy(e.value)) for e in entries]
    return answer


def _compressed_gradients(config, params, x, positions, past, d_out, **returns):
    """DeepSeek V4's layer (impl_torch.compressed) and torch.autograd.grad of its output over x, every tensor and
    the cache (leaves that require grad; the indexer's tensors, read only by its top-k, come back None)."""
    leaves = {"query": x, **params, **{f"past_{name}": a for name, a in (past or {}).items()}}
    for leaf in leaves.values():
        leaf.requires_grad_(True)
    result = compressed_attention(config, params, x, positions, past, **returns)
    out = result[0] if isinstance(result, tuple) else result
    found = torch.autograd.grad(out, list(leaves.values()), grad_outputs=d_out, allow_unused=True)
    return result, dict(zip(leaves, found))


def forward_and_vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    """DeepSeek V4's layer only (config.compressed): forward()'s answer and the gradients of one autograd pass;
    any other layer: NotImplementedError (run_case then calls forward and vjp)."""
    if (v4 := as_compressed(config)) is None:
        raise NotImplementedError("forward_and_vjp: DeepSeek V4's layer only (forward, then vjp, for the others)")
    dev = resolve_device(device)
    with matmul_precision(precision):
        return compressed_vjp_call(_compressed_gradients, v4, tensors, inputs, options, d_output,
                                   convert=lambda a: to_torch(a, dev), to_numpy=to_numpy,
                                   dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    if as_compressed(config) is not None:
        answer, grads = forward_and_vjp(config, tensors, inputs, options, d_output, device=device,
                                        precision=precision)
        return {"output": answer["output"], "grads": grads}
    _check_values(inputs)
    dev = resolve_device(device)
    params = _tensors(config, tensors, dev, requires_grad=True)
    # The inputs and the cache are leaves; positions, ids and masks are not differentiable.
    xs = {name: to_torch(inputs[name], dev).requires_grad_(True)
          for name in ("query", "key", "value", *CACHE) if inputs.get(name) is not None}
    with matmul_precision(precision):
        out = multi_head_attention(config, params, xs["query"], xs.get("key"), xs.get("value"),
                                   past_key=xs.get("past_key"), past_value=xs.get("past_value"),
                                   **_kwargs(inputs, options, dev, skip=CACHE))
        d_out = to_torch(np.asarray(d_output), dev)
        if tuple(d_out.shape) != tuple(out.shape):
            raise ValueError(f"d_output must have shape (B, T, O) = {tuple(out.shape)}: got {tuple(d_out.shape)}")
        leaves = {**xs, **params}
        grads = torch.autograd.grad(out, list(leaves.values()), grad_outputs=d_out.to(out.dtype), allow_unused=True)
    by_name = {name: (torch.zeros_like(leaf) if g is None else g) for (name, leaf), g in zip(leaves.items(), grads)}
    order = [name for name in ("query", "key", "value", *CACHE) if name in xs] + list(config.tensor_shapes())
    return {"output": to_numpy(out), "grads": {name: to_numpy(by_name[name].to(out.dtype)) for name in order}}
