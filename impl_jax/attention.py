"""The call: validate, then run functional.py's stages, the fused XLA
expression, or chunked.py's online softmax: mirrors impl_numpy/attention.py.

Kept apart from functional.py so that imports point one way: this module
and chunked.py import the stages; the stages import neither.

Paths. With return_weights or a trace, or dropout, or 16-bit storage, every
stage runs as written. Otherwise logits .. attend run as one expression
(fused_attention: same einsums, softmax normalised on the context), which
XLA CPU compiles into one kernel instead of five passes over (B, N, T, S).
chunk_size= takes chunked.py's online softmax over blocks instead: no (T, S)
array, causal and window-hidden blocks skipped. Every path honours every
feature of the config and the call: the projections, QK-norm, RoPE and the
cache run as the stages (qkv_heads) before the fused expression and before
the chunked core of a modern call; softcap, windows, segment ids and sinks
are part of both cores.

float64 needs JAX's x64 mode. This module never switches it on (that would
change the default dtypes of every other JAX program in the process); a
float64 call without it raises ValueError saying how to enable it, instead
of silently computing in float32. impl_jax.adapter (the conformance entry
point) does enable it.

`apply` is pure and works under jax.jit, jax.grad and jax.vmap. Validation
(weights.contract.check_call) reads only static shapes and dtypes, so it runs
at trace time; the one value check (NaN / +inf in bias) runs only when bias
is concrete (eager calls), so jit callers check bias themselves
(weights.contract.check_bias_values; the adapter does). Under jit pass
STATIC_ARGNAMES as static_argnames; positions, the cache and segment ids are
traced arrays (a new value does not recompile, a new shape does). An
in-place cache's cache_length is static there too (each value compiles a
program); a jitted function of the caller's may pass it traced instead (see
apply).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from weights import DTYPES, AttentionConfig, compute_dtype, dtype_from_name, validate_tensors
from weights.call import ATTEND, LOGITS, STAGES, record
from weights.contract import (
    CallShapes,
    Plan,
    check_bias_values,
    check_cache_alignment,
    check_call,
    check_chunk_size,
    check_scores_fit,
    in_place_buffer_error,
)
from weights.dtypes import is_float, resolve_dtype
from weights.rope import rope_tables

from . import functional as F
from .chunked import chunked_attention
from .functional import _precision

# Arguments of `apply` that must be static under jax.jit (hashable Python values).
STATIC_ARGNAMES = (
    "config", "is_causal", "causal_alignment", "training", "seed", "return_weights", "return_cache", "precision",
    "dtype", "chunk_size", "cache_length",
)

X64_MESSAGE = (
    "float64 needs JAX's x64 mode, which is off: call jax.config.update('jax_enable_x64', True) "
    "(or set JAX_ENABLE_X64=1) before creating arrays; impl_jax never computes a float64 request in float32"
)



# -- validation: static shapes and dtypes, so it runs at jit trace time -------------

def is_concrete(x) -> bool:
    """True for values that can be read (NumPy, eager jax.Array); False for tracers."""
    return not isinstance(x, jax.core.Tracer)


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


def _as_array(x):
    """Arrays (NumPy, jax, tracers) as they are; anything else through NumPy."""
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)


def check_params(config: AttentionConfig, params) -> np.dtype:
    """Names, shapes and the one dtype of `params` (jax or NumPy arrays, or
    tracers) in weights.validate_tensors' words; returns the dtype. Values
    (NaN / Inf) are checked where tensors enter (the layer, the adapter)."""
    expected = config.tensor_shapes()
    params = {name: _as_array(t) for name, t in params.items()}
    dtypes = {np.dtype(t.dtype) for t in params.values()}
    if (
        set(params) == set(expected)
        and all(tuple(params[n].shape) == shape for n, shape in expected.items())
        and len(dtypes) == 1
        and next(iter(dtypes)) in DTYPES.values()
    ):
        return resolve_dtype(next(iter(dtypes)))
    # Something is wrong: the reference words it, from stand-ins of the same
    # shapes and dtypes that hold no memory of their own.
    return validate_tensors(config, {n: np.broadcast_to(np.zeros((), t.dtype), t.shape) for n, t in params.items()})


def _meta(name: str, x) -> dict:
    """check_call's shape and dtype arguments of one optional input."""
    return {f"{name}_shape": None if x is None else x.shape,
            f"{name}_dtype": None if x is None else np.dtype(x.dtype).name}


