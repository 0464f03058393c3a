"""The conformance adapter: NumPy arrays in and out (see conformance/backends.py).

Every impl package has an adapter with these three functions and the same
argument names; `inputs` and `options` follow `mha verify`'s interface.
"""

from __future__ import annotations

import numpy as np

from .backward import multi_head_attention_vjp
from .functional import multi_head_attention

NAME = "numpy"


def devices() -> list[str]:
    return ["cpu"]


def _kwargs(inputs, options):
    return dict(
        mask=inputs.get("mask"), bias=inputs.get("bias"), dropout_mask=inputs.get("dropout_mask"),
        is_causal=bool(options.get("is_causal", False)),
        causal_alignment=options.get("causal_alignment", "top_left"),
        training=bool(options.get("training", False)), seed=options.get("seed"), dtype=options.get("dtype"),
    )


def _check_device(device: str) -> None:
    if device != "cpu":
        raise ValueError(f"device must be cpu for the numpy backend: got {device!r}")


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    _check_device(device)
    entries = [] if trace else None
    result = multi_head_attention(
        config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"),
        return_weights=bool(options.get("return_weights", False)), trace=entries, **_kwargs(inputs, options),
    )
    out, w = result if options.get("return_weights") else (result, None)
    answer = {"output": np.asarray(out)}
    if w is not None:
        answer["weights"] = np.asarray(w)
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
