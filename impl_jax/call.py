"""One call of impl_jax's attention, validated and cast: `check` (the
contract's checks in the reference's words, on static shapes and dtypes, so
it runs at jax.jit trace time), `prepare` (check, then every array in its
storage dtype) and the `Call` it returns, with the masks of an in-place
cache read whole (pad_to_capacity, in_place_allowed). attention.py runs the
call; this module imports neither it nor heads.py, fused.py or chunked.py.

float64 needs JAX's x64 mode: `check` refuses a float64 call without it
(X64_MESSAGE) instead of computing it in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weights import DTYPES, AttentionConfig, compute_dtype, dtype_from_name, validate_tensors
from weights.call import record
from weights.contract import (
    CallShapes,
    check_bias_values,
    check_cache_alignment,
    check_call,
    check_indexer_call,
    check_position_values,
    check_scores_fit,
    check_topk_values,
    in_place_buffer_error,
)
from weights.dtypes import is_float, resolve_dtype
from weights.rope import mrope_axes, rope_tables

from . import functional as F
from .functional import _precision

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
          materializes_scores=True, cache_length=None, past_key_positions=None, topk_indices=None,
          past_index_keys=None):
    """Validate a call in the reference's order and words; returns (CallShapes,
    storage dtype). Reads shapes and dtypes only, and bias values when bias
    is concrete. materializes_scores=False (the chunked path) skips the
    up-front refusal of (B, N, T, S) arrays that cannot fit in memory.
    cache_length: see apply; a traced one is range-checked as 0 (its value
    cannot be read) and shapes.P is then 0 (the caller keeps the tracer);
    is_causal or a window then needs bottom_right, as for any P > 0 (the
    contract's words without "(P=...)"). Position values are checked (a
    query temperature's) when positions are concrete, as bias values are."""
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
                    key_segment_ids=key_segment_ids, past_key_positions=past_key_positions, topk_indices=topk_indices)
    meta = {}
    for name, x in optional.items():
        meta.update(_meta(name, None if x is None else _as_array(x)))
    traced = is_traced_length(cache_length)
    if traced and config.kv_shared:
        raise ValueError("config.kv_shared needs a static cache_length (a Python int): the shared keys are the "
                         "cache's last T entries, sliced at cache_length - T")
    if traced:  # before check_call, which would judge these inputs' shapes against P = 0
        check_traced_length(config, dict(mask=mask, bias=bias, dropout_mask=dropout_mask, segment_ids=segment_ids,
                                         key_segment_ids=key_segment_ids, return_weights=return_weights,
                                         past_key_positions=past_key_positions, topk_indices=topk_indices,
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
    if positions is not None and is_concrete(positions):  # a query temperature's log counts positions from 0
        check_position_values(config, np.asarray(positions))
    if topk_indices is not None and is_concrete(topk_indices):  # (a traced selection: the adapter checked it)
        check_topk_values(np.asarray(topk_indices), shapes.P, shapes.S)
    if config.indexer is not None and traced:
        raise ValueError("config.indexer needs a static cache_length (a Python int): its index cache is sliced at P")
    check_indexer_call(config, topk_indices is not None, past_index_keys, shapes, cache_length)
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
    positions: Any  # (B|1, T) integer where the config reads positions (config.reads_positions), else None
    key_positions: Any  # (B|1, S)
    past_key: Any  # (B, K, P, H) or None; with cache_length the buffer (B, K, C, H)
    past_value: Any  # (B, K, P, V) or None; with cache_length (B, K, C, V)
    segment_ids: Any  # (T,) or (B, T), or None
    key_segment_ids: Any  # (S_total,) or (B, S_total)
    cache_length: Any = None  # P of an in-place cache: a Python int, or a traced int scalar (under jit); else None

    hides_tail: bool = False  # the keys are an in-place cache's whole buffers: positions past P+S to be hidden
    past_key_positions: Any = None  # (B|1, P) the cached keys' positions (default 0..P-1), or None
    selection: Any = None  # config.indexer's selection (B, T, k) or (B, K, T, k), or None
    topk: Any = None  # the selection that joined mask4 (topk_indices, or the indexer's), or None
    present_index_keys: Any = None  # (B, P+S, J); with cache_length the written buffer (B, C, J)
    # kv_shared (issue 42): the cache's last S = T entries, the queries' own keys and values (B, K, S, H|V)
    shared_key: Any = None
    shared_value: Any = None

    @property
    def traced_length(self) -> bool:
        """An in-place cache whose P is a tracer: the keys are the whole buffer, those from P + S on hidden."""
        return is_traced_length(self.cache_length)

    def allowed(self, config: AttentionConfig, is_causal: bool, causal_alignment: str, *, tail: bool = True):
        """mask AND causal AND window AND local chunks AND segments over every key (rank 4), or None.
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
                              segment_ids=self.segment_ids, key_segment_ids=self.key_segment_ids,
                              local_chunk=config.local_chunk, positions=self.positions,
                              key_positions=self.every_key_position)

    @property
    def max_position(self):
        """The call's largest position (its queries' and new keys'), a jax scalar (traced under jit): longrope's
        choice of table."""
        given = [x.max() for x in (self.positions, self.key_positions) if x is not None and x.size]
        return None if not given else given[0] if len(given) == 1 else jnp.maximum(*given)

    def rope_angles(self, config: AttentionConfig, positions):
        """F.rope_angles of positions (B|1, L) with this call's table (weights.rope.rope_tables): longrope's
        long table where the call's largest position + 1 passes original_max_position_embeddings, its short
        one otherwise. Positions are traced under jit, so both tables' angles are formed and one is selected
        (a select on integers: nothing reaches the gradient)."""
        inv_freq, _ = rope_tables(config.rope)
        angles = F.rope_angles(positions, inv_freq, self.dtype)  # (B|1, 1, L, R/2)
        scaling = config.rope.scaling
        if scaling is None or scaling.type != "longrope" or self.max_position is None:
            return angles
        original = scaling.original_max_position_embeddings
        long_freq, _ = rope_tables(config.rope, original)  # a largest position of `original`: the long table
        long = self.max_position + 1 > original
        return jnp.where(long, F.rope_angles(positions, long_freq, self.dtype), angles)

    @property
    def every_key_position(self):
        """(B|1, P+S): the cache's keys at past_key_positions (0..P-1 by default), then key_positions (where
        the config reads positions), or None; an in-place cache read whole (hides_tail): (B|1, C), its
        buffer's slots."""
        if self.key_positions is None:
            return None
        if self.hides_tail:
            return F.all_key_positions(self.key_positions, self.cache_length, self.shapes.capacity,
                                       self.past_key_positions)
        return F.all_key_positions(self.key_positions, self.shapes.P, past_key_positions=self.past_key_positions)

    def temperature_positions(self, config: AttentionConfig):
        """(B|1, T): the positions the query temperature reads (functional.temperature_positions); an
        in-place cache's P may be traced."""
        P = self.shapes.P if self.cache_length is None else self.cache_length
        return F.temperature_positions(self.positions, config.query_temperature.position, P, self.shapes.T)

    def alibi_bias(self, config: AttentionConfig):
        """ALiBi's (B|1, N, T, P+S) bias in compute dtype (functional.alibi_bias), over every key the call
        reads (an in-place buffer read whole: its C slots)."""
        return F.alibi_bias(self.params["alibi.slopes"], self.positions, self.every_key_position, self.dtype,
                            config.alibi_bias_dtype)

    @property
    def modern(self) -> bool:
        """Uses a cache or packed segments (the config's own features: config.is_modern)."""
        return self.past_key is not None or self.segment_ids is not None


def prepare(config, params, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, rng, return_weights, dtype, precision, positions=None, key_positions=None,
            past_key=None, past_value=None, segment_ids=None, key_segment_ids=None, return_cache=False,
            cache_length=None, materializes_scores=True, past_key_positions=None, topk_indices=None,
            past_index_keys=None, trace: list | None = None) -> Call:
    """Validate a call (`check`) and cast everything to the storage dtype. topk_indices joins the mask (mask4 =
    mask AND F.selection_mask), as impl_numpy's; with config.indexer its selection does (run_indexer), a trace
    receiving its stages first."""
    shapes, dtype = check(
        config, params, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask, is_causal=is_causal,
        causal_alignment=causal_alignment, training=training, seed=seed, rng=rng, positions=positions,
        key_positions=key_positions, past_key=past_key, past_value=past_value, segment_ids=segment_ids,
        key_segment_ids=key_segment_ids, return_weights=return_weights, return_cache=return_cache, dtype=dtype,
        precision=precision, materializes_scores=materializes_scores, cache_length=cache_length,
        past_key_positions=past_key_positions, topk_indices=topk_indices, past_index_keys=past_index_keys,
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
    if topk_indices is not None:  # the selection joins the mask: (B, 1|N, T, S_total)
        selected = F.selection_mask(_as_array(topk_indices), config.num_heads, shapes.S_total)
        mask4 = selected if mask4 is None else mask4 & selected
    query = _as_array(query)
    key = query if key is None else _as_array(key)
    value = key if value is None else _as_array(value)
    segment_ids, key_segment_ids = _ids(segment_ids), _ids(key_segment_ids)
    if segment_ids is not None and key_segment_ids is None:
        key_segment_ids = segment_ids  # self-attention without a cache: the keys are the queries (check_call)
    rope = config.reads_positions  # RoPE, ALiBi, local chunks and the temperature read the positions
    P = shapes.P if cache_length is None else cache_length  # the new tokens' default positions start at P
    call = Call(
        shapes=shapes, params=cast_params, query=_cast(query, dtype), key=_cast(key, dtype),
        value=_cast(value, dtype), mask4=mask4, bias4=bias, keep=keep, dtype=dtype,
        positions=F.default_positions(_ids(positions), P, shapes.T) if rope else None,
        key_positions=F.default_positions(_ids(key_positions), P, shapes.S) if rope else None,
        past_key=None if past_key is None else _cast(_as_array(past_key), dtype),
        past_value=None if past_value is None else _cast(_as_array(past_value), dtype),
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, cache_length=cache_length,
        past_key_positions=F.default_positions(_ids(past_key_positions), 0, shapes.P)
        if rope and past_key_positions is not None else None,
        topk=None if topk_indices is None else jnp.asarray(_as_array(topk_indices)),
    )
    axes = None if config.rope is None else mrope_axes(config.rope)
    if axes is not None:  # multimodal RoPE: each rotating pair's position, (B|1, L, R/2); nothing reads the cache's
        call.positions = F.mrope_positions(_ids(positions), P, shapes.T, axes)
        call.key_positions = F.mrope_positions(_ids(key_positions), P, shapes.S, axes)
        call.past_key_positions = None
    if config.indexer is not None:
        run_indexer(config, call, is_causal, causal_alignment, positions, key_positions, past_index_keys,
                    rec=lambda stage, value: record(trace, stage, value))
    if config.kv_shared:
        share_cache(call)
    return call


def share_cache(call: Call) -> None:
    """kv_shared (issue 42; impl_numpy.attention.share_cache): the given cache's last S = T entries become
    call.shared_key / shared_value, read, never written; the cache before them is call.past_key / past_value (an
    in-place cache's buffers stay whole; its P is static: check refuses a traced one)."""
    P, S = call.shapes.P, call.shapes.S
    call.shared_key, call.shared_value = call.past_key[:, :, P:P + S], call.past_value[:, :, P:P + S]
    if call.cache_length is None:
        call.past_key, call.past_value = call.past_key[:, :, :P], call.past_value[:, :, :P]


def run_indexer(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str, positions,
                key_positions, past_index_keys, rec=lambda stage, value: value) -> None:
    """impl_numpy.attention.run_indexer in JAX: the indexer's selection (impl_jax.indexer) over the keys every
    other mask shows (call.allowed before the selection joins it, any head's), joined to call.mask4;
    call.selection and call.present_index_keys set (an in-place cache: the new index keys written into the
    buffer at P..P+S-1, the buffer whole). Under lax.stop_gradient: the selection is piecewise constant, and
    the indexer's tensors get no gradient from the output (zeros)."""
    from .indexer import lightning_indexer

    T, S, P = call.shapes.T, call.shapes.S, call.shapes.P
    allowed = call.allowed(config, is_causal, causal_alignment)
    mask = None if allowed is None else jnp.broadcast_to(jnp.any(allowed, axis=1, keepdims=True),
                                                         (allowed.shape[0], 1, T, P + S))
    buffer = past = None if past_index_keys is None else _as_array(past_index_keys)
    if buffer is not None and call.cache_length is not None:
        past = buffer[:, :P]
    sg = jax.lax.stop_gradient
    result = lightning_indexer(config, {n: sg(t) for n, t in call.params.items()}, sg(call.query), sg(call.key),
                               positions=None if positions is None else _ids(positions),
                               key_positions=None if key_positions is None else _ids(key_positions),
                               past_index_keys=None if past is None else sg(past), mask=mask, is_causal=False,
                               dtype=np.dtype(call.dtype).name, precision=config.indexer.scoring_precision,
                               fp8_scale_format=config.indexer.fp8_scale_format, rec=rec)
    present = result["present_index_keys"]
    if buffer is not None and call.cache_length is not None:
        present = jax.lax.dynamic_update_slice(_cast(buffer, call.dtype), present[:, P:], (0, P, 0))
    call.selection, call.present_index_keys = result["topk_indices"], present
    call.topk = call.selection
    selected = F.selection_mask(call.selection, config.num_heads, call.shapes.S_total)
    call.mask4 = selected if call.mask4 is None else call.mask4 & selected


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
    local chunks over the slots' positions, and with tail=True key j < P + S. Rank 4 (B|1, N|1, T, C), or None."""
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
    if config.local_chunk is not None:  # the buffer's slots at their positions (Call.every_key_position)
        chunks = F.chunk_mask(call.positions, call.every_key_position, config.local_chunk)  # (B|1, 1, T, C)
        allowed = chunks if allowed is None else allowed & chunks
    if call.segment_ids is not None:
        segments = F.segment_mask(call.segment_ids, call.key_segment_ids)  # (B|1, 1, T, C)
        allowed = segments if allowed is None else allowed & segments
    return allowed