def check(config, params, query, key=None, value=None, *, mask=None, bias=None, dropout_mask=None,
          is_causal=False, causal_alignment="top_left", training=False, seed=None, rng=None,
          positions=None, key_positions=None, past_key=None, past_value=None, segment_ids=None,
          key_segment_ids=None, return_weights=False, return_cache=False, dtype=None, precision="highest",
          materializes_scores=True, cache_length=None):
    """Validate a call in the reference's order and words; returns (CallShapes,
    storage dtype). Reads shapes and dtypes only, and bias values when bias
    is concrete. materializes_scores=False (the chunked path) skips the
    up-front refusal of (B, N, T, S) arrays that cannot fit in memory.
    cache_length: see apply; a traced one is range-checked as 0 (its value
    cannot be read) and shapes.P is then 0 (the caller keeps the tracer);
    is_causal or a window then needs bottom_right, as for any P > 0 (the
    contract's words without "(P=...)")."""
    stored = check_params(config, params)
    dtype = stored if dtype is None else dtype_from_name(dtype)
    if dtype == np.float64 and not x64_enabled():
        raise ValueError(X64_MESSAGE)
    _precision(precision)
    query = _as_array(query)
    keys_given = key is not None or value is not None  # else self-attention: the keys are the queries
    key = query if key is None else _as_array(key)
    value = key if value is None else _as_array(value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not is_float(x.dtype):
            raise ValueError(f"{name} must be a float array: got dtype {x.dtype}")
    if seed is not None and rng is not None:
        raise ValueError(f"pass seed or rng, not both: got seed={seed!r} and an rng key")
    optional = dict(mask=mask, bias=bias, dropout_mask=dropout_mask, positions=positions, key_positions=key_positions,
                    past_key=past_key, past_value=past_value, segment_ids=segment_ids,
                    key_segment_ids=key_segment_ids)
    meta = {}
    for name, x in optional.items():
        meta.update(_meta(name, None if x is None else _as_array(x)))
    traced = is_traced_length(cache_length)
    if traced:  # before check_call, which would judge these inputs' shapes against P = 0
        check_traced_length(config, dict(mask=mask, bias=bias, dropout_mask=dropout_mask, segment_ids=segment_ids,
                                         key_segment_ids=key_segment_ids, return_weights=return_weights,
                                         training=training and config.dropout > 0))
    shapes = check_call(
        config, query_shape=query.shape, key_shape=key.shape, value_shape=value.shape, **meta,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training,
        seed=0 if rng is not None else seed,  # an rng key stands in for a seed
        return_weights=return_weights, return_cache=return_cache,
        cache_length=0 if traced else concrete_length(cache_length),  # 0: the range C >= S is still checked
        materializes_scores=materializes_scores and not traced, scores_itemsize=compute_dtype(dtype).itemsize,
        keys_given=keys_given,
    )
    if traced:  # check_call judged P = 0: is_causal or a window needs bottom_right whatever P the program gets
        check_cache_alignment(config, None, is_causal, causal_alignment)
    if cache_length is not None:
        check_in_place(dtype, past_key, past_value, return_cache=return_cache)
        if traced and materializes_scores:  # a traced length attends over the whole buffer: C keys
            check_scores_fit(shapes.B, config.num_heads, shapes.T, shapes.capacity, compute_dtype(dtype).itemsize)
    if bias is not None and is_concrete(bias):
        check_bias_values(np.asarray(bias))
    return shapes, dtype


IN_PLACE_MESSAGE = ("cache_length needs return_cache=True in JAX: arrays are immutable, the written buffers come "
                    "back as present_key/present_value")


def is_traced_length(cache_length) -> bool:
    """A cache_length only known at run time (a tracer under jit)."""
    return cache_length is not None and not is_concrete(cache_length)


def concrete_length(cache_length):
    """A concrete jax integer scalar as a Python int (eager calls may pass
    jnp.int32(P)); anything else as given, for check_call to judge."""
    if isinstance(cache_length, jax.Array) and cache_length.ndim == 0 and np.dtype(cache_length.dtype).kind in "iu":
        return int(cache_length)
    return cache_length


def check_in_place(dtype, past_key, past_value, *, return_cache: bool) -> None:
    """What JAX adds to the contract's checks of cache_length (check_call has
    checked its value and the buffers' shapes): return_cache (the written
    buffers come back only as results) and buffers of the storage dtype (a
    cast would write a copy, as impl_numpy refuses it)."""
    if not return_cache:
        raise ValueError(IN_PLACE_MESSAGE)
    for name, buffer in (("past_key", past_key), ("past_value", past_value)):
        got = np.dtype(_as_array(buffer).dtype)
        if got != dtype:
            raise in_place_buffer_error(name, f"have the storage dtype {np.dtype(dtype).name}", f"dtype {got.name}")


def check_traced_length(config, options: dict) -> None:
    """A traced cache_length: none of the inputs sized by S_total = P + S
    (unknown at trace time), nor masked_row='uniform' (an empty row's
    weights are 1/(P+S)). options: name -> value (None or False: not given)."""
    given = [name for name, value in options.items() if value is not None and value is not False]
    if config.masked_row == "uniform":
        given.append("masked_row='uniform'")
    if given:
        raise ValueError(f"a traced cache_length attends over the whole buffer and cannot take "
                         f"{', '.join(given)} (sized or weighted by P + S, unknown at trace time): pass "
                         "cache_length as a Python int (static)")


def _cast(x, dtype):
    """To a jax.Array of `dtype`. NumPy arrays are cast by NumPy (the
    reference's rounding, and no float64 detour when x64 is off)."""
    if isinstance(x, np.ndarray):
        return jnp.asarray(x.astype(dtype, copy=False))
    return jnp.asarray(x).astype(dtype)


def _ids(x):
    """An integer input (positions, segment ids) as a jax.Array, or None."""
    return None if x is None else jnp.asarray(_as_array(x))


@dataclasses.dataclass
class Call:
    """One validated call, every float array in its storage dtype (bias in compute dtype)."""

    shapes: CallShapes
    params: dict[str, Any]
    query: Any  # (B, T, Dq)
    key: Any  # (B, S, Dk)
    value: Any  # (B, S, Dv)
    mask4: Any  # (B|1, N|1, T|1, S_total|1) bool, or None
    bias4: Any  # same, compute dtype, or None
    keep: Any  # dropout keep-mask (B, N, T, S_total), or None
    dtype: np.dtype
    positions: Any  # (B|1, T) integer where the config has rope, else None
    key_positions: Any  # (B|1, S)
    past_key: Any  # (B, K, P, H) or None; with cache_length the buffer (B, K, C, H)
    past_value: Any  # (B, K, P, V) or None; with cache_length (B, K, C, V)
    segment_ids: Any  # (T,) or (B, T), or None
    key_segment_ids: Any  # (S_total,) or (B, S_total)
    cache_length: Any = None  # P of an in-place cache: a Python int, or a traced int scalar (under jit); else None

    hides_tail: bool = False  # the keys are an in-place cache's whole buffers: positions past P+S to be hidden

    @property
    def traced_length(self) -> bool:
        """An in-place cache whose P is a tracer: the keys are the whole buffer, those from P + S on hidden."""
        return is_traced_length(self.cache_length)

    def allowed(self, config: AttentionConfig, is_causal: bool, causal_alignment: str, *, tail: bool = True):
        """mask AND causal AND window AND segments over every key (rank 4), or None.
        One bottom-right query (a decode step) sees every key: its causal mask hides nothing and is
        left out, so that fused_attention runs without a select and without the empty-row pass
        (which read V once more). An in-place cache read whole (hides_tail): over its C keys, and
        with tail=True also AND j < P+S (tail=False: fused_attention hides those by key_count)."""
        if causal_alignment == "bottom_right" and self.shapes.T == 1:
            is_causal = False
        if self.hides_tail:
            return in_place_allowed(config, self, is_causal, causal_alignment, tail=tail)
        return F.allowed_mask(self.mask4, self.shapes.T, self.shapes.S_total, is_causal, causal_alignment,
                              window_left=config.window_left, window_right=config.window_right,
                              segment_ids=self.segment_ids, key_segment_ids=self.key_segment_ids)

    @property
    def modern(self) -> bool:
        """Uses a cache or packed segments (the config's own features: config.is_modern)."""
        return self.past_key is not None or self.segment_ids is not None


def prepare(config, params, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, rng, return_weights, dtype, precision, positions=None, key_positions=None,
            past_key=None, past_value=None, segment_ids=None, key_segment_ids=None, return_cache=False,
            cache_length=None, materializes_scores=True) -> Call:
    """Validate a call (`check`) and cast everything to the storage dtype."""
    shapes, dtype = check(
        config, params, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask, is_causal=is_causal,
        causal_alignment=causal_alignment, training=training, seed=seed, rng=rng, positions=positions,
        key_positions=key_positions, past_key=past_key, past_value=past_value, segment_ids=segment_ids,
        key_segment_ids=key_segment_ids, return_weights=return_weights, return_cache=return_cache, dtype=dtype,
        precision=precision, materializes_scores=materializes_scores, cache_length=cache_length,
    )
    if cache_length is not None:  # a Python int (static), or the tracer itself
        cache_length = jnp.asarray(cache_length, jnp.int32) if is_traced_length(cache_length) else shapes.P
    if bias is not None:
        bias = _cast(_as_array(bias), compute_dtype(dtype)).reshape(shapes.bias_shape)  # (B|1, N|1, T|1, S|1)
    cast_params = {name: _cast(_as_array(t), dtype) for name, t in params.items()}
    keep = None if dropout_mask is None else jnp.asarray(_as_array(dropout_mask))
    if training and keep is None and config.dropout > 0:
        rng = jax.random.key(seed) if rng is None else rng
        keep = F.dropout_keep_mask((shapes.B, config.num_heads, shapes.T, shapes.S_total), config.dropout, rng)
    if not training:
        keep = None
    mask4 = None if mask is None else jnp.asarray(_as_array(mask)).reshape(shapes.mask_shape)  # (B|1, N|1, T|1, S|1)
    query = _as_array(query)
    key = query if key is None else _as_array(key)
    value = key if value is None else _as_array(value)
    segment_ids, key_segment_ids = _ids(segment_ids), _ids(key_segment_ids)
    if segment_ids is not None and key_segment_ids is None:
        key_segment_ids = segment_ids  # self-attention without a cache: the keys are the queries (check_call)
    rope = config.rope is not None
    P = shapes.P if cache_length is None else cache_length  # the new tokens' default positions start at P
    return Call(
        shapes=shapes, params=cast_params, query=_cast(query, dtype), key=_cast(key, dtype),
        value=_cast(value, dtype), mask4=mask4, bias4=bias, keep=keep, dtype=dtype,
        positions=F.default_positions(_ids(positions), P, shapes.T) if rope else None,
        key_positions=F.default_positions(_ids(key_positions), P, shapes.S) if rope else None,
        past_key=None if past_key is None else _cast(_as_array(past_key), dtype),
        past_value=None if past_value is None else _cast(_as_array(past_value), dtype),
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, cache_length=cache_length,
    )


def pad_to_capacity(call: Call) -> None:
    """The inputs sized by S_total = P + S (mask, bias, key segment ids)
    padded to the buffers' C keys, for an in-place cache read whole with a
    static P (in_place_allowed hides the padding: any value will do)."""
    extra = call.shapes.capacity - call.shapes.S_total

    def pad(x):
        return x if x is None or x.shape[-1] == 1 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])

    call.mask4, call.bias4, call.key_segment_ids = pad(call.mask4), pad(call.bias4), pad(call.key_segment_ids)


