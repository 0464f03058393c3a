"""Validation before any process starts: check (ValueError in the contract's words, NotImplementedError
for what the sharded call does not do) and refusal (why a sharded call is not built)."""

from __future__ import annotations

import numpy as np

import weights
from weights.call import OPTIONAL_INPUTS
from weights.contract import check_call, check_chunk_size, check_input_values

KINDS = ("heads", "sequence")
DIFFERENTIABLE_INPUTS = ("query", "key", "value", "past_key", "past_value")


def check(config, tensors, inputs, options, *, kind, devices, trace=False) -> weights.contract.CallShapes:
    """ValueError for bad input (in the contract's words), NotImplementedError for what the sharded call
    does not do; returns the call's shapes."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}: got {kind!r}")
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise ValueError(f"devices must be a positive integer: got {devices!r}")
    weights.validate_tensors(config, tensors)
    check_input_values(**{name: inputs.get(name) for name in DIFFERENTIABLE_INPUTS})
    meta = {}
    for name in OPTIONAL_INPUTS:
        if inputs.get(name) is not None:
            array = np.asarray(inputs[name])
            meta[f"{name}_shape"], meta[f"{name}_dtype"] = array.shape, array.dtype.name
    query = np.asarray(inputs["query"])
    key = query if inputs.get("key") is None else np.asarray(inputs["key"])
    value = key if inputs.get("value") is None else np.asarray(inputs["value"])
    training = bool(options.get("training", False))
    return_weights = bool(options.get("return_weights", False))
    shapes = check_call(config, query_shape=query.shape, key_shape=key.shape, value_shape=value.shape, **meta,
                        is_causal=bool(options.get("is_causal", False)),
                        causal_alignment=options.get("causal_alignment", "top_left"), training=training,
                        seed=options.get("seed"), return_weights=return_weights,
                        return_cache=bool(options.get("return_cache", False)), materializes_scores=False,
                        keys_given=inputs.get("key") is not None or inputs.get("value") is not None)
    if inputs.get("bias") is not None:
        weights.contract.check_bias_values(inputs["bias"])
    check_chunk_size(options.get("chunk_size"), return_weights=return_weights, traced=trace)
    reason = refusal(config, inputs, options, kind=kind, devices=int(devices), trace=trace)
    if reason:
        raise NotImplementedError(reason)
    return shapes


def refusal(config, inputs, options, *, kind, devices, trace=False) -> str | None:
    """Why this sharded call is not built, or None."""
    if trace:
        return "a sharded call returns no trace: no process runs every stage on the whole call"
    qk = config.qk_norm
    frontier = [name for name, on in (("alibi", config.alibi), ("local_chunk", config.local_chunk is not None),
                                      ("query_temperature", config.query_temperature is not None),
                                      ("qkv_clip", config.qkv_clip is not None),
                                      ("output_gate", config.output_gate is not None),
                                      ("value_norm", config.value_norm is not None),
                                      ("qk_norm.weight false", qk is not None and not qk.weight),
                                      ("qk_norm.per_head", qk is not None and qk.per_head),
                                      ("qk_norm.after_rope", qk is not None and qk.after_rope),
                                      ("rope.scaling longrope", config.rope is not None and config.rope.scaling
                                       is not None and config.rope.scaling.type == "longrope"),
                                      ("latent", config.latent is not None),
                                      ("indexer", config.indexer is not None),
                                      ("rope.mrope_section", config.rope is not None
                                       and config.rope.mrope_section is not None)) if on]
    if getattr(config, "differential", None) is not None:  # differential attention (no core subtracts the halves)
        frontier.append("differential")
    frontier += [name for name, on in (("key_multiplier", config.key_multiplier != 1.0),  # issue 42's fields
                                       ("value_scale", config.value_scale != 1.0),
                                       ("kv_shared", config.kv_shared)) if on]
    if frontier:
        return (f"the sharded engines do not compute the frontier fields yet (docs/spec-frontier.md): "
                f"{', '.join(frontier)}")
    if inputs.get("past_key_positions") is not None:
        return ("the sharded engines place a cache's keys at 0..P-1: past_key_positions is not taken (run the "
                "unsharded call)")
    if inputs.get("topk_indices") is not None:
        return ("the sharded engines are not wired for a selection over every key (no sharded grid case holds "
                "one): topk_indices is not taken (run the unsharded call)")
    if kind == "heads":
        if config.num_heads % devices:
            return (f"heads sharding splits the query heads evenly: num_heads={config.num_heads} "
                    f"does not divide by devices={devices}")
        return None
    if options.get("return_weights"):
        return ("sequence sharding never holds a query's whole row of weights (its key blocks are on other "
                "processes): return_weights is not available")
    return None
