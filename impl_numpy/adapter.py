"""The conformance adapter: NumPy arrays in and out (see conformance/backends.py).

Every impl package has an adapter with these three functions and the same
argument names; `inputs` and `options` follow `mha verify`'s interface.
"""

from __future__ import annotations

import numpy as np

from .attention import multi_head_attention
from .backward import multi_head_attention_vjp

NAME = "numpy"


def devices() -> list[str]:
    return ["cpu"]


# The optional call inputs every adapter passes through under their contract names.
OPTIONAL_INPUTS = ("mask", "bias", "dropout_mask", "positions", "key_positions", "past_key", "past_value",
                   "segment_ids", "key_segment_ids")


def _kwargs(inputs, options):
    return dict(
        **{name: inputs.get(name) for name in OPTIONAL_INPUTS},
        is_causal=bool(options.get("is_causal", False)),
        causal_alignment=options.get("causal_alignment", "top_left"),
        training=bool(options.get("training", False)), seed=options.get("seed"), dtype=options.get("dtype"),
    )


def split_result(result, return_weights: bool, return_cache: bool) -> dict:
    """multi_head_attention's (output[, weights][, present_key, present_value]) as a dict of NumPy arrays."""
    parts = list(result) if (return_weights or return_cache) else [result]
    names = ["output"] + (["weights"] if return_weights else []) + (["present_key", "present_value"]
                                                                     if return_cache else [])
    return {name: np.asarray(value) for name, value in zip(names, parts, strict=True)}


def _check_device(device: str) -> None:
    if device != "cpu":
        raise ValueError(f"device must be cpu for the numpy backend: got {device!r}")


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    _check_device(device)
    entries = [] if trace else None
    return_weights, return_cache = bool(options.get("return_weights", False)), bool(options.get("return_cache", False))
    result = multi_head_attention(
        config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"), return_weights=return_weights,
        return_cache=return_cache, trace=entries, **_kwargs(inputs, options),
    )
    answer = split_result(result, return_weights, return_cache)
    if trace:
        answer["trace"] = [(e.stage, np.asarray(e.value)) for e in entries]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    _check_device(device)
    out, grads = multi_head_attention_vjp(
        config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"), d_output=d_output,
        **_kwargs(inputs, options),
    )
    return {"output": out, "grads": grads}