def in_place_allowed(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str, *,
                     tail: bool = True):
    """F.allowed_mask over the whole buffer of an in-place cache, C keys (P
    a Python int or traced): the mask and key segment ids padded to C
    (pad_to_capacity), causality and windows aligned with S_total = P + S
    (masks.causal_mask and window_mask with an offset that may be traced),
    and with tail=True key j < P + S. Rank 4 (B|1, N|1, T, C), or None."""
    T, C = call.shapes.T, call.shapes.capacity
    total = call.cache_length + call.shapes.S  # S_total
    j = jnp.arange(C, dtype=jnp.int32)[None, :]  # (1, C)
    aligned = jnp.arange(T, dtype=jnp.int32)[:, None] + (0 if causal_alignment == "top_left" else total - T)  # p_i
    conditions = [j < total] if tail else []
    if is_causal:
        conditions.append(j <= aligned)
    if config.window_left >= 0:
        conditions.append(j >= aligned - config.window_left)
    if config.window_right >= 0:
        conditions.append(j <= aligned + config.window_right)
    allowed = call.mask4
    for condition in conditions:  # each (T|1, C)
        allowed = condition[None, None] if allowed is None else allowed & condition[None, None]
    if call.segment_ids is not None:
        segments = F.segment_mask(call.segment_ids, call.key_segment_ids)  # (B|1, 1, T, C)
        allowed = segments if allowed is None else allowed & segments
    return allowed


