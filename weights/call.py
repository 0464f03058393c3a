"""The call's plumbing every mirror shares, written once.

The mirrors (impl_numpy, impl_torch, impl_tf, impl_jax) keep the stage math;
what names a call's inputs, its traced stages and its result lives here, as
Keras 3 keeps argument handling in ops/ and the math in backend/*/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

# The optional call inputs, under their contract names (weights.contract.check_call), in the order the mirrors'
# signatures take them; every adapter passes them through by these names.
OPTIONAL_INPUTS = ("mask", "bias", "dropout_mask", "positions", "key_positions", "past_key", "past_value",
                   "segment_ids", "key_segment_ids", "past_key_positions", "topk_indices")
# The lightning indexer's cache (a config with `indexer`: docs/sparse-attention.md), apart from OPTIONAL_INPUTS
# so that a mirror without the indexer (impl_mlx) is called as before; the mirrors with it take it by this name.
INDEXER_INPUTS = ("past_index_keys",)

# The traced stages, in order (docs/spec.md); a call records the ones it runs (clip, norms, rope, temperature,
# softcap, alibi and the gate only when configured; query.norm and key.norm after the rope stages where the
# norm runs after RoPE).
STAGES = (
    "query.project", "key.project", "value.project", "query.clip", "key.clip", "value.clip", "query.norm",
    "key.norm", "value.norm", "key.multiplier", "value.scale", "query.split_heads", "key.split_heads", "value.split_heads", "query.rope", "key.rope",
    "query.temperature", "logits", "softcap", "alibi", "mask", "softmax", "dropout", "attend", "gate.project",
    "gate", "merge_heads", "output",
)

# The stages a call records only where its config turns them on (a plain layer's trace: STAGES less these).
OPTIONAL_STAGES = frozenset({"query.clip", "key.clip", "value.clip", "query.norm", "key.norm", "value.norm",
                             "query.rope", "key.rope", "query.temperature", "softcap", "alibi", "gate.project", "gate",
                             "key.multiplier", "value.scale"})

# A latent layer's (weights.config.Latent) stages before the logits, in order (impl_numpy/latent.py's expanded
# form); from the logits on, STAGES' own.
LATENT_STAGES = (
    "query.down", "query.down_norm", "query.project", "latent.project", "latent.norm", "query.split_heads",
    "query.rope", "key.rope", "query.temperature", "key.project", "value.project", "key.split_heads",
    "value.split_heads", "key.join",
) + STAGES[STAGES.index("logits"):]
# Differential attention's stages (config.differential): value.pair before the logits (each kv head's value
# joined with its pair's: (B, K, S_total, 2V)), differential after attend ((B, N/2, T, 2V): the halves subtracted
# with lambda, normed and scaled); recorded only there (set after LATENT_STAGES: a latent layer has neither).
STAGES = (*STAGES[:STAGES.index("logits")], "value.pair", *STAGES[STAGES.index("logits"):STAGES.index("gate.project")],
          "differential", *STAGES[STAGES.index("gate.project"):])
OPTIONAL_STAGES = OPTIONAL_STAGES | {"value.pair", "differential"}


def stage_order(config) -> tuple[str, ...]:
    """The order a config's trace follows: LATENT_STAGES for a latent layer; else STAGES, with query.norm and
    key.norm after the rope stages where the QK-norm runs after RoPE; a layer with an indexer's INDEXER_STAGES
    first (it selects the keys before the attention's stages run). A call records the ones it runs."""
    first = INDEXER_STAGES if getattr(config, "indexer", None) is not None else ()
    if getattr(config, "latent", None) is not None:
        return first + LATENT_STAGES
    norm = getattr(config, "qk_norm", None)
    if norm is None or not norm.after_rope:
        return first + STAGES
    rest = [s for s in STAGES if s not in ("query.norm", "key.norm")]
    at = rest.index("key.rope") + 1
    return (*first, *rest[:at], "query.norm", "key.norm", *rest[at:])


# The contractions, as einsum strings the mirrors share (B batch, L/T/S lengths, D input features, F = heads x
# width, K key heads, G query heads per key head, H/V head widths, O output features).
# The lightning indexer's trace (impl_*/indexer.py, `rec`), in order; each where its config turns it on
# (query.latent: query_source "latent"; the norms, rope and weights where configured; fp8 with that precision;
# blocks with block_size; pool.gates and pool.keys with block_pool "gated", GLM-5.3-Flash's k-pool).
INDEXER_STAGES = ("indexer.query.latent", "indexer.query.project", "indexer.query.norm", "indexer.query.rope",
                  "indexer.key.project", "indexer.key.norm", "indexer.key.rope", "indexer.pool.gates",
                  "indexer.pool.keys", "indexer.weights",
                  "indexer.query.fp8", "indexer.key.fp8", "indexer.scores", "indexer.masked_scores", "indexer.blocks",
                  "indexer.selection")


def indexer_stages(config) -> tuple[str, ...]:
    """The indexer stages an attention call of `config` records, in order, before its own (INDEXER_STAGES less
    those its config does not turn on; the call scores in the plain precision: no fp8 stage); () without an
    indexer. The mirrors whose trace is named after the program ran (impl_jax, impl_mlx) prepend these."""
    ix = getattr(config, "indexer", None)
    if ix is None:
        return ()
    off = {"indexer.query.fp8", "indexer.key.fp8"}
    if ix.query_source != "latent":
        off.add("indexer.query.latent")
    if ix.query_norm is None:
        off.add("indexer.query.norm")
    if ix.key_norm is None:
        off.add("indexer.key.norm")
    if ix.rope is None:
        off |= {"indexer.query.rope", "indexer.key.rope"}
    if not ix.head_weights:
        off.add("indexer.weights")
    if ix.block_size is None:
        off.add("indexer.blocks")
    if ix.block_pool != "gated":
        off |= {"indexer.pool.gates", "indexer.pool.keys"}
    return tuple(s for s in INDEXER_STAGES if s not in off)

PROJECT = "BLD,DF->BLF"
LOGITS = "BKGTH,BKSH->BKGTS"
ATTEND = "BKGTS,BKSV->BKGTV"
OUTPUT = "BTF,FO->BTO"


@dataclasses.dataclass
class TraceEntry:
    stage: str
    value: Any  # the stage's output, in the mirror's own array type (a tracer inside jax.jit)


def record(trace: list | None, stage: str, value):
    """Append (stage, value) to the trace when one is kept; returns value, so a stage reads `x = record(...)`."""
    if trace is not None:
        trace.append(TraceEntry(stage, value))
    return value


def result_names(return_weights: bool, return_cache: bool, return_selection: bool = False,
                 index_cache: bool = False) -> list[str]:
    """The names of multi_head_attention's results, in order: output[, weights][, selection][, present_key,
    present_value[, present_index_keys]] (present_index_keys where the config has an indexer: index_cache)."""
    return (["output"] + (["weights"] if return_weights else []) + (["selection"] if return_selection else [])
            + (["present_key", "present_value"] + (["present_index_keys"] if index_cache else [])
               if return_cache else []))


def split_result(result, return_weights: bool, return_cache: bool,
                 to_array: Callable[[Any], np.ndarray] = np.asarray, *, return_selection: bool = False,
                 index_cache: bool = False) -> dict:
    """multi_head_attention's (output[, weights][, selection][, present_key, present_value[,
    present_index_keys]]) as a dict of NumPy arrays."""
    names = result_names(return_weights, return_cache, return_selection, index_cache)
    parts = list(result) if len(names) > 1 else [result]
    return {name: to_array(value) for name, value in zip(names, parts, strict=True)}


# The dtypes every mirror's DeepSeek V4 layer (impl_*/compressed.py) takes: 16-bit storage by the reference's rule
# (impl_numpy/compressed.py: each stage in float32, stored in 16 bits at the reference's boundaries). A backend that
# passes a narrower tuple to compressed_call reports the others unsupported.
COMPRESSED_MIRROR_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _chunk_size(options: dict) -> dict:
    """{"chunk_size": n} where the options ask for the block-wise path of DeepSeek V4's layer, else {} (the call's
    own default: the stages)."""
    return {} if options.get("chunk_size") is None else {"chunk_size": options["chunk_size"]}


def compressed_call(call: Callable, config, tensors: dict, inputs: dict, options: dict, *, convert=lambda a: a,
                    to_numpy=np.asarray, trace: bool = False, dtypes=None, backend: str = "") -> dict:
    """An adapter's forward of DeepSeek V4's layer (config.compressed) through its module's
    compressed_attention (`call`): inputs["query"] is the layer's input x (B, T, D), inputs["positions"] its
    absolute positions (T,), past_<name> the cache (impl_numpy.compressed.cache_names). Arrays are cast to
    options["dtype"] (else the tensors') and handed to `call` through `convert`. The answer, as NumPy: output,
    csa's selection, with options["return_cache"] present_<name> for every name of the cache, and the trace.
    dtypes: those the backend's layer computes in (None: any); another raises NotImplementedError. options["chunk_size"]:
    the block-wise path (compressed_attention's chunk_size=), handed to `call` as chunk_size=."""
    dtype = options.get("dtype") or np.asarray(next(iter(tensors.values()))).dtype.name
    if dtypes is not None and dtype not in dtypes:
        raise NotImplementedError(f"{backend}'s DeepSeek V4 layer (config.compressed) computes in "
                                  f"{' or '.join(dtypes)}: got {dtype}")
    from weights import dtype_from_name

    dt = dtype_from_name(dtype)
    params = {name: convert(np.asarray(t).astype(dt, copy=False)) for name, t in tensors.items()}
    past = {name.removeprefix("past_"): convert(np.asarray(a).astype(dt, copy=False))
            for name, a in inputs.items() if name.startswith("past_")} or None
    csa, return_cache = config.compressed.kind == "csa", bool(options.get("return_cache", False))
    entries = [] if trace else None
    # options["in_place"]: the past_<name> inputs are the in-place cache's buffers (impl_numpy.compressed.buffer_shapes),
    # written by the call and returned whole as present_<name> (the suite reads them back as a cache: logical_cache)
    in_place = bool(options.get("in_place", False))
    # options["chunk_size"]: the block-wise path (compressed_attention's chunk_size=, the `chunked` path of a check)
    extra = ({"in_place": True} if in_place else {}) | _chunk_size(options)
    result = call(config, params, convert(np.asarray(inputs["query"]).astype(dt, copy=False)),
                  np.asarray(inputs["positions"]), past, return_cache=return_cache or in_place, return_selection=csa,
                  trace=entries, **extra)
    result = result if isinstance(result, tuple) else (result,)
    answer = {"output": to_numpy(result[0])}
    if csa:
        answer["selection"] = np.asarray(to_numpy(result[1])).astype(np.int64)
    if return_cache:
        answer.update({f"present_{name}": to_numpy(a) for name, a in result[-1].items()})
    if trace:
        answer["trace"] = [(e.stage, to_numpy(e.value)) for e in entries]
    return answer


def compressed_vjp_call(run: Callable, config, tensors: dict, inputs: dict, options: dict, d_output, *,
                        convert=lambda a: a, to_numpy=np.asarray, dtypes=None, backend: str = "") -> tuple[dict, dict]:
    """An adapter's forward_and_vjp of DeepSeek V4's layer (config.compressed): compressed_call's arrays, cast and
    converted alike, and the output's cotangent d_output (B, T, O), handed to
    run(config, params, x, positions, past, d_out, return_selection=, return_cache=[, chunk_size=]) -> (the layer's result as
    compressed_attention returns it, {name: gradient or None}) under the names of impl_numpy.compressed_backward:
    "query" (the layer's input x), every canonical tensor, past_<name> of the cache; None (not read: the
    indexer's, whose top-k passes no gradient) is zero. -> (compressed_call's answer, the gradients as NumPy in
    the call's dtype)."""
    dtype = options.get("dtype") or np.asarray(next(iter(tensors.values()))).dtype.name
    if dtypes is not None and dtype not in dtypes:
        raise NotImplementedError(f"{backend}'s DeepSeek V4 layer (config.compressed) computes in "
                                  f"{' or '.join(dtypes)}: got {dtype}")
    from weights import dtype_from_name, validate_tensors

    dt = dtype_from_name(dtype)
    host = {name: np.asarray(t).astype(dt, copy=False) for name, t in tensors.items()}
    validate_tensors(config, host)  # names, shapes, one dtype, finite values: in NumPy, before any tape
    x = np.asarray(inputs["query"]).astype(dt, copy=False)
    d_out = np.asarray(d_output).astype(dt, copy=False)
    if d_out.shape != (*x.shape[:2], config.out_dim):
        raise ValueError(f"d_output must have shape (B, T, O) = {(*x.shape[:2], config.out_dim)}: got {d_out.shape}")
    past_host = {name.removeprefix("past_"): np.asarray(a).astype(dt, copy=False)
                 for name, a in inputs.items() if name.startswith("past_")} or None
    csa, return_cache = config.compressed.kind == "csa", bool(options.get("return_cache", False))
    result, found = run(config, {name: convert(t) for name, t in host.items()}, convert(x),
                        np.asarray(inputs["positions"]),
                        None if past_host is None else {name: convert(a) for name, a in past_host.items()},
                        convert(d_out), return_selection=csa, return_cache=return_cache, **_chunk_size(options))
    result = result if isinstance(result, tuple) else (result,)
    answer = {"output": to_numpy(result[0])}
    if csa:
        answer["selection"] = np.asarray(to_numpy(result[1])).astype(np.int64)
    if return_cache:
        answer.update({f"present_{name}": to_numpy(a) for name, a in result[-1].items()})
    shapes = {"query": x.shape, **config.tensor_shapes(),
              **{f"past_{name}": a.shape for name, a in (past_host or {}).items()}}
    grads = {name: np.zeros(shape, dt) if found.get(name) is None else
             np.asarray(to_numpy(found[name])).astype(dt, copy=False).reshape(shape) for name, shape in shapes.items()}
    return answer, grads


def as_compressed(config):
    """The AttentionConfig of a DeepSeek V4 layer (config.compressed set), from a config or its dict (`mha verify`
    passes config.to_dict()); None for any other layer."""
    if isinstance(config, dict):
        if config.get("compressed") is None:
            return None
        from weights import AttentionConfig

        return AttentionConfig.from_dict(config)
    return config if getattr(config, "compressed", None) is not None else None
