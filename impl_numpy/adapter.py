"""The conformance adapter: NumPy arrays in and out (see conformance/suite/backends.py).

Every impl package has an adapter with these three functions and the same
argument names; `inputs` and `options` follow `mha verify`'s interface.
"""

from __future__ import annotations

import numpy as np

from weights import dtype_from_name
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
from .backward import multi_head_attention_vjp
from .compressed import compressed_attention
from .compressed_backward import compressed_attention_vjp

NAME = "numpy"

# The paths `mha check` judges as columns of its matrix (weights/paths.py): the stages (the spec), the fused
# core a plain call takes, the chunked core (chunk_size=) and the in-place cache (cache_length=).
PATHS = ("stages", "fused", "chunked", "in_place")
FAST_PATH = "fused"
# DeepSeek V4 (config.compressed): its in-place cache runs on the in_place path (conformance.suite.compare.path_options)
COMPRESSED_IN_PLACE = True
# ... and its block-wise path (compressed_attention's chunk_size=) on the chunked path, forward only: the backward
# (compressed_backward.py) is the stages' VJP, not the block-wise path's
COMPRESSED_CHUNKED = True
COMPRESSED_CHUNKED_FORWARD_ONLY = ("impl_numpy's DeepSeek V4 backward (compressed_backward.py) is the stages' VJP: its "
                                   "gradients are judged on the stages")
ONE_BACKWARD = "impl_numpy has one backward pass (backward.py, the stages' VJP): its gradients are judged on the stages"


def path_options(path: str, config, inputs: dict, options: dict) -> dict | None:
    """The call options that run `path` on this call (weights.paths); None where the path does not exist for
    it: the fused core in 16-bit storage (plan: the stages round every result to it)."""
    if path != "fused":
        return common_path_options(path, inputs, options, paths=PATHS, forward_only=ONE_BACKWARD)
    dtype = dtype_from_name(options["dtype"])
    if plan(return_weights=False, traced=False, chunk_size=None, dtype=dtype).path != "fused":
        return None
    return options | {"return_weights": False, "forward_only": ONE_BACKWARD}


def devices() -> list[str]:
    return ["cpu"]




def _kwargs(inputs, options):
    return dict(
        **{name: inputs.get(name) for name in OPTIONAL_INPUTS + INDEXER_INPUTS},
        is_causal=bool(options.get("is_causal", False)),
        causal_alignment=options.get("causal_alignment", "top_left"),
        training=bool(options.get("training", False)), seed=options.get("seed"), dtype=options.get("dtype"),
    )


def _check_device(device: str) -> None:
    if device != "cpu":
        raise ValueError(f"device must be cpu for the numpy backend: got {device!r}")


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    _check_device(device)
    if (v4 := as_compressed(config)) is not None:
        return compressed_call(compressed_attention, v4, tensors, inputs, options, trace=trace)
    entries = [] if trace else None
    return_weights, return_cache = bool(options.get("return_weights", False)), bool(options.get("return_cache", False))
    kwargs = _kwargs(inputs, options)
    if options.get("in_place"):
        dtype = dtype_from_name(options.get("dtype") or next(iter(tensors.values())).dtype.name)
        kwargs["past_key"], kwargs["past_value"], kwargs["cache_length"] = in_place_buffers(inputs, dtype)
        if config.indexer is not None:
            kwargs["past_index_keys"] = index_buffer(inputs, kwargs["past_key"].shape[2], dtype)
    selection = config.indexer is not None  # the indexer's selection is returned, to be judged
    result = multi_head_attention(
        config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"), return_weights=return_weights,
        return_cache=return_cache, trace=entries, chunk_size=options.get("chunk_size"), return_selection=selection,
        **kwargs,
    )
    answer = split_result(result, return_weights, return_cache, return_selection=selection, index_cache=selection)
    if "cache_length" in kwargs and return_cache:  # the buffers, whole: the cache is their first P + S positions
        S_total = kwargs["cache_length"] + new_keys(inputs, config)
        answer["present_key"], answer["present_value"] = (answer[n][:, :, :S_total] for n in
                                                          ("present_key", "present_value"))
        if "present_index_keys" in answer:
            answer["present_index_keys"] = answer["present_index_keys"][:, :S_total]
    if trace:
        answer["trace"] = [(e.stage, np.asarray(e.value)) for e in entries]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    _check_device(device)
    if (v4 := as_compressed(config)) is not None:  # DeepSeek V4's layer: impl_numpy.compressed_backward
        def run(config, params, x, positions, past, d_out, **returns):
            _, grads = compressed_attention_vjp(config, params, x, positions, past, d_output=d_out)
            return compressed_attention(config, params, x, positions, past, **returns), grads

        answer, grads = compressed_vjp_call(run, v4, tensors, inputs, options, d_output,
                                            dtypes=COMPRESSED_MIRROR_DTYPES, backend=NAME)
        return {"output": answer["output"], "grads": grads}
    out, grads = multi_head_attention_vjp(
        config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"), d_output=d_output,
        **_kwargs(inputs, options),
    )
    return {"output": out, "grads": grads}