# -- the stages up to the keys, and the trace's stage names -----------------------------

def qkv_heads(config: AttentionConfig, call: Call, precision: str = "highest", rec=lambda stage, value: value, *,
              append: bool = True, whole: bool = False):
    """project -> [norm] -> split_heads -> [rope] -> [cache appended]: q (B, N,
    T, H), k (B, K, S_total, H), v (B, K, S_total, V) (k and v: the
    present cache). append=False: k and v are the new keys' alone (B, K, S, .).
    An in-place cache (call.cache_length): the new keys are written into the
    buffers at P .. P+S-1, call.past_key / past_value become the written
    buffers, and k and v are the buffers whole (whole=True, or a traced P:
    call.allowed then hides the positions past P+S) or their first P+S
    positions."""
    p, N, K, pr = call.params, config.num_heads, config.num_kv_heads, precision
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"), pr))  # (B, T, N*H)
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias"), pr))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias"), pr))  # (B, S, K*V)
    if config.qk_norm is not None:
        n = config.qk_norm
        q = rec("query.norm", F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), n.type, n.eps, N, n.scope))
        k = rec("key.norm", F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), n.type, n.eps, K, n.scope))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved, factor))
        k = rec("key.rope", F.rope(k, F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved,
                                   factor))
    if call.cache_length is not None:
        # dynamic_update_slice: written in place under jax.jit when the caller donates the buffers (a new
        # buffer otherwise, eager calls included); a traced P past C - S is clamped by XLA, not refused
        P, S = call.cache_length, k.shape[2]
        start = (0, 0, P, 0) if isinstance(P, int) else (jnp.int32(0), jnp.int32(0), P, jnp.int32(0))  # one type
        call.past_key = lax.dynamic_update_slice(call.past_key, k.astype(call.past_key.dtype), start)
        call.past_value = lax.dynamic_update_slice(call.past_value, v.astype(call.past_value.dtype), start)
        if whole or call.traced_length:
            return q, call.past_key, call.past_value  # (B, K, C, .): call.allowed hides the positions past P+S
        # the paths that need exactly P+S keys (the trace's and the weights' shapes, chunked.py's causal
        # offsets): a slice, which XLA CPU writes out (a copy of the cache)
        return q, call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .)
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = jnp.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = jnp.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v


def trace_stages(config: AttentionConfig) -> tuple[str, ...]:
    """The stage names a trace of this config holds, in order (STAGES less
    the norm, rope and softcap stages the config does not turn on)."""
    off = set()
    if config.qk_norm is None:
        off |= {"query.norm", "key.norm"}
    if config.rope is None:
        off |= {"query.rope", "key.rope"}
    if config.logit_softcap is None:
        off.add("softcap")
    return tuple(stage for stage in STAGES if stage not in off)


# -- the fast path: logits .. attend in one expression -----------------------------

def fused_attention(q, k, v, allowed, bias, scale: float, masked_row: str, precision: str = "highest", *,
                    softcap: float | None = None, sinks=None, key_count: int | None = None,
                    attend_by_reduce: bool = False):
    """logits -> [softcap] -> mask -> softmax [+ sinks] -> attend in one
    expression, for calls that ask for neither the weights nor the trace, in
    float32 or float64 (where every stage's rounding to the storage dtype is
    the identity) and without dropout. The same contractions (LOGITS and
    ATTEND with G folded into T, as impl_numpy's matmuls do) and the same
    arithmetic up to the order of rounding: the softmax's division by the
    row sum is applied to the (T, V) context instead of the (T, S) weights.

    Written for XLA CPU's YNNPACK fusion, which fuses dot, max, exp, sum,
    dot and the division as long as the expression holds no select: a call
    with neither mask, causality nor bias runs as that one fusion. Otherwise
    one select hides positions, as mask() does (an added -inf would not: a
    NaN or infinite logit there, from a NaN key or an overflowing product,
    plus -inf is NaN and would reach the whole row, where the stages give it
    weight 0), and a bias is added where it is finite; the select sits
    outside the fusion (one more pass over the logits). A row with no allowed key is
    computed finite (every position kept, no bias) and its context replaced
    afterwards by the masked_row policy's (0 x V, the mean of V, NaN), as
    functional.softmax fills its weights. Windows and segment ids arrive in
    `allowed`. softcap: cap * tanh(logits / cap) before the bias, as the
    stage. sinks (N,): each row's max and denominator include its head's
    sink; a row with no allowed key then keeps every position hidden and
    gets weights 0 (context 0 x V), as functional.softmax gives it.

    q (B, N, T, H), k (B, K, S, H), v (B, K, S, V); allowed (bool) and bias
    rank 4, broadcasting to (B, N, T, S), or None -> context (B, N, T, V).
    k and v may also be tuples of parts along S (a cache and the new keys,
    not concatenated): the logits of the parts are joined instead, (T, S)
    values where the keys are (S, H), and the context is the sum of each
    part's weights times its values.

    key_count: only the first key_count keys count (an in-place cache read
    whole: P+S, a Python int or traced); the others get -inf added to their
    (finite) logits, empty rows are judged and the masked_row "uniform" fill
    averaged over the counted keys alone. attend_by_reduce: the context as a
    multiply and a sum over s instead of the ATTEND dot (same products,
    summed in another order), for an in-place cache's decode step: XLA CPU
    otherwise fuses the in-place write of the value buffer into the layout
    change its dot operand needs and then copies the buffers up to four times
    (compiled HLO, jax 0.10.2, B 1 and 2); the reduction reads the written
    buffer as it is. At P 65536 (B 1, K 8, H 128, float32, 2-core VM) the
    step took 291 ms with the dot and 115 ms with the reduction, which alone
    costs about twice the dot (67 vs 30 ms)."""
    ks, vs = (k, v) if isinstance(k, tuple) else ((k,), (v,))
    B, N, T, H = q.shape
    K, S, V = ks[0].shape[1], sum(part.shape[2] for part in ks), vs[0].shape[3]
    ct = compute_dtype(q.dtype)
    pr = _precision(precision)
    add = empty = visible = tail = None
    if key_count is not None:  # (1, 1, 1, S): the keys that count
        tail = (jnp.arange(S, dtype=jnp.int32) < key_count)[None, None, None]
    if allowed is not None or bias is not None:
        ok = allowed
        if bias is not None:
            finite = bias > -jnp.inf
            ok = finite if ok is None else ok & finite
        if tail is not None:  # an empty row is one with no allowed key among those that count
            ok = ok & tail
        if sinks is None:
            empty = ~jnp.any(ok, axis=-1, keepdims=True)  # (B|1, N|1, T|1, 1): rows with no allowed key
            visible = ok | empty  # the positions mask() keeps, and an empty row's (computed finite, then replaced)
        else:  # an empty row's mass goes to the sink: nothing to replace
            visible = ok
        if bias is not None:  # 0 where hidden or in an empty row: the select below sets what is hidden
            add = jnp.where(ok, bias.astype(ct), jnp.asarray(0, ct))
    G = N // K

    def grouped(a):
        """A rank-4 (b, n, t, s) array broadcasting to (B, N, T, S) -> broadcasting to (B, K, G*T, S)."""
        b, n, t, s = a.shape
        if n > 1:  # per head: (b, N, T, s) -> (b, K, G*T, s)
            return jnp.broadcast_to(a, (b, N, T, s)).reshape(b, K, G * T, s)
        if t > 1 and G > 1:  # the same (T, s) for each of the G query heads of a K head
            return jnp.broadcast_to(a[:, :, None], (b, 1, G, T, s)).reshape(b, 1, G * T, s)
        return a

    # LOGITS and ATTEND with G and T as one axis (a free reshape of (B, N, T, H)), as impl_numpy's
    # matmuls do: XLA then fuses the whole expression, where a separate G axis costs a layout copy.
    qg = q.reshape(B, K, G * T, H).astype(ct)  # (B, K, G*T, H)
    x = [jnp.einsum(LOGITS.replace("G", ""), qg, part.astype(ct), precision=pr) for part in ks]
    x = (x[0] if len(x) == 1 else jnp.concatenate(x, axis=-1)) * jnp.asarray(scale, ct)  # (B, K, G*T, S)
    if softcap is not None:
        c = jnp.asarray(softcap, ct)
        x = jnp.tanh(x / c) * c
    if add is not None:
        x = x + grouped(add)  # (B, K, G*T, S)
    if tail is not None:
        # -inf added past key_count, not selected: a select would split the YNNPACK fusion of the dot from
        # its operand, and XLA CPU would copy the written buffer (see attend_by_reduce); safe because
        # those positions hold finite values (the contract's), so their logits are finite
        x = x + jnp.where(tail, jnp.asarray(0, ct), jnp.asarray(-jnp.inf, ct))
    if visible is not None:  # a hidden NaN or inf logit must not reach its row (as in mask())
        x = jnp.where(grouped(visible), x, jnp.asarray(-jnp.inf, ct))  # (B, K, G*T, S)
    row_max = x.max(axis=-1, keepdims=True)  # (B, K, G*T, 1)
    sink = None
    if sinks is not None:  # (N,) -> (1, K, G*T, 1): head n = k*G + g, row g*T + t
        sink = jnp.broadcast_to(sinks.astype(ct).reshape(1, K, G, 1, 1), (1, K, G, T, 1)).reshape(1, K, G * T, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = lax.stop_gradient(row_max)  # softmax is shift-invariant
    e = jnp.exp(x - row_max)  # (B, K, G*T, S)
    total = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - row_max)
    ctx, s0 = 0, 0
    for part in vs:  # each part's weights times its values
        w_part = e[..., s0:s0 + part.shape[2]]  # (B, K, G*T, s)
        if attend_by_reduce:  # (B, K, G*T, s, 1) x (B, K, 1, s, V) summed over s
            ctx = ctx + (w_part[..., None] * part.astype(ct)[:, :, None]).sum(axis=3)
        else:
            ctx = ctx + jnp.einsum(ATTEND.replace("G", ""), w_part, part.astype(ct), precision=pr)
        s0 += part.shape[2]
    ctx = ctx / total
    ctx = ctx.reshape(B, N, T, V)  # (B, N, T, V)
    if empty is not None:
        # the fill weights (0, 1/S or NaN) times V, as the stages' attend: V's gradient is the plain path's,
        # and "zero" gives 0 x V (NaN in a column where a value is NaN), not a plain 0
        if tail is None:
            v_sum = sum(part.astype(ct).sum(axis=2, keepdims=True) for part in vs)  # (B, K, 1, V)
        else:  # the keys that count only (an in-place buffer read whole is one part)
            counted = jnp.where(tail[0, 0, 0, :, None], vs[0].astype(ct), jnp.asarray(0, ct))  # (B, K, S, V)
            v_sum = counted.sum(axis=2, keepdims=True)
        v_sum = jnp.broadcast_to(v_sum[:, :, None], (B, K, N // K, 1, V)).reshape(B, N, 1, V)  # (B, N, 1, V)
        w = {"zero": 0.0, "uniform": 1.0 / (S if key_count is None else key_count), "nan": np.nan}[masked_row]
        fill = jnp.where(empty, jnp.asarray(w, ct), jnp.asarray(0, ct)) * v_sum  # NaN only on empty rows
        ctx = jnp.where(empty, fill, ctx)
    return ctx.astype(q.dtype)


# -- the call ------------------------------------------------------------------------

def plan(*, return_weights: bool, traced: bool, chunk_size: int | None, dropout: bool, dtype) -> Plan:
    """The path of a call: the chunked core when chunk_size is given; the
    stages when the weights or the trace are asked for, when a dropout
    keep-mask applies (dropout: training with a mask or a rate), or in
    16-bit storage (every stage's result is rounded to it); else
    fused_attention."""
    if chunk_size is not None:
        return Plan("chunked", f"chunk_size={chunk_size}")
    if return_weights or traced:
        return Plan("stages", "the weights or the trace are asked for")
    if dropout:
        return Plan("stages", "a dropout keep-mask applies (the stages apply it)")
    if compute_dtype(dtype) != dtype:
        return Plan("stages", f"{np.dtype(dtype).name} storage: every stage's result is rounded to it")
    return Plan("fused", "no weights, no trace, no dropout, float32/float64 storage")


def apply(
    config: AttentionConfig,
    params: dict[str, Any],
    query,
    key=None,
    value=None,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask=None,
    seed: int | None = None,
    rng=None,
    positions=None,
    key_positions=None,
    past_key=None,
    past_value=None,
    segment_ids=None,
    key_segment_ids=None,
    return_weights: bool = False,
    return_cache: bool = False,
    cache_length=None,
    precision: str = "highest",
    dtype: str | None = None,
    chunk_size: int | None = None,
    trace: list | None = None,
):
    """The forward pass, pure. Returns output (B, T, O); with return_weights
    also weights (B, N, T, P+S) after softmax and before dropout; with
    return_cache also present_key (B, K, P+S, H) and present_value (B, K,
    P+S, V): (output[, weights][, present_key, present_value]).

    params: canonical name -> array ("query.kernel" (D, N, H), ...).
    seed / rng: dropout in training without a dropout_mask: an int seed
    (static under jit) or a jax.random key (traced).
    positions (T,) or (B, T), key_positions (S,) or (B, S): integer RoPE
    positions (default P + arange); past_key (B, K, P, H) and past_value
    (B, K, P, V): the cache, after norm and RoPE; segment_ids (T,) or (B, T)
    and key_segment_ids (S_total,) or (B, S_total): packed sequences. All
    traced arrays under jit.
    cache_length: an in-place cache (the contract's; impl_numpy's). past_key
    (B, K, C, H) and past_value (B, K, C, V) are buffers of the storage dtype
    whose first cache_length = P positions are the cache; the call writes its
    new keys and values at P .. P+S-1 (lax.dynamic_update_slice) and computes
    what it would with past_key[:, :, :P]. JAX arrays are immutable, so it
    needs return_cache=True: present_key and present_value are the written
    buffers, whole (C positions). Written in place, without a copy of the
    cache, under jax.jit with the buffers donated (donate_argnums; the given
    arrays are then deleted: keep the returned ones for the next call);
    eagerly, or without donation, XLA writes a new buffer. A Python int is
    static (STATIC_ARGNAMES: each P compiles its own program). Under jit it
    may instead be a traced int32 scalar (one program for every P, as a
    decode loop wants): the call then attends over all C positions with
    those from P+S on hidden, so it takes no mask, bias, dropout, segment
    ids, return_weights, trace, chunk_size or masked_row='uniform' (each
    sized or weighted by P+S), and is_causal or a window needs
    causal_alignment='bottom_right' whatever P it is given, as a static P > 0
    does; its range 0 <= P <= C - S cannot be checked
    (XLA clamps a start past C - S to C - S: the caller's to keep in range).
    dtype: compute in this storage dtype (default: the params' dtype).
    chunk_size: exact online softmax over key (and query) blocks of this size;
    never holds a (T, S) array and skips key blocks the causal mask or a
    window hides (see chunked.py; static under jit). Not with return_weights
    or trace.
    trace: a list that receives a TraceEntry per stage (trace_stages(config));
    inside jit the entries hold tracers, so return them from the jitted
    function to read them (impl_jax.adapter does).
    """
    call = prepare(
        config, params, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed, rng=rng,
        positions=positions, key_positions=key_positions, past_key=past_key, past_value=past_value,
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, return_weights=return_weights,
        return_cache=return_cache, cache_length=cache_length, dtype=dtype, precision=precision,
        materializes_scores=chunk_size is None or return_weights,
    )
    chunk_size = check_chunk_size(chunk_size, return_weights=return_weights, traced=trace is not None)
    if call.traced_length and (trace is not None or chunk_size is not None):
        given = "trace" if trace is not None else f"chunk_size={chunk_size}"
        raise ValueError(f"a traced cache_length attends over the whole buffer and cannot take {given} (sized "
                         "by P + S, unknown at trace time): pass cache_length as a Python int (static)")
    p, pr, dtype = call.params, precision, call.dtype
    if chunk_size is not None:
        common = dict(mask=call.mask4, bias=call.bias4, keep=call.keep, is_causal=is_causal,
                      causal_alignment=causal_alignment, chunk_size=chunk_size, precision=precision)
        if not (config.is_modern or call.modern or return_cache):
            return chunked_attention(config, p, call.query, call.key, call.value, **common)
        # norm, rope and the cache as the stages, then the core on the heads (as impl_numpy's _fused_modern)
        q, k, v = qkv_heads(config, call, pr)
        out = chunked_attention(config, p, None, None, None, heads=(q, k, v), segment_ids=call.segment_ids,
                                key_segment_ids=call.key_segment_ids, **common)
        if call.cache_length is not None:
            k, v = call.past_key, call.past_value  # the written buffers, whole
        return (out, k, v) if return_cache else out
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    fused = plan(return_weights=return_weights, traced=trace is not None, chunk_size=None,
                 dropout=call.keep is not None, dtype=dtype).path == "fused"
    # A cache nobody asks back is never concatenated: the fused expression takes it and the new keys as
    # two parts (at P 32768 under jax.jit, 2 x 128 MiB: attention on the cache alone 67-71 ms,
    # concatenate then attention 133-163 ms, on the 2-core Xeon VM, 2026-11-25).
    parts = fused and call.past_key is not None and not return_cache
    in_place = call.cache_length is not None
    # An in-place cache on the fused path is read whole, the positions past P+S hidden (fused_attention's
    # key_count): XLA CPU writes a slice [:P+S] of the written buffer out before the dot, and then copies
    # the donated buffers as well (compiled HLO, jax 0.10.2, buffers (1, 8, 65536, 128) at P 61440: both
    # slices written out and 4 copies of the buffers; none when read whole). Reading the C - P - S spare
    # positions costs their share of one read instead. The paths that need exactly P+S keys (the stages:
    # trace and weights; chunked) take the slice.
    whole = in_place and (fused or call.traced_length)
    if whole:
        call.hides_tail = call.traced_length or call.shapes.P + call.shapes.S < call.shapes.capacity
        if call.hides_tail and not call.traced_length:
            pad_to_capacity(call)
    q, k, v = qkv_heads(config, call, pr, rec, append=not parts, whole=whole)
    allowed = call.allowed(config, is_causal, causal_alignment, tail=not fused)
    if fused:
        # nothing asks for the stages between: logits .. attend as one expression (the same
        # contractions; results equal to the stages' within the tolerance policy)
        if parts:
            k, v = (call.past_key, k), (call.past_value, v)
        ctx = fused_attention(q, k, v, allowed, call.bias4, config.effective_scale, config.masked_row, pr,
                              softcap=config.logit_softcap, sinks=p.get("sinks"),
                              key_count=call.cache_length + call.shapes.S if call.hides_tail else None,
                              attend_by_reduce=in_place and call.shapes.T == 1)
    else:
        x = rec("logits", F.logits(q, k, config.effective_scale, pr))  # (B, N, T, S_total)
        if config.logit_softcap is not None:
            x = rec("softcap", F.softcap(x, config.logit_softcap))
        x = rec("mask", F.mask_stage(x, allowed, call.bias4))
        w = rec("softmax", F.softmax(x, config.masked_row, p.get("sinks")))  # (B, N, T, S_total)
        wd = rec("dropout", F.dropout(w, call.keep, config.dropout))
        ctx = rec("attend", F.attend(wd, v, pr))  # (B, N, T, V)
    ctx = rec("merge_heads", F.merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", F.output(ctx, p["output.kernel"], p.get("output.bias"), pr))  # (B, T, O)
    if call.cache_length is not None:
        k, v = call.past_key, call.past_value  # the written buffers, whole
    result = (out,) + ((w,) if return_weights else ()) + ((k, v) if return_cache else ())
    return result[0] if len(result) == 1 else result


# The spec's name for the whole call.
multi_head_attention = apply
